"""A draft head's module (EAGLE-style): one decoder layer over [embedding of the next token, feature].

The laptop already holds what such a head needs (docs/design.md §9): the feature of
every verified position (the server's final residual, un-rotated and passed
through the final norm — exactly what the LM head reads), its own embedding
table and its own LM head. The head itself is one decoder layer:

    x_i = fc(concat(embedding(t_{i+1}), f_i))        f_i: the feature at position i
    h_i = layer(x_i | x_{<i})                        over the head's own small KV cache
    h_i ≈ f_{i+1};  LM head(h_i) drafts t_{i+2}

and it continues from its own prediction for as many drafts as the step carries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import PretrainedConfig

from infemeral.kvcache.cache import KVCache
from infemeral.layers import architecture
from infemeral.layers.stack import head_dim, runtime_config

LAYER_PREFIX = "layers.0."


def layer_config(config: PretrainedConfig, names: Sequence[str] = ()) -> PretrainedConfig:
    """The config of the head's one decoder layer, in the family whose layer has the weights `names` holds.

    EAGLE's Qwen2 heads keep biases on q/k/v only (Qwen2's layer), its Llama heads none; a head whose
    config says llama but whose weights carry q/k/v biases is read as the Qwen2 layer it is."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    names = set(names)
    has = lambda part: f"{LAYER_PREFIX}{part}" in names  # noqa: E731
    fields = {k: v for k, v in config.to_dict().items()
              if k not in ("model_type", "architectures", "transformers_version", "auto_map")}
    fields["num_hidden_layers"] = 1
    fields.pop("layer_types", None)
    if has("self_attn.q_norm.weight"):
        family = Qwen3Config
    elif has("self_attn.q_proj.bias") and not has("self_attn.o_proj.bias"):
        family = Qwen2Config
    elif not names and config.model_type in ("qwen2", "qwen3"):
        family = Qwen2Config if config.model_type == "qwen2" else Qwen3Config
    else:
        family = LlamaConfig
        fields["attention_bias"] = has("self_attn.o_proj.bias")
        fields["mlp_bias"] = has("mlp.down_proj.bias")
    if family is not LlamaConfig:
        fields.pop("attention_bias", None)
        fields.pop("mlp_bias", None)
        fields["use_sliding_window"] = False
    return family(**fields)


class HeadModel(torch.nn.Module):
    """fc over [embedding, feature] and one decoder layer, named as EAGLE names them (`fc.*`, `layers.0.*`).

    `forward` runs a batch of whole sequences (training) or, with a cache, new positions of one sequence
    (drafting); both read the same weights through the same code."""

    def __init__(self, config: PretrainedConfig, *, fc_bias: bool = False, input_norm: bool = False,
                 device: str | torch.device = "cpu"):
        super().__init__()
        self.config = runtime_config(config)
        d = config.hidden_size
        self.fc = torch.nn.Linear(2 * d, d, bias=fc_bias, device=device)
        with torch.device(device):
            layer = architecture.decoder_layer_class(config)(self.config, 0)
        if not input_norm:
            layer.input_layernorm = torch.nn.Identity()  # EAGLE's first layer: fc's output is read as it is
        self.layers = torch.nn.ModuleList([layer])
        self.has_input_norm = input_norm
        self.rotary = self._rotary(device)

    def _rotary(self, device) -> torch.nn.Module:
        return architecture.rotary_embedding_class(self.config)(config=self.config).to(device)

    @classmethod
    def from_tensors(cls, config: PretrainedConfig, tensors: Mapping[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "HeadModel":
        """A head holding `tensors` (fc.*, layers.0.*), built without a first, throw-away initialisation."""
        self = cls(config, fc_bias="fc.bias" in tensors, input_norm=f"{LAYER_PREFIX}input_layernorm.weight" in tensors,
                   device="meta")
        weights = {k: v.to(device, dtype) for k, v in tensors.items() if k.startswith(("fc.", LAYER_PREFIX))}
        self.load_state_dict(weights, strict=True, assign=True)
        self.rotary = self._rotary(device)
        return self.eval().requires_grad_(False)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def new_cache(self, dtype: torch.dtype, device: torch.device, capacity: int = 64) -> KVCache:
        return KVCache(0, 1, self.config.num_key_value_heads, head_dim(self.config), dtype, device, capacity)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds, features [B, n, d] (embedding of the token after each position, feature of the position)
        -> predicted features of the next positions [B, n, d]. With `cache` (B = 1) the n positions follow
        the cached ones and are appended to it. A draft tree's nodes give their own `positions` [1, n] and
        `mask` [n, cached + n] (which cached entries and nodes each reads: its ancestors, not its cousins)."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        n = x.shape[1]
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + n, device=x.device).unsqueeze(0)
        cos_sin = self.rotary(x, positions)
        if cache is not None:
            cache.begin_step()
        x = self.layers[0](x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin,
                           **{architecture.cache_keyword(self.layers[0]): cache})
        if cache is not None:
            cache.finish_step(n)
        return x

    def unrolled(self, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training as drafting runs (EAGLE-3's "training-time test"): `steps` passes over whole sequences,
        pass s predicting from pass s − 1's predictions where drafting would. Pass 0 is `forward`; in pass
        s the input at position j is (embedding of t_{j+1}, pass s − 1's prediction at j − 1), and its query
        reads what a session's s-th draft reads: the true-feature keys up to j − s (the verified positions)
        and one key of each later pass (the drafts before it in the chain). Returns each pass's predicted
        features [B, n, d]; position j of pass s stands for a chain started at j − s."""
        n = embeds.shape[1]
        positions = torch.arange(n, device=embeds.device).unsqueeze(0)
        cache = _PassKeys()
        keyword = architecture.cache_keyword(self.layers[0])
        out, inputs = [], features
        for s in range(steps):
            x = self.fc(torch.cat([embeds, inputs], dim=-1))
            h = self.layers[0](x, attention_mask=None if s == 0 else unrolled_mask(n, s, x.device),
                               position_ids=positions, position_embeddings=self.rotary(x, positions),
                               **{keyword: cache})
            out.append(h)
            inputs = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)  # position j reads j − 1's
        return out


def unrolled_mask(n: int, s: int, device=None) -> torch.Tensor:
    """Which keys pass s's queries read [n, (s + 1)·n] (see `HeadModel.unrolled`): query j reads pass 0's keys
    at positions ≤ j − s and pass p's (1 ≤ p ≤ s) key at j − s + p."""
    j = torch.arange(n, device=device).unsqueeze(1)
    i = torch.arange(n, device=device).unsqueeze(0)
    blocks = [i <= j - s] + [i == j - s + p for p in range(1, s + 1)]
    return torch.cat(blocks, dim=1)


class _PassKeys:
    """The keys and values of the passes so far (training): each pass appends its own, gradients kept."""

    def __init__(self):
        self.key = self.value = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.key = key if self.key is None else torch.cat([self.key, key], dim=2)
        self.value = value if self.value is None else torch.cat([self.value, value], dim=2)
        return self.key, self.value
