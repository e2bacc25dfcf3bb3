"""What the GPU scripts share: random served layers, pages and bundles of real model shapes, and decode timing.

scripts/gpu_check.py (a pod's own check) and scripts/gpu_lease.py (one prepared run on a borrowed GPU) build
the same workloads. Model shapes are scripts/random_checkpoint.py's; random pages are the start-up
self-check's (infemeral/server/self_check.py), moved to a device and dtype. Everything takes a device, so the
lease script's dry run on a CPU goes through the same code as the GPU run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from random_checkpoint import llama_config  # noqa: F401  (re-exported: the shapes' one home, beside this file)

from infemeral.layers.stack import head_dim
from infemeral.quant.int8 import QUANTIZED_LINEARS  # every linear of a decoder layer, in order


def synchronize(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def steps_per_second(step, steps: int, device, warm_up: int = 3) -> float:
    """Completed calls of `step` per second over `steps` timed calls, after `warm_up` untimed ones."""
    for _ in range(warm_up):
        step()
    synchronize(device)
    t = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return steps / (time.perf_counter() - t)


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of a decoder layer."""
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
    return dict(zip(QUANTIZED_LINEARS, ((q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f))))


def random_batch(lengths, queries, heads, kv_heads, head_dim, page, dtype, seed=0, device="cuda"):
    """Scattered pages of random K/V (NaN in every slot no sequence owns), queries and the batch's CSR arrays
    (int32 on the host), drawn as the start-up self-check draws them, on `device` in `dtype`."""
    from infemeral.server.self_check import AttentionCase, random_pages

    case = AttentionCase("random", tuple(lengths), tuple(queries))
    q, k, v, csr = random_pages(case, heads, kv_heads, head_dim, page, seed)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), csr


def random_layers(config, num_layers: int, dtype, device="cuda", seed: int = 0, std: float | None = 0.02) -> list[dict]:
    """Served layers of the config's shape: N(0, std) weights drawn on `device` (std None: 1/sqrt(inputs) per
    linear, so that a layer adds about as much as its input holds, as a trained one does), unit norms (a prepared
    bundle's norms are gain-free: the gains are folded into the weights)."""
    g = torch.Generator(device=device).manual_seed(seed)
    d = config.hidden_size
    layers = []
    for _ in range(num_layers):
        w = {f"{name}.weight": torch.randn(shape, generator=g, device=device, dtype=dtype)
             * (std if std is not None else shape[1] ** -0.5) for name, shape in linear_shapes(config).items()}
        w["input_layernorm.weight"] = torch.ones(d, device=device, dtype=dtype)
        w["post_attention_layernorm.weight"] = torch.ones(d, device=device, dtype=dtype)
        layers.append(w)
    return layers


def decode_rate(stack, kv, backend, sessions: int, context: int, steps: int) -> float:
    """Tokens per second of `steps` batched decode steps of `sessions` sessions, each prefilled with `context`
    tokens (one at a time: bounded activation memory) in the pages of `kv` (`KVPages`), which are given back
    afterwards."""
    from infemeral.kvcache.paged import PagedBatch, PagedSequence, PagePool

    device, dtype, hidden = kv.device, kv.dtype, stack.config.hidden_size
    pool = PagePool(kv.num_pages, kv.page_size)
    seqs = [PagedSequence(pool, kv) for _ in range(sessions)]
    for s in seqs:
        s.reserve(context)
        stack.forward_batch(torch.randn(context, hidden, device=device, dtype=dtype) * 0.1,
                            PagedBatch(kv, [s], [context], backend))

    def step():
        for s in seqs:
            s.reserve(s.length + 1)
        stack.forward_batch(torch.randn(sessions, hidden, device=device, dtype=dtype) * 0.1,
                            PagedBatch(kv, seqs, [1] * sessions, backend))

    rate = sessions * steps_per_second(step, steps, device)
    for s in seqs:
        s.wipe()
    return rate


def write_bundle(directory: Path, config, layers: list[dict], dtype: str, quant=None) -> None:
    """A server bundle of the given served layers (layer 1 on; layer 0 would be the client's), as prepare writes
    one: config, one safetensors file per layer, manifest with hashes and fingerprint. `quant` (a
    `ServerQuant`) when the layers hold its quantised tensors; `dtype` names the float tensors' dtype."""
    from safetensors.torch import save_file

    from infemeral.cloak import bundle as B
    from infemeral.cloak.server_config import write_server_config

    directory.mkdir(parents=True)
    files = {}
    for i, weights in enumerate(layers, start=1):
        save_file({k: v.cpu().contiguous() for k, v in weights.items()}, str(directory / B.layer_file(i)))
        files[B.layer_file(i)] = B.sha256_file(directory / B.layer_file(i))
    write_server_config(config, directory)
    files["config.json"] = B.sha256_file(directory / "config.json")
    manifest = {"format": B.SERVER_FORMAT, "format_version": B.FORMAT_VERSION, "model_type": config.model_type,
                "hidden_size": config.hidden_size, "dtype": dtype, "first_layer": 1,
                "num_layers": len(layers), "total_layers": len(layers) + 1, "files": files}
    if quant is not None and quant.is_quantized:
        manifest["format_version"] = B.QUANTIZED_FORMAT_VERSION
        manifest["server_quant"] = quant.to_manifest()
    manifest["fingerprint"] = B.fingerprint(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))


def write_random_bundle(directory: Path, config, num_layers: int, dtype, device="cuda") -> None:
    """A server bundle of `num_layers` random served layers in `dtype` (drawn on `device`)."""
    write_bundle(directory, config, random_layers(config, num_layers, dtype, device),
                 str(dtype).removeprefix("torch."))
