"""The Llama-family decoder layer in plain torch, for the laptop's half: a client starts without
transformers' modeling code.

Importing transformers' modeling code costs a 2-core laptop 0.8 s on every `generate`, `chat` or
`serve` (it brings torch's compiler and distributed-tensor stacks along) for a client that runs one
layer. These classes have transformers' parameter names and shapes and its arithmetic, operation for
operation, for the four families `architecture.SUPPORTED` names (Llama, Mistral, Qwen2, Qwen3: q/k/v
biases, q/k norms, sliding windows); tests/layers/test_plain_decoder.py holds them to bitwise equality with
transformers' own classes, layer by layer and through a cache. The server keeps transformers' classes.

A RoPE that changes with the sequence length ("dynamic", "longrope") is left to transformers' classes:
`handles` says which configs these classes serve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from infemeral.layers import architecture
from infemeral.layers.attention import cache_attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at start


def rope_type(config: PretrainedConfig) -> str | None:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_type")


def handles(config: PretrainedConfig) -> bool:
    """Whether these classes compute exactly what transformers' would for this model."""
    return config.model_type in architecture.SUPPORTED and rope_type(config) in STATIC_ROPE_TYPES


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's RoPE angles; the scaled types' frequencies come from transformers'
    own `ROPE_INIT_FUNCTIONS`."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        params = config.rope_parameters
        if params["rope_type"] == "default":
            dim = head_dim(config)
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) as each family's attention module sets them."""
    if config.model_type == "qwen2":
        return True, False
    if config.model_type == "mistral":
        return False, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def layer_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """The sliding window layer `layer_idx` attends with, as transformers' layers decide it (None: all its cache)."""
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    if config.model_type in ("qwen2", "qwen3") and hasattr(config, "layer_types"):
        return config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
    return None


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = head_dim(config)
        self.scaling = self.head_dim ** -0.5
        self.sliding_window = layer_window(config, layer_idx)
        qkv_bias, o_bias = _attention_biases(config)
        heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=o_bias)
        self.has_qk_norm = config.model_type == "qwen3"
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, past_key_values=None, attention_mask=None,
                **kwargs) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        if self.has_qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = apply_rotary(query, key, *position_embeddings)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, _ = cache_attention(self, query, key, value, attention_mask, scaling=self.scaling,
                                 sliding_window=self.sliding_window, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = config.model_type == "llama" and bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer; called as LayerStack calls transformers' layers."""

    def __init__(self, config: PretrainedConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                position_embeddings=None, **kwargs) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), position_embeddings,
                                       past_key_values, attention_mask, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states
