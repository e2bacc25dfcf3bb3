"""The client's half of the model: everything that touches tokens.

Embedding, the first `client_layers` decoder layers (plain weights, their own
small KV cache), the secret basis, final norm and LM head. What leaves this
object for the server is only `hidden @ Q`; what comes back is un-rotated here.
"""

from __future__ import annotations

import torch

from infemeral.cloak.bundle import ClientBundle
from infemeral.kvcache.cache import KVCache
from infemeral.model import architecture
from infemeral.model.layers import LayerStack


class ClientModel:
    def __init__(self, bundle: ClientBundle, dtype: torch.dtype = torch.float32):
        self.bundle = bundle
        self.config = bundle.config
        self.dtype = dtype
        tensors = bundle.tensors()
        n = bundle.client_layers
        per_layer = [{k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"layers.{i}.")}
                     for i in range(n)]
        self.layers = LayerStack(self.config, 0, per_layer, dtype=dtype)
        self.embed = tensors["embed_tokens.weight"].to(dtype)
        self.lm_head = tensors.get("lm_head.weight", tensors["embed_tokens.weight"]).to(dtype)
        norm_cls = architecture.norm_class(self.config)
        self.norm = norm_cls(self.config.hidden_size, eps=self.config.rms_norm_eps)
        self.norm.weight.data = tensors["norm.weight"].to(dtype)
        self.norm.requires_grad_(False)
        self.basis = bundle.basis().to(dtype)
        self.inv_freq = self.layers.rotary.inv_freq.detach().to(torch.float64)  # pure RoPE angles for the window

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def new_cache(self) -> KVCache:
        return self.layers.new_cache()

    @torch.inference_mode()
    def cloak(self, token_ids: list[int], cache: KVCache) -> torch.Tensor:
        """Embed new tokens, run the local layers, and rotate into the secret basis: [n, d]."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        hidden = self.layers(self.embed[ids], cache)
        return hidden @ self.basis

    @torch.inference_mode()
    def logits(self, residual: torch.Tensor) -> torch.Tensor:
        """Un-rotate the server's final residual [n, d] and apply final norm and LM head: [n, vocab]."""
        hidden = residual.to(self.dtype) @ self.basis.T
        return (self.norm(hidden.unsqueeze(0))[0] @ self.lm_head.T).float()
