"""Paged attention and the page pool: exact against a naive per-sequence reference, and isolated."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infemeral.kvcache.paged import KVPages, PagedBatch, PagedSequence, PagePool, PoolExhausted
from infemeral.layers.attention import attend
from infemeral.layers.attention_backends import flashinfer_backend
from infemeral.layers.attention_backends.batch_shape import BatchShape
from infemeral.layers.attention_backends.flashinfer_backend import FlashInferBackend
from infemeral.layers.attention_backends.selector import select_backend
from infemeral.layers.attention_backends.torch_backend import (IN_PLACE_MIN_TOKENS, TorchBackend, TorchPlan,
                                                               torch_paged_attention)

PAGE, KVH, H, D = 16, 2, 6, 8


def naive(q, k, v, scale, window=None):
    """q [n, H, D] are the last n positions of k/v [L, KVH, D]; plain softmax attention, causal (and windowed)."""
    n, L, h, kvh = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    query_pos = (L - n + torch.arange(n))[:, None]
    allowed = torch.arange(L)[None, :] <= query_pos
    if window is not None:
        allowed &= torch.arange(L)[None, :] > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def scattered_pages(lengths, num_pages=64, seed=0, kv_heads=KVH, junk=None):
    """Random K/V per sequence, written to randomly chosen (non-contiguous) pages of a pool."""
    g = torch.Generator().manual_seed(seed)
    k_pages = torch.randn(num_pages, PAGE, kv_heads, D, generator=g) * 100  # junk everywhere else
    v_pages = torch.randn(num_pages, PAGE, kv_heads, D, generator=g) * 100
    if junk is not None:
        k_pages.fill_(junk)
        v_pages.fill_(junk)
    order = torch.randperm(num_pages, generator=g).tolist()
    seqs, indptr, indices, last = [], [0], [], []
    for L in lengths:
        n_pages = -(-L // PAGE)
        pages, order = order[:n_pages], order[n_pages:]
        k, v = torch.randn(L, kv_heads, D, generator=g), torch.randn(L, kv_heads, D, generator=g)
        for i, p in enumerate(pages):
            chunk = slice(i * PAGE, min(L, (i + 1) * PAGE))
            k_pages[p, : chunk.stop - chunk.start] = k[chunk]
            v_pages[p, : chunk.stop - chunk.start] = v[chunk]
        seqs.append((k, v))
        indices += pages
        indptr.append(indptr[-1] + n_pages)
        last.append(L - (n_pages - 1) * PAGE)
    csr = (torch.tensor(indptr), torch.tensor(indices), torch.tensor(last))
    return seqs, k_pages, v_pages, csr


CASES = {
    "shorter than a page, decode": ([5], [1]),
    "shorter than a page, prefill": ([5], [5]),
    "20 and 180 tokens, decode": ([20, 180], [1, 1]),
    "20 and 180 tokens, prefill + decode": ([20, 180], [20, 1]),
    "exactly one page": ([PAGE], [PAGE]),
    "one page + 1": ([PAGE + 1], [3]),
    "mixed batch": ([1, PAGE, PAGE + 1, 77, 180], [1, 7, PAGE + 1, 1, 40]),
}


@pytest.mark.parametrize("case", CASES)
def test_torch_paged_attention_matches_naive_reference(case):
    lengths, queries = CASES[case]
    seqs, k_pages, v_pages, (kv_indptr, kv_indices, last) = scattered_pages(lengths)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(queries), H, D, generator=g)
    qo_indptr = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    scale = D ** -0.5
    out = torch_paged_attention(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, last, scale)
    for i, (k, v) in enumerate(seqs):
        rows = slice(qo_indptr[i], qo_indptr[i + 1])
        assert (out[rows] - naive(q[rows], k, v, scale)).abs().max() < 1e-4, (case, i)


BATCHED = {  # (lengths, new tokens per sequence, query heads, KV heads, sliding window)
    "decode, mixed lengths, GQA 3:1": ([3, 16, 17, 40, 100, 250, 9, 33], [1] * 8, 6, 2, None),
    "decode, GQA 4:1": ([50, 60, 7, 120], [1, 1, 1, 1], 8, 2, None),
    "decode, multi-head": ([30, 20, 64, 65], [1, 1, 1, 1], 4, 4, None),
    "decode, sliding window": ([5, 40, 100, 23], [1] * 4, 6, 2, 24),
    "verify drafts + decode": ([20, 44, 90, 25, 50], [5, 1, 3, 5, 1], 6, 2, None),
    "prefill + drafts + decode, window": ([120, 30, 61, 8, 55], [70, 4, 1, 1, 1], 6, 2, 32),
}


def csr_of(queries):
    return torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())


@pytest.mark.parametrize("case", BATCHED)
def test_batched_torch_attention_matches_naive_reference(case):
    lengths, queries, heads, kv_heads, window = BATCHED[case]
    seqs, k_pages, v_pages, (kv_indptr, kv_indices, last) = scattered_pages(lengths, kv_heads=kv_heads)
    q = torch.randn(sum(queries), heads, D, generator=torch.Generator().manual_seed(1))
    qo = csr_of(queries)
    plan = TorchPlan(BatchShape.from_csr(qo, kv_indptr, kv_indices, last, PAGE), torch.device("cpu"))
    assert any(len(g.members) >= 2 for g in plan.groups)  # padded batches, not a loop, ran these
    out = plan.run(q, k_pages, v_pages, D ** -0.5, window)
    for i, (k, v) in enumerate(seqs):
        rows = slice(qo[i], qo[i + 1])
        assert (out[rows] - naive(q[rows], k, v, D ** -0.5, window)).abs().max() < 1e-4, (case, i)


def test_batched_decode_is_bit_identical_to_each_sequence_alone():
    """Why 16 concurrent sessions get exactly their solo tokens: batching changes no bit of a session's output."""
    lengths = [3, 17, 40, 100, 250, 9, 33, 64]
    seqs, k_pages, v_pages, (kv_indptr, kv_indices, last) = scattered_pages(lengths)
    q = torch.randn(len(lengths), H, D, generator=torch.Generator().manual_seed(1))
    together = torch_paged_attention(q, k_pages, v_pages, csr_of([1] * 8), kv_indptr, kv_indices, last, D ** -0.5)
    for i in range(len(lengths)):
        pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
        alone = torch_paged_attention(q[i:i + 1], k_pages, v_pages, torch.tensor([0, 1]),
                                      torch.tensor([0, len(pages)]), pages, last[i:i + 1], D ** -0.5)
        assert torch.equal(together[i], alone[0]), i


@pytest.mark.parametrize("poison", [float("nan"), 1e30, float("inf")])
def test_batched_attention_ignores_foreign_pages_and_own_slots_past_the_length(poison):
    lengths, queries = [20, 35, 9, 50, 300], [1, 1, 4, 1, 1]
    clean = scattered_pages(lengths, junk=0.0)
    dirty = scattered_pages(lengths, junk=poison)  # same data; every other slot of the pool poisoned
    (_, kc, vc, csr), (_, kd, vd, _) = clean, dirty
    q = torch.randn(sum(queries), H, D, generator=torch.Generator().manual_seed(3))
    a = torch_paged_attention(q, kc, vc, csr_of(queries), *csr, D ** -0.5)
    b = torch_paged_attention(q, kd, vd, csr_of(queries), *csr, D ** -0.5)
    assert torch.isfinite(b).all()
    assert torch.equal(a, b)


def test_long_caches_and_prefills_get_their_own_sdpa_short_decodes_are_grouped_by_length():
    lengths, queries = [IN_PLACE_MIN_TOKENS + 5, 30, 12, 70, 40, 31], [1, 1, 1, 1, 40, 1]
    _, _, _, (indptr, indices, last) = scattered_pages(lengths)
    plan = TorchPlan(BatchShape.from_csr(csr_of(queries), indptr, indices, last, PAGE), torch.device("cpu"))
    assert plan.singles == [0, 4]
    assert [g.members for g in plan.groups] == [[1, 2, 5], [3]]  # 32-token steps: 30, 12, 31 | 70


def test_batch_shapes_that_cannot_be_right_are_refused():
    with pytest.raises(ValueError, match="kv_last_page_len"):
        BatchShape.from_csr(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([0]), PAGE)
    with pytest.raises(ValueError, match="new tokens"):
        BatchShape.from_csr(torch.tensor([0, 9]), torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([5]), PAGE)


def test_contiguous_attention_matches_naive_reference():
    g = torch.Generator().manual_seed(2)
    k, v, q = torch.randn(40, KVH, D, generator=g), torch.randn(40, KVH, D, generator=g), torch.randn(7, H, D, generator=g)
    out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], D ** -0.5)[0]
    assert (out - naive(q, k, v, D ** -0.5)).abs().max() < 1e-4


def make_pages(pages=32) -> tuple[PagePool, KVPages]:
    """The pool that counts the pages, and the keys and values in them."""
    return PagePool(pages, PAGE), KVPages(pages, PAGE, first_layer=3, num_layers=2, kv_heads=KVH, head_dim=D,
                                          dtype=torch.float32)


def run_batch(kv, seqs, new, seed):
    """Write new K/V for each sequence through a PagedBatch (as the model's layers do) and attend."""
    g = torch.Generator().manual_seed(seed)
    for s, n in zip(seqs, new):
        s.reserve(s.length + n)
    batch = PagedBatch(kv, seqs, new, TorchBackend())
    total = sum(new)
    k, v = torch.randn(1, KVH, total, D, generator=g), torch.randn(1, KVH, total, D, generator=g)
    q = torch.randn(1, H, total, D, generator=g)
    out = []
    for layer in (3, 4):
        batch.update(k, v, layer)
        out.append(batch.attend(layer, q, D ** -0.5))
    batch.finish()
    return torch.stack(out)


def test_isolation_other_sessions_pages_cannot_leak_in():
    pool, kv = make_pages()
    a, b, c = (PagedSequence(pool, kv) for _ in range(3))
    run_batch(kv, [a, b, c], [20, 35, 3], seed=0)
    reference = run_batch(kv, [a], [1], seed=5)
    a.truncate(1)  # undo the decode step and redo it with poisoned neighbours
    for store in (kv.k, kv.v):
        for t in store:
            t[b.pages] = 1e30
            t[c.pages[0]] = float("nan")
            free = sorted(set(range(pool.num_pages)) - set(a.pages) - set(b.pages) - set(c.pages))
            t[free] = float("nan")
    poisoned = run_batch(kv, [a], [1], seed=5)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, reference)


def test_writes_land_only_in_the_sessions_own_pages():
    pool, kv = make_pages()
    a, b = PagedSequence(pool, kv), PagedSequence(pool, kv)
    run_batch(kv, [a, b], [9, 30], seed=0)
    before = [t.clone() for t in kv.k + kv.v]
    run_batch(kv, [a, b], [PAGE, 1], seed=1)
    owned = set(a.pages) | set(b.pages)
    for old, new in zip(before, kv.k + kv.v):
        differs = old.view(torch.int32) != new.view(torch.int32)  # bitwise: untouched pool memory may hold NaN
        changed = {int(p) for p in differs.flatten(1).any(1).nonzero().flatten()}
        assert changed <= owned
        # and inside owned pages, only the new positions changed
        for seq, start, n in ((a, 9, PAGE), (b, 30, 1)):
            pages, offsets = seq.slots(0, start)
            assert torch.equal(old[pages, offsets], new[pages, offsets])


def test_pool_allocation_release_and_exhaustion():
    pool, kv = make_pages(pages=4)
    a = PagedSequence(pool, kv)
    a.reserve(3 * PAGE)
    assert pool.free_pages == 1
    b = PagedSequence(pool, kv)
    with pytest.raises(PoolExhausted, match="retry"):
        b.reserve(2 * PAGE)
    assert b.pages == [] and pool.free_pages == 1  # a failed reservation takes nothing
    kv.k[0][a.pages] = 7.0
    a.wipe()
    assert pool.free_pages == 4
    assert (kv.k[0] == 7.0).sum() == 0  # freed pages were zeroed
    b.reserve(4 * PAGE)
    assert sorted(b.pages) == [0, 1, 2, 3]


def test_backend_selection():
    assert select_backend("auto", torch.device("cpu"), H, KVH, D, PAGE, torch.float32).name == "torch"
    assert select_backend("torch", torch.device("cpu"), H, KVH, D, PAGE, torch.float32).name == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("flashinfer", torch.device("cpu"), H, KVH, D, PAGE, torch.float32)
    with pytest.raises(ValueError):
        select_backend("magic", torch.device("cpu"), H, KVH, D, PAGE, torch.float32)


class FakeFlashInfer:
    """Stands in for the flashinfer module on a CPU: records every plan()/run() the backend makes and answers
    with the PyTorch backend, so the arguments FlashInfer would get are checked without a GPU."""

    def __init__(self):
        self.calls = []

        class Wrapper:
            kind = None

            def __init__(wrapper, workspace, kv_layout, **kwargs):
                assert kv_layout == "NHD"
                wrapper.options = kwargs
                self.calls.append((wrapper.kind, "new", kwargs))

            def plan(wrapper, *args, **kwargs):
                self.calls.append((wrapper.kind, "plan", args, kwargs))
                if wrapper.kind == "decode":
                    indptr, indices, last = args[:3]
                    qo = torch.arange(len(last) + 1, dtype=torch.int32)
                else:
                    qo, indptr, indices, last = args[:4]
                    assert kwargs["causal"] is True
                wrapper.csr = (qo, indptr, indices, last)
                wrapper.kwargs = kwargs

            def run(wrapper, q, kv):
                self.calls.append((wrapper.kind, "run"))
                window = wrapper.kwargs["window_left"] + 1 if wrapper.kwargs["window_left"] >= 0 else None
                return torch_paged_attention(q, kv[0], kv[1], *wrapper.csr, wrapper.kwargs["sm_scale"], window)

        self.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (Wrapper,), {"kind": "decode"})
        self.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (Wrapper,), {"kind": "prefill"})

    def plans(self):
        return [c for c in self.calls if c[1] == "plan"]


def flashinfer_batch(new_tokens, heads=H, seed=0):
    """A PagedBatch over the fake FlashInfer backend, its sequences' K/V written; returns (batch, backend, fake)."""
    pool, kv = make_pages()
    fake = FakeFlashInfer()
    backend = FlashInferBackend(torch.device("cpu"), heads, KVH, D, PAGE, torch.float32, module=fake)
    seqs = [PagedSequence(pool, kv) for _ in new_tokens]
    for s, n in zip(seqs, (20, 35, 3)):
        s.reserve(n + 1)
        run_batch(kv, [s], [n], seed)
    for s, n in zip(seqs, new_tokens):
        s.reserve(s.length + n)
    batch = PagedBatch(kv, seqs, new_tokens, backend)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in (3, 4):  # the new positions' keys/values, as the layers write them before attending
        batch.update(torch.randn(1, KVH, sum(new_tokens), D, generator=g),
                     torch.randn(1, KVH, sum(new_tokens), D, generator=g), layer)
    return batch, backend, fake


@pytest.mark.parametrize("new_tokens, kind", [([1, 1, 1], "decode"), ([1, 5, 1], "prefill")])
def test_flashinfer_gets_host_int32_indices_one_plan_per_batch_and_the_right_wrapper(new_tokens, kind):
    batch, backend, fake = flashinfer_batch(new_tokens)
    q = torch.randn(sum(new_tokens), H, D, generator=torch.Generator().manual_seed(4))
    for layer in range(batch.kv.num_layers):
        for _ in range(2):  # every layer of the forward pass reuses the plan
            out = backend.run(q, batch.kv.k[layer], batch.kv.v[layer], batch, D ** -0.5)
    plans = fake.plans()
    assert len(plans) == 1 and plans[0][0] == kind
    args, kwargs = plans[0][2], plans[0][3]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    assert len(tensors) == (3 if kind == "decode" else 4)
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in tensors)
    last = tensors[-1]
    assert ((last >= 1) & (last <= PAGE)).all()
    assert args[len(tensors):] == (H, KVH, D, PAGE)
    assert kwargs["sm_scale"] == D ** -0.5 and kwargs["window_left"] == -1
    assert kwargs["q_data_type"] == kwargs["kv_data_type"] == torch.float32
    reference = torch_paged_attention(q, batch.kv.k[1], batch.kv.v[1], batch.qo_indptr, batch.kv_indptr,
                                      batch.kv_indices, batch.kv_last_page_len, D ** -0.5)
    assert torch.isfinite(out).all() and torch.equal(out, reference)
    # The next batch plans again, once.
    batch.finish()
    nxt = PagedBatch(batch.kv, batch.sequences, [1] * len(new_tokens), backend)
    backend.run(q[:len(new_tokens)], batch.kv.k[0], batch.kv.v[0], nxt, D ** -0.5)
    backend.run(q[:len(new_tokens)], batch.kv.k[1], batch.kv.v[1], nxt, D ** -0.5)
    assert len(fake.plans()) == 2 and fake.plans()[1][0] == "decode"
    with pytest.raises(RuntimeError, match="not planned"):
        backend.run(q, batch.kv.k[0], batch.kv.v[0], batch, D ** -0.5)


def test_flashinfer_window_layers_get_their_own_plan_and_tensor_cores_follow_the_group_size():
    batch, backend, fake = flashinfer_batch([1, 1, 1])
    q = torch.randn(3, H, D)
    for layer, window in ((0, None), (1, 8), (0, None), (1, 8)):
        out = backend.run(q, batch.kv.k[layer], batch.kv.v[layer], batch, D ** -0.5, window)
    windows = sorted(p[3]["window_left"] for p in fake.plans())
    assert windows == [-1, 7]  # window_left is inclusive: 8 keys = the query and the 7 before it
    assert torch.equal(out, torch_paged_attention(q, batch.kv.k[1], batch.kv.v[1], batch.qo_indptr,
                                                  batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
                                                  D ** -0.5, 8))
    created = [c[2] for c in fake.calls if c[:2] == ("decode", "new")]
    assert created and all(c["use_tensor_cores"] is False for c in created)  # 3 query heads per KV head
    batch8, backend8, fake8 = flashinfer_batch([1, 1, 1], heads=4 * KVH)
    backend8.run(torch.randn(3, 4 * KVH, D), batch8.kv.k[0], batch8.kv.v[0], batch8, D ** -0.5)
    assert [c[2]["use_tensor_cores"] for c in fake8.calls if c[:2] == ("decode", "new")] == [True]


# -- choosing FlashInfer on a CUDA device, decided on the CPU -----------------------------------------------
CUDA = torch.device("cuda")  # only named: nothing is allocated on it below


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """`import flashinfer` finds a fake, and its workspace is made on the CPU."""
    fake = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_backend, "zeroed_workspace", lambda nbytes, device: torch.zeros(1, dtype=torch.uint8),
                        raising=False)
    return fake


def test_float32_on_cuda_takes_the_pytorch_backend_and_says_why(fake_flashinfer, caplog):
    """FlashInfer has no float32 kernels: auto does not hand it a float32 model, an explicit request is refused."""
    with caplog.at_level(logging.INFO, logger="infemeral.layers.attention_backends.selector"):
        assert select_backend("auto", CUDA, H, KVH, D, PAGE, torch.float32).name == "torch"
    assert [r.getMessage() for r in caplog.records] == ["FlashInfer has no float32 kernels; using the PyTorch "
                                                        "paged attention"]
    with pytest.raises(ValueError, match="no float32 kernels.*--attention-backend torch"):
        select_backend("flashinfer", CUDA, H, KVH, D, PAGE, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        backend = select_backend("auto", CUDA, H, KVH, D, PAGE, dtype)
        assert backend.name == "flashinfer" and backend.fi is fake_flashinfer


class BrokenImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import flashinfer` raising what a broken install raises (a missing CUDA library, a toolkit mismatch)."""

    def __init__(self, error: Exception):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "flashinfer" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.error


@pytest.mark.parametrize("error, level, hint", [
    (OSError("libcudart.so.13: cannot open shared object file"), logging.WARNING, "a working FlashInfer"),
    (RuntimeError("FlashInfer requires CUDA 13.0 or later"), logging.WARNING, "a working FlashInfer"),
    (ModuleNotFoundError("No module named 'cuda'", name="cuda"), logging.WARNING, "a working FlashInfer"),
    (ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer"), logging.INFO,
     "pip install infemeral\\[cuda\\]")])
def test_flashinfer_failing_to_import_falls_back_or_is_refused_with_the_cause(monkeypatch, caplog, error, level, hint):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    monkeypatch.setattr(sys, "meta_path", [BrokenImport(error), *sys.meta_path])
    with caplog.at_level(logging.INFO, logger="infemeral.layers.attention_backends.selector"):
        assert select_backend("auto", CUDA, H, KVH, D, PAGE, torch.bfloat16).name == "torch"
    (record,) = caplog.records
    assert record.levelno == level and "using the PyTorch paged attention" in record.getMessage()
    if level == logging.WARNING:
        assert f"{type(error).__name__}: {error}" in record.getMessage()
    with pytest.raises(ValueError, match=f"cannot import flashinfer \\({type(error).__name__}: .*{hint}") as e:
        select_backend("flashinfer", CUDA, H, KVH, D, PAGE, torch.bfloat16)
    assert str(error) in str(e.value) and e.value.__cause__ is error


class OpsRun(TorchDispatchMode):
    """Records every operator run while it is on."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_the_flashinfer_workspace_starts_zeroed():
    """FlashInfer's wrappers require their float workspace zeroed before the first use (split-k state lives there)."""
    with OpsRun() as seen:
        backend = FlashInferBackend(torch.device("meta"), H, KVH, D, PAGE, torch.bfloat16, module=FakeFlashInfer())
    assert backend.workspace.numel() == FlashInferBackend.WORKSPACE_BYTES
    assert seen.ops == [torch.ops.aten.zeros.default]  # made zeroed, not torch.empty


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer runs on CUDA only")
def test_flashinfer_matches_torch_backend():
    pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    lengths, queries = CASES["mixed batch"]
    seqs, k_pages, v_pages, (kv_indptr, kv_indices, last) = scattered_pages(lengths)
    q = torch.randn(sum(queries), H, D)
    qo = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    ref = torch_paged_attention(q, k_pages, v_pages, qo, kv_indptr, kv_indices, last, D ** -0.5)
    backend = select_backend("flashinfer", dev, H, KVH, D, PAGE, torch.float16)

    class Pool:
        page_size = PAGE

    class Batch:
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len, pool = qo, kv_indptr, kv_indices, last, Pool

    backend.plan(Batch)
    out = backend.run(q.half().to(dev), k_pages.half().to(dev), v_pages.half().to(dev), Batch, D ** -0.5)
    assert (out.float().cpu() - ref).abs().max() < 2e-2


@pytest.mark.parametrize("table", [[3, 4, 5, 6], [3, 5, 4, 6], [6, 5, 4, 3], [0, 2, 1, 3]])
def test_block_table_order_is_respected(table):
    """A table whose first and last pages look like a contiguous run ([3, 5, 4, 6]) must still be read in
    table order: only a truly contiguous run may be read as one slice of the pool. (Every position is a
    query, so the causal mask makes the order of the keys matter.)"""
    g = torch.Generator().manual_seed(3)
    length = 3 * PAGE + 5
    k, v = torch.randn(length, KVH, D, generator=g), torch.randn(length, KVH, D, generator=g)
    k_pages, v_pages = torch.randn(8, PAGE, KVH, D, generator=g), torch.randn(8, PAGE, KVH, D, generator=g)
    for i, p in enumerate(table):
        chunk = slice(i * PAGE, min(length, (i + 1) * PAGE))
        k_pages[p, : chunk.stop - chunk.start] = k[chunk]
        v_pages[p, : chunk.stop - chunk.start] = v[chunk]

    class Batch:  # the CSR fields a PagedBatch carries, for one sequence prefilled in one step
        qo_indptr = torch.tensor([0, length], dtype=torch.int32)
        kv_indptr = torch.tensor([0, len(table)], dtype=torch.int32)
        kv_indices = torch.tensor(table, dtype=torch.long)
        kv_last_page_len = torch.tensor([length - 3 * PAGE], dtype=torch.int32)

    q = torch.randn(length, H, D, generator=g)
    backend = TorchBackend()
    backend.plan(Batch)
    out = backend.run(q, k_pages, v_pages, Batch, D ** -0.5)
    assert (out - naive(q, k, v, D ** -0.5)).abs().max() < 1e-4
