"""Start-up self-checks of the GPU path: attention backend and one served layer against float32 CPU references.

No GPU takes part in this project's development or tests, so the CUDA path checks itself where it
runs, before it serves anyone:

* attention: the chosen backend on random pages of the model's shape and dtype (decode, prefill with
  a causal offset, a ragged batch of both; for a model with a sliding window, a windowed decode and a
  windowed mixed batch, which FlashInfer runs through different wrappers), against the PyTorch paged
  attention in float32 on the CPU. With `auto`, a backend that errs or disagrees is logged in one line and
  replaced by the PyTorch backend; an explicitly requested `flashinfer` refuses to start instead.
  Then, for a model without a window, a draft tree beside a chain and a decode (FlashInfer plans it with a
  custom mask): the backend verifies draft trees (ServerInfo.draft_trees) only if it passes; if not, it
  serves chains only (logged in one line).
* the served layer: the bundle's first served layer as the server will run it (its dtype, its
  quantised kernels) against the same layer dequantised to float32 on the CPU, over a prefill, a
  decode step and a step of a few positions (speculative verification), since kernels may take
  another path for a few rows than for many (int8's CUDA kernel runs only a few). Quantised weights
  whose kernel disagrees fall back to dequantising on each call (logged); a layer that is wrong even
  so refuses to start.

Both compare what the GPU path adds and nothing else: the same weights, the same inputs, the same
pages. The thresholds sit far above reduced-precision rounding and far below what a wrong kernel does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from infemeral.errors import InfemeralError
from infemeral.layers.stack import LayerStack
from infemeral.layers.attention_backends.torch_backend import TorchBackend, torch_paged_attention
from infemeral.quant import served

log = logging.getLogger(__name__)

# max |backend - reference| on unit-scale random inputs, by activation dtype (NaN anywhere fails, whatever these are)
ATTENTION_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
# ||layer(x) - x - (reference(x) - x)|| / ||reference(x) - x||, what the layer adds, by activation dtype. The output
# is rounded with the residual in it, so where a layer adds little to x, more of bf16's rounding shows (up to ~7 %
# on a random tiny model); a wrong kernel is off by the order of the whole.
LAYER_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.2, torch.float16: 0.05}


@dataclass(frozen=True)
class AttentionCase:
    name: str
    kv_lengths: tuple[int, ...]  # cache length of each sequence, new tokens included
    new_tokens: tuple[int, ...]
    window: int | None = None  # checked with the model's window where it is smaller; run only if it has one
    trees: tuple[tuple[int, ...] | None, ...] | None = None  # per sequence, a draft tree's parents (None: a chain)


ATTENTION_CASES = (
    AttentionCase("decode", (7, 100, 300), (1, 1, 1)),
    AttentionCase("prefill with a causal offset", (200,), (64,)),
    AttentionCase("sliding window, decode", (300, 90, 40), (1, 1, 1), window=64),
    AttentionCase("sliding window, mixed batch", (300, 90), (16, 1), window=64),
    AttentionCase("ragged batch", (5, 130, 40, 260), (5, 1, 8, 1)),
)
# a tree of 7 rows (two children of the root, two under the first, one below each of three) beside a chain of 5
# and a decode: each tree row reads the cache, its ancestors and itself; the others read causally
TREE_CASES = (
    AttentionCase("draft tree beside a chain and a decode", (40, 107, 60), (7, 5, 1),
                  trees=((-1, 0, 0, 1, 1, 2, 3), None, None)),
)
# the steps of the served-layer check, in positions: a prefill, one decode step, a speculative verification
LAYER_STEPS = (("prefill", 24), ("decode", 1), ("a few positions", 3))


class SelfCheckFailed(InfemeralError):
    """The GPU path disagreed with its reference and there is nothing safe to fall back to."""


class _Batch:
    """What a backend reads of a PagedBatch: the CSR arrays (int32, on the host) and each sequence's tree."""

    def __init__(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, trees=None):
        self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len = (
            qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        self.trees = trees


def random_pages(case: AttentionCase, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 seed: int = 0):
    """Scattered pages of random float32 keys/values on the CPU (NaN in every slot no sequence owns), queries, CSR."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in case.kv_lengths) + 4
    k = torch.full((num_pages, page_size, num_kv_heads, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    order = torch.randperm(num_pages, generator=g).tolist()
    kv_indptr, indices, last = [0], [], []
    for length in case.kv_lengths:
        count = -(-length // page_size)
        pages, order = order[:count], order[count:]
        for i, p in enumerate(pages):
            fill = min(page_size, length - i * page_size)
            k[p, :fill] = torch.randn(fill, num_kv_heads, head_dim, generator=g)
            v[p, :fill] = torch.randn(fill, num_kv_heads, head_dim, generator=g)
        indices += pages
        kv_indptr.append(kv_indptr[-1] + count)
        last.append(length - (count - 1) * page_size)
    qo = [0]
    for n in case.new_tokens:
        qo.append(qo[-1] + n)
    q = torch.randn(qo[-1], num_qo_heads, head_dim, generator=g)
    csr = [torch.tensor(x, dtype=torch.int32) for x in (qo, kv_indptr, indices, last)]
    return q, k, v, csr


def attention_cases(sliding_window: int | None) -> list[AttentionCase]:
    """The cases a model needs: the window cases only with a window, and then no wider than the model's (a
    window that binds within the cases' few hundred positions checks the masking a larger one uses)."""
    if sliding_window is None:
        return [case for case in ATTENTION_CASES if case.window is None]
    return [case if case.window is None else replace(case, window=min(case.window, sliding_window))
            for case in ATTENTION_CASES]


def attention_failure(backend, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                      page_size: int, dtype: torch.dtype, sliding_window: int | None = None,
                      cases: list[AttentionCase] | None = None) -> str | None:
    """None if `backend` matches the float32 CPU reference on every case the model needs (or of `cases`); else
    what went wrong, in one line."""
    tolerance = ATTENTION_TOLERANCE[dtype]
    scale = head_dim ** -0.5
    for case in attention_cases(sliding_window) if cases is None else cases:
        q, k, v, csr = random_pages(case, num_qo_heads, num_kv_heads, head_dim, page_size)
        trees = [list(t) if t is not None else None for t in case.trees] if case.trees else None
        want = torch_paged_attention(q, k, v, *csr, scale, case.window, trees)
        batch = _Batch(*csr, trees)
        try:
            backend.plan(batch)
            got = backend.run(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), batch, scale,
                              case.window)
            got = got.float().cpu()
        except Exception as e:  # noqa: BLE001 - any failure of the backend is the finding
            return f"{case.name}: {type(e).__name__}: {e}"
        if got.shape != want.shape:
            return f"{case.name}: output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if not bool(torch.isfinite(got).all()):
            return f"{case.name}: non-finite output"
        error = float((got - want).abs().max())
        if not error <= tolerance:  # NaN compares false both ways
            return f"{case.name}: max |{backend.name} - reference| = {error:.2e} (limit {tolerance:.0e})"
    return None


def checked_attention(requested: str, backend, device: torch.device, num_qo_heads: int, num_kv_heads: int,
                      head_dim: int, page_size: int, dtype: torch.dtype, sliding_window: int | None = None):
    """The backend to serve with: `backend` if it passes; with `auto`, the PyTorch backend if it does not; its
    `draft_trees` set by the tree case (`checked_trees`). `sliding_window`: the served layers' window (None:
    they have none, and the window cases are skipped)."""
    shape = (device, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, sliding_window)
    failure = attention_failure(backend, *shape)
    if failure is None:
        log.info("attention self-check passed: %s backend on %s in %s", backend.name, device, _name(dtype))
        return checked_trees(backend, *shape)
    if backend.name == "torch":
        raise SelfCheckFailed(f"the PyTorch attention backend failed its self-check on {device} ({failure}); "
                              "this torch build or device is not usable: try --dtype float32 or another device")
    if requested != "auto":
        raise SelfCheckFailed(f"attention backend {backend.name!r} failed its start-up self-check on {device} "
                              f"({failure}); refusing to start. Use --attention-backend torch, or auto to fall "
                              "back to it by itself")
    log.warning("attention self-check: %s failed (%s); serving with the PyTorch backend", backend.name, failure)
    fallback = TorchBackend()
    failure = attention_failure(fallback, *shape)
    if failure is not None:
        raise SelfCheckFailed(f"the PyTorch attention backend failed its self-check on {device} too ({failure})")
    return checked_trees(fallback, *shape)


def checked_trees(backend, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                  page_size: int, dtype: torch.dtype, sliding_window: int | None = None):
    """`backend`, verifying draft trees (its `draft_trees`) only where its tree case matches the reference here: a
    tree's mask is a separate plan (FlashInfer's custom mask), so a backend right on chains may still be wrong on
    trees, and then it serves chains only. A model with a window takes no trees (and is not checked)."""
    if sliding_window is not None:
        return backend
    failure = attention_failure(backend, device, num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
                                cases=list(TREE_CASES))
    backend.draft_trees = failure is None
    if failure is None:
        log.info("draft-tree self-check passed: %s backend verifies draft trees", backend.name)
    else:
        log.warning("draft-tree self-check: %s failed (%s); verifying chains only", backend.name, failure)
    return backend


def layer_failure(bundle, dtype: torch.dtype, device: torch.device, use_kernels: bool = True,
                  seed: int = 0) -> str | None:
    """None if the bundle's first served layer, run here as the server runs it, matches float32 on the CPU at
    every step of LAYER_STEPS."""
    index = bundle.first_layer
    stored = bundle.layer_weights(index)
    reference = LayerStack(bundle.config, index, [served.dequantize_layer(stored)], dtype=torch.float32)
    try:
        candidate = served.load_stack(bundle, dtype, device, use_kernels, layers=range(index, index + 1))
    except Exception as e:  # noqa: BLE001 - a layer that cannot even load is the finding
        return f"loading: {type(e).__name__}: {e}"
    positions = sum(n for _, n in LAYER_STEPS)
    x = torch.randn(positions, bundle.config.hidden_size, generator=torch.Generator().manual_seed(seed))
    caches = [reference.new_cache(positions), candidate.new_cache(positions)]
    start = 0
    try:
        for step, n in LAYER_STEPS:
            rows = x[start:start + n]
            start += n
            want = reference(rows, caches[0]) - rows
            got = candidate(rows.to(device, dtype), caches[1]).float().cpu() - rows.to(dtype).float()
            if not bool(torch.isfinite(got).all()):
                return f"{step}: non-finite output"
            error = float((got - want).norm() / want.norm())
            if not error <= LAYER_TOLERANCE[dtype]:  # NaN compares false both ways
                return f"{step}: relative error {error:.2e} (limit {LAYER_TOLERANCE[dtype]:.0e})"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def checked_kernels(bundle, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the served layers may use their quantised kernels here (False: dequantise on each call)."""
    quant = served.ServerQuant.from_manifest(bundle.manifest)
    failure = layer_failure(bundle, dtype, device)
    if failure is None:
        log.info("served-layer self-check passed: %s on %s in %s", quant.describe(), device, _name(dtype))
        return True
    if not quant.is_quantized:
        raise SelfCheckFailed(f"the served layer disagrees with its float32 reference on {device} in "
                              f"{_name(dtype)} ({failure}); try --dtype float32")
    fallback = layer_failure(bundle, dtype, device, use_kernels=False)
    if fallback is not None:
        raise SelfCheckFailed(f"the {quant.scheme} served layer disagrees with its float32 reference on {device} "
                              f"even without its kernel ({fallback}; with it: {failure})")
    log.warning("served-layer self-check: the kernels of %s failed (%s); dequantising the weights on each call "
                "instead", quant.describe(), failure)
    return False


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

