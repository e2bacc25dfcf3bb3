"""Write a sharded safetensors Llama checkpoint with random weights, one shard at a time.

For trying `infemeral-client prepare` on a model of real size without downloading one: the checkpoint
never exists in memory as a whole (each shard's tensors are drawn, written and dropped), so a 3B model
can be written on a laptop. The tokenizer is the packaged SmolLM2's (its vocabulary is smaller than the
model's, which prepare does not care about; do not chat with such a checkpoint).

    .venv/bin/python scripts/random_checkpoint.py /tmp/llama-3b                   # Llama-3.2-3B shape, bf16
    .venv/bin/python scripts/random_checkpoint.py /tmp/small --shape small-llama  # ~0.5 GB, for tests
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig

SHAPES = {
    # Llama-3.2-3B: tied embeddings, 128,256 tokens.
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    # Llama-3-8B: untied head.
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    # SmolLM2-135M, the packaged default model: tied embeddings, 49,152 tokens, its own RoPE base.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0),
    # ~0.5 GB in bf16, mostly layers, cheap to rotate (small hidden size): for tests.
    "small-llama": dict(hidden_size=512, intermediate_size=4096, num_hidden_layers=32, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=True),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Sizes:
    """Bytes of the parts prepare holds at once, in the checkpoint's dtype (the basis in float64 + float32)."""

    model: int
    largest_layer: int
    tables: int  # embedding (+ untied LM head)
    basis: int


def llama_config(shape: str, num_layers: int | None = None) -> LlamaConfig:
    """The shape's config; `num_layers` keeps its width and cuts its depth (a few layers of a real shape)."""
    fields = dict(rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192, bos_token_id=1,
                  eos_token_id=2)
    fields.update(SHAPES[shape], **({"num_hidden_layers": num_layers} if num_layers else {}))
    return LlamaConfig(**fields)


def tensor_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, in the order a Hugging Face Llama stores them."""
    d, f = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (d // config.num_attention_heads)
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (d, d),
                       p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d),
                       p + "self_attn.o_proj.weight": (d, d), p + "post_attention_layernorm.weight": (d,),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    shapes["model.norm.weight"] = (d,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def sizes(config: LlamaConfig, dtype: torch.dtype) -> Sizes:
    item = torch.empty((), dtype=dtype).element_size()
    shapes = tensor_shapes(config)
    nbytes = {name: math.prod(shape) * item for name, shape in shapes.items()}
    layer = sum(n for name, n in nbytes.items() if name.startswith("model.layers.0."))
    tables = nbytes["model.embed_tokens.weight"] + nbytes.get("lm_head.weight", 0)
    return Sizes(model=sum(nbytes.values()), largest_layer=layer, tables=tables,
                 basis=config.hidden_size ** 2 * (8 + 4))


def plan_shards(shapes: dict[str, tuple[int, ...]], item: int, shard_bytes: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        n = math.prod(shape) * item
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    return shards + [current]


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norm gains near 1, not exactly 1, so folding them is exercised
        return (1.0 + 0.1 * torch.randn(shape, generator=generator)).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    for start in range(0, shape[0], 4096):  # in slices: no float32 copy of a whole table
        rows = min(4096, shape[0] - start)
        out[start:start + rows] = (0.02 * torch.randn((rows, *shape[1:]), generator=generator)).to(dtype)
    return out


def write_checkpoint(out: Path, shape: str = "llama-3.2-3b", dtype: str = "bfloat16", shard_mb: int = 2048,
                     seed: int = 0, progress: bool = True, tokenizer_from: Path | None = None,
                     num_layers: int | None = None) -> Sizes:
    """Write config, generation config, tokenizer and sharded weights to `out`; return the part sizes.

    The tokenizer is copied from `tokenizer_from` (a saved tokenizer directory) or the packaged GGUF."""
    from tqdm.auto import tqdm

    out.mkdir(parents=True, exist_ok=True)
    config = llama_config(shape, num_layers)
    torch_dtype = DTYPES[dtype]
    config.torch_dtype = torch_dtype
    shapes = tensor_shapes(config)
    item = torch.empty((), dtype=torch_dtype).element_size()
    shards = plan_shards(shapes, item, shard_mb << 20)
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for k, names in enumerate(tqdm(shards, desc="writing shards", unit="shard", disable=not progress)):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_tensor(name, shapes[name], torch_dtype, generator) for name in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: file for name in names})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)
    _copy_tokenizer(out, tokenizer_from)
    return sizes(config, torch_dtype)


def _copy_tokenizer(out: Path, source: Path | None) -> None:
    from transformers import AutoTokenizer

    from infemeral.cloak.sources import default_gguf_path

    if source is not None:
        AutoTokenizer.from_pretrained(source).save_pretrained(out)
        return
    gguf = default_gguf_path()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--shard-mb", type=int, default=2048, help="largest shard in MiB (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    s = write_checkpoint(args.out, args.shape, args.dtype, args.shard_mb, args.seed)
    print(f"wrote {args.out}: {s.model / 2**30:.2f} GiB; one layer {s.largest_layer / 2**20:.0f} MiB, "
          f"embedding/head {s.tables / 2**20:.0f} MiB, basis {s.basis / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
