"""Which decoder families can be split exactly, and their transformers classes.

The cloak relies on every server layer being pre-norm: RMSNorm reads the
residual stream and its gain can be folded into the next linear layers, and the
only writes to the residual stream are o_proj and down_proj. Models that also
normalise a layer's *output* (Gemma 2/3 sandwich norms) break this and are
refused rather than served wrong.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import TYPE_CHECKING

from infemeral.errors import UnsupportedModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# model_type -> class-name prefix in transformers.models.<model_type>.modeling_<model_type>
SUPPORTED = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}

_WHY_NOT = {
    "gemma2": "it normalises each layer's output (sandwich norms), which no fixed rotation can commute with",
    "gemma3": "it normalises each layer's output (sandwich norms), which no fixed rotation can commute with",
    "gemma3_text": "it normalises each layer's output (sandwich norms), which no fixed rotation can commute with",
    "gemma": "its RMSNorm uses (1 + weight) and scales embeddings, which this cloak does not handle",
}

# Names of one decoder layer's parameters relative to the layer, by role.
READS_RESIDUAL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
WRITES_RESIDUAL = ("self_attn.o_proj", "mlp.down_proj")
NORM_FEEDS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def check_supported(config: PretrainedConfig) -> None:
    """Raise UnsupportedModel with a reason unless the model can be split exactly."""
    model_type = getattr(config, "model_type", None)
    if model_type in SUPPORTED:
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModel(f"{model_type} with hidden_act={act!r} is not supported (expected silu)")
        return
    reason = _WHY_NOT.get(model_type, "only pre-norm Llama-style decoders are supported")
    raise UnsupportedModel(
        f"cannot split model_type={model_type!r}: {reason}. "
        f"Supported: {', '.join(sorted(SUPPORTED))} (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM)."
    )


def modeling_module(config: PretrainedConfig):
    check_supported(config)
    import infemeral.layers.transformers_modeling  # noqa: F401  (without hqq; our cache attention registered)

    return importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")


def decoder_layer_class(config: PretrainedConfig):
    return getattr(modeling_module(config), SUPPORTED[config.model_type] + "DecoderLayer")


def rotary_embedding_class(config: PretrainedConfig):
    return getattr(modeling_module(config), SUPPORTED[config.model_type] + "RotaryEmbedding")


def norm_class(config: PretrainedConfig):
    return getattr(modeling_module(config), SUPPORTED[config.model_type] + "RMSNorm")


def cache_keyword(module) -> str:
    """The keyword `module`'s forward takes its KV cache by: `cache` in transformers releases that renamed it (the
    old `past_key_values` still works there, with a FutureWarning on every call), `past_key_values` before them
    and in infemeral's own plain-torch layers."""
    return _cache_keyword(type(module))


@functools.cache
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
