"""What an operator who has the model's public weights runs: the client's first layers and the first served layer.

Two ways to get them. A real operator loads the public checkpoint (`--public-model`).
When the user's bundles were prepared from a public model, the audit can also
simulate that operator from the user's own bundles: the client bundle holds the
first layers' plain weights, and the first served layer un-rotated with Q is the
public layer with its norm gains folded in, which computes the same keys and values.

The attacks ask one question many times: "if the next token were c, what would
these layers output at this position?" `continuations` answers it for a batch of
candidates at once, each one token after the same recovered prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from infemeral.client_half.half import ClientModel
from infemeral.cloak.bundle import ServerBundle
from infemeral.cloak.sources import WeightSource, layer_tensors
from infemeral.errors import FailedPrecondition
from infemeral.kvcache.cache import KVCache
from infemeral.layers.architecture import NORM_FEEDS, WRITES_RESIDUAL, cache_keyword
from infemeral.layers.stack import LayerStack


@dataclass
class PublicWeights:
    config: PretrainedConfig
    embed: torch.Tensor             # [vocab, d]
    front: LayerStack               # layers [0, L): what the client runs before rotating
    served: LayerStack | None       # layer L, the first served layer (its keys/values sit in the pod's memory)
    served_o_proj: torch.Tensor | None  # layer L's plain o_proj, for solving Q by Procrustes
    description: str

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    @classmethod
    def simulated(cls, model: ClientModel, server: ServerBundle | None, basis: torch.Tensor) -> "PublicWeights":
        """The public weights as the client can reconstruct them (it knows Q)."""
        served = None
        if server is not None:
            first = server.first_layer
            served = LayerStack(server.config, first, [unrotate_layer(server.float_layer_weights(first), basis)])
        return cls(model.config, model.embed.dense(), model.layers, served, None,
                   "the client bundle's plain layers, and the server bundle un-rotated with Q")

    @classmethod
    def load(cls, source: WeightSource, num_front_layers: int) -> "PublicWeights":
        """The first num_front_layers + 1 layers and the embedding of a public checkpoint."""
        config = source.config
        layers = [dict(layer_tensors(source, i)) for i in range(num_front_layers + 1)]
        embed = source.take("model.embed_tokens.weight").float()
        served_weights = layers.pop()
        return cls(config, embed, LayerStack(config, 0, layers), LayerStack(config, num_front_layers, [served_weights]),
                   served_weights["self_attn.o_proj.weight"].double(), source.description)

    def check_matches(self, model: ClientModel) -> None:
        client_shape = tuple(model.embed.shape)  # without dequantising the table
        if tuple(self.embed.shape) != client_shape:
            raise FailedPrecondition(
                f"the public model has a {tuple(self.embed.shape)} embedding but the client bundle "
                f"{client_shape}: pass the public model the bundles were prepared from")

    # -- what the layers would output for candidate tokens -----------------------------------------
    def new_prefix(self, capacity: int = 256) -> KVCache:
        return self.front.new_cache(capacity)

    def extend(self, prefix: KVCache, token: int) -> None:
        """Append a recovered token to the prefix (runs the front layers on it)."""
        self.front(self.embed[[token]], prefix)

    @torch.inference_mode()
    def continuations(self, prefix: KVCache, candidates: torch.Tensor) -> torch.Tensor:
        """Front-layer outputs [B, d] at position prefix.length for each candidate token after the prefix."""
        x = self.embed[candidates].unsqueeze(1)  # [B, 1, d]
        positions = torch.full((len(candidates), 1), prefix.length, dtype=torch.long)
        cos_sin = self.front.rotary(x, positions)
        cache = _SharedPrefix(prefix)
        for layer in self.front.layers:
            x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin,
                      **{cache_keyword(layer): cache})
        return x[:, 0]

    @torch.inference_mode()
    def served_keys_values(self, hidden: torch.Tensor, position: int) -> torch.Tensor:
        """Keys and values the first served layer writes for `hidden` [B, d] at `position`:
        [B, 2 * kv_heads * head_dim], keys first."""
        x = hidden.unsqueeze(1)
        positions = torch.full((hidden.shape[0], 1), position, dtype=torch.long)
        capture = _Capture()
        try:
            self.served.layers[0](x, attention_mask=None, position_ids=positions,
                                  position_embeddings=self.served.rotary(x, positions),
                                  **{cache_keyword(self.served.layers[0]): capture})
        except _Captured:
            pass  # the rest of the layer (attention, MLP) is not needed
        return torch.cat([capture.key[:, :, 0].flatten(1), capture.value[:, :, 0].flatten(1)], 1)

    @torch.inference_mode()
    def served_values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Values [B, kv_heads * head_dim] the first served layer computes for `hidden`; they do not depend on
        the position or the context, only on the layer's own input."""
        layer = self.served.layers[0]
        return layer.self_attn.v_proj(layer.input_layernorm(hidden))


def unrotate_layer(weights: dict[str, torch.Tensor], q: torch.Tensor) -> dict[str, torch.Tensor]:
    """Undo `rotate_layer` for one served layer: the plain layer with its norm gains folded in (gains stay 1)."""
    q = q.to(torch.float64)
    out = {name: t.float() for name, t in weights.items()}
    for readers in NORM_FEEDS.values():
        for reader in readers:
            out[f"{reader}.weight"] = (weights[f"{reader}.weight"].double() @ q.T).float()
    for writer in WRITES_RESIDUAL:
        out[f"{writer}.weight"] = (q @ weights[f"{writer}.weight"].double()).float()
        if f"{writer}.bias" in weights:
            out[f"{writer}.bias"] = (weights[f"{writer}.bias"].double() @ q.T).float()
    return out


class _SharedPrefix:
    """A read-only cache that shows B one-token continuations the same prefix's keys and values."""

    def __init__(self, prefix: KVCache):
        self.prefix = prefix

    def update(self, key, value, layer_idx, *args, **kwargs):
        k, v = self.prefix.layer_tensors(layer_idx - self.prefix.first_layer)  # [kv_heads, t, head_dim]
        batch = key.shape[0]
        return (torch.cat([k.unsqueeze(0).expand(batch, -1, -1, -1), key], 2),
                torch.cat([v.unsqueeze(0).expand(batch, -1, -1, -1), value], 2))


class _Captured(Exception):
    pass


class _Capture:
    """A cache that records the keys and values a layer writes, then stops the layer (raises _Captured)."""

    key = value = None

    def update(self, key, value, layer_idx, *args, **kwargs):
        self.key, self.value = key, value
        raise _Captured
