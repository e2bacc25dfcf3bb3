"""What one rank holds: its attention heads and MLP columns of every served layer (Megatron-style).

The secret basis Q touches only the model dimension (the residual stream), so the rotated weights shard
exactly as the plain ones do:

* column-parallel (q, k, v, gate, up: they read the residual stream): each rank keeps the output rows of
  its heads (q: its query heads, k/v: its KV heads) or of its slice of the MLP's intermediate units;
* row-parallel (o, down: they write the residual stream): each rank keeps the matching input columns and
  computes a partial sum of the output; one all-reduce after o_proj and one after down_proj add the
  partial sums up. Their biases are added once, by rank 0 (the other ranks hold zeros);
* everything else (the norms, Qwen3's per-head q/k norms) is replicated, and so is the residual stream.

A rank's layers are transformers' own, built from a config with its head counts and intermediate size
(`shard_config`). Weights are cut by output rows and input columns only, never by layout, so a tensor of
another form (int8 codes with per-row scales, int4 codes with per-group scales) is cut the same way: by
rows where its first dimension is the output features, by columns scaled to its second dimension.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from infemeral.layers.stack import head_dim
from infemeral.server.parallel.ranks import check_divisible

# prefix of a linear inside a decoder layer -> which output features it has
COLUMN_PARALLEL = {"self_attn.q_proj": "heads", "self_attn.k_proj": "kv_heads", "self_attn.v_proj": "kv_heads",
                   "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp"}
# prefix -> which input features it has
ROW_PARALLEL = {"self_attn.o_proj": "heads", "mlp.down_proj": "mlp"}


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int


def split(total: int, shard: Shard) -> range:
    """This rank's part of `total` units, as even as can be (the first ranks take one more when it does not
    divide)."""
    base, extra = divmod(total, shard.world)
    start = shard.rank * base + min(shard.rank, extra)
    return range(start, start + base + (shard.rank < extra))


def feature_ranges(config: PretrainedConfig, shard: Shard) -> dict[str, range]:
    """This rank's output features of each kind: its query heads' rows, its KV heads' rows, its MLP units."""
    check_divisible(config, shard.world)
    d = head_dim(config)
    q, kv = config.num_attention_heads // shard.world, config.num_key_value_heads // shard.world
    return {"heads": range(shard.rank * q * d, (shard.rank + 1) * q * d),
            "kv_heads": range(shard.rank * kv * d, (shard.rank + 1) * kv * d),
            "mlp": split(config.intermediate_size, shard)}


def shard_config(config: PretrainedConfig, shard: Shard) -> PretrainedConfig:
    """The config a rank builds its layers from: its head counts and MLP width; the model dimension, the
    head size and everything else unchanged."""
    ranges = feature_ranges(config, shard)
    local = copy.deepcopy(config)
    local.head_dim = head_dim(config)  # no longer hidden_size // num_attention_heads
    local.num_attention_heads = config.num_attention_heads // shard.world
    local.num_key_value_heads = config.num_key_value_heads // shard.world
    local.intermediate_size = len(ranges["mlp"])
    return local


def _columns(t: torch.Tensor, cols: range, in_features: int, name: str) -> torch.Tensor:
    """Input columns `cols` of a tensor whose second dimension is `in_features` (or a multiple or fraction of
    it: packed codes, per-group scales)."""
    width = t.shape[1]
    start, stop = cols.start * width / in_features, cols.stop * width / in_features
    if start != int(start) or stop != int(stop):
        raise ValueError(f"{name} ({tuple(t.shape)}) cannot be cut at input columns {cols.start}..{cols.stop}: "
                         "its groups straddle the cut (each rank must hold whole groups); serve this bundle on "
                         "another rank count, or prepare it with a --group-size that divides every rank's share")
    return t[:, int(start):int(stop)]


def shard_layer(weights: Mapping[str, torch.Tensor], config: PretrainedConfig,
                shard: Shard) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors (names relative to the layer) cut to this rank's part."""
    if shard.world == 1:
        return dict(weights)
    ranges = feature_ranges(config, shard)
    full = {"heads": config.num_attention_heads * head_dim(config),
            "kv_heads": config.num_key_value_heads * head_dim(config), "mlp": config.intermediate_size}
    out = {}
    for name, t in weights.items():
        prefix, _, param = name.rpartition(".")
        if prefix in COLUMN_PARALLEL:
            rows = ranges[COLUMN_PARALLEL[prefix]]
            t = t[rows.start:rows.stop]
        elif prefix in ROW_PARALLEL and t.dim() >= 2:
            kind = ROW_PARALLEL[prefix]
            t = _columns(t, ranges[kind], full[kind], name)
        elif prefix in ROW_PARALLEL and param == "bias" and shard.rank != 0:
            t = torch.zeros_like(t)  # the partial sums are added up across ranks: the bias only once
        out[name] = t.contiguous()
    return out


class ShardedBundle:
    """One rank's view of a server bundle: the same layers, each cut to this rank's part (see the module
    docstring); anything else is the bundle's own."""

    def __init__(self, bundle, shard: Shard):
        self.bundle, self.shard = bundle, shard
        self.config = shard_config(bundle.config, shard)

    def layer_weights(self, index: int) -> dict[str, torch.Tensor]:
        return shard_layer(self.bundle.layer_weights(index), self.bundle.config, self.shard)

    def __getattr__(self, name: str):
        if name == "bundle":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.bundle, name)


def attach_all_reduce(stack: torch.nn.Module, all_reduce) -> list:
    """Sum the partial outputs of every row-parallel linear of a layer stack across ranks (`all_reduce`
    works in place); returns the hooks' handles."""
    handles = []
    for name, module in stack.named_modules():
        if any(name.endswith("." + prefix) for prefix in ROW_PARALLEL):
            handles.append(module.register_forward_hook(lambda _module, _args, out: all_reduce(out)))
    return handles


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's weights as they sit in memory."""
    return sum(p.numel() * p.element_size() for p in module.parameters())
