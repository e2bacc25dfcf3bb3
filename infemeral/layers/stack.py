"""A contiguous run of the model's own decoder layers, driven over our KV cache.

Both halves of the split use this: the client for its first `client_layers`
layers (plain weights), the server for the rest (folded, rotated weights).
The server's layers are transformers' own classes; only the cache and the
attention function (see `attention.py`) are ours. The client's are plain_decoder.py's
twins of them (the same arithmetic, without importing transformers' modeling code),
where they handle the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from infemeral.kvcache.cache import KVCache
from infemeral.layers import architecture, draft_tree, plain_decoder
from infemeral.layers.attention import NAME as ATTENTION
from infemeral.layers.few_rows import use_few_rows

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def runtime_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of the config set up to run with our cache attention."""
    config = copy.deepcopy(config)
    config._attn_implementation = ATTENTION
    return config


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LayerStack(torch.nn.Module):
    """Decoder layers [first_layer, first_layer + len(layer_weights)) of one model."""

    def __init__(self, config: PretrainedConfig, first_layer: int,
                 layer_weights: list[Mapping[str, torch.Tensor]],
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 adapt_layer: Callable[[torch.nn.Module], None] | None = None, plain: bool = False):
        """`adapt_layer` may swap modules of each (meta-device) layer before its weights load, e.g. int8
        linears; tensors that are not floating point (int8 codes) keep their dtype. `plain` runs
        plain_decoder.py's layers where they handle the model (a process that must start fast)."""
        super().__init__()
        self.config = runtime_config(config)
        self.first_layer = first_layer
        self.dtype = dtype
        self.device = torch.device(device)
        if plain and plain_decoder.handles(config):
            layer_cls, rotary_cls = plain_decoder.DecoderLayer, plain_decoder.RotaryEmbedding
        else:
            layer_cls, rotary_cls = architecture.decoder_layer_class(config), architecture.rotary_embedding_class(config)
        layers = []
        for i, weights in enumerate(layer_weights):
            with torch.device("meta"):
                layer = layer_cls(self.config, first_layer + i)
            if adapt_layer is not None:
                adapt_layer(layer)
            layer.load_state_dict({k: v.to(self.device, dtype if v.is_floating_point() else v.dtype)
                                   for k, v in weights.items()}, strict=True, assign=True)
            layers.append(layer.eval())
        self.layers = torch.nn.ModuleList(layers)
        use_few_rows(self.layers)  # float32 on a CPU: a step of 2-4 positions costs less (few_rows.py)
        self.rotary = rotary_cls(config=self.config).to(self.device)
        self.requires_grad_(False)

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(self.first_layer, len(self.layers), self.config.num_key_value_heads,
                       head_dim(self.config), self.dtype, self.device, capacity)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, cache: KVCache, parents: list[int] | None = None) -> torch.Tensor:
        """Run new positions [n, hidden] through every layer, appending to `cache`. With `parents` the rows are
        a draft tree (draft_tree.py): each at the cache's length + its depth, reading the cache, its ancestors
        and itself."""
        n = hidden.shape[0]
        x = hidden.to(self.device, self.dtype).unsqueeze(0)
        mask = None
        if parents is None:
            positions = torch.arange(cache.length, cache.length + n, device=self.device).unsqueeze(0)
        else:
            positions = draft_tree.tree_positions(parents, cache.length, self.device)
            mask = draft_tree.tree_attention_mask(parents, cache.length, self.device)
        cos_sin = self.rotary(x, positions)
        cache.begin_step()
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin,
                      **{architecture.cache_keyword(layer): cache})
        cache.finish_step(n)
        return x[0]

    @torch.inference_mode()
    def forward_batch(self, hidden: torch.Tensor, batch) -> torch.Tensor:
        """Run the new positions of several sessions [sum n_i, hidden] in one pass over the page pool."""
        x = hidden.to(self.device, self.dtype).unsqueeze(0)
        cos_sin = self.rotary(x, batch.positions)
        for layer in self.layers:
            x = layer(x, attention_mask=None, position_ids=batch.positions, position_embeddings=cos_sin,
                      paged=batch, **{architecture.cache_keyword(layer): batch})
        batch.finish()
        return x[0]
