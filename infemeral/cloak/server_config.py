"""The server bundle's config.json: what running the served layers needs, and nothing that names the model.

A checkpoint's config carries its source (`_name_or_path`, GGUF's `general.name`
as `_model_name_or_path`, hub ids, file names), its vocabulary and special
tokens, and the library version that wrote it. None of that is needed to run
decoder layers on hidden states, and all of it helps whoever reads the pod's
volume to name the model. So the server config keeps only the fields the
supported layer classes, their rotary embedding and the engine read. (The
weights' singular values still identify a public model: README, docs/design.md §3.)
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

# Read by the Llama / Mistral / Qwen2 / Qwen3 decoder layers, their rotary embeddings, the KV window and the engine.
SERVER_CONFIG_KEYS = (
    "model_type",
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "rms_norm_eps", "attention_bias", "attention_dropout", "mlp_bias",
    "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "max_position_embeddings",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
)


def server_config_dict(config: PretrainedConfig) -> dict:
    """The config as a dict restricted to SERVER_CONFIG_KEYS (fields the config does not have are left out)."""
    full = config.to_dict()
    return {key: full[key] for key in SERVER_CONFIG_KEYS if key in full}


def write_server_config(config: PretrainedConfig, directory: Path) -> None:
    """Write the scrubbed config.json and check that it reloads to the same layer settings."""
    kept = server_config_dict(config)
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n")
    reloaded = AutoConfig.from_pretrained(directory).to_dict()
    changed = [key for key, value in kept.items() if reloaded.get(key) != value]
    if changed:  # a field the layers read depends on one we dropped: refuse rather than serve wrong
        raise RuntimeError(f"the server config does not round-trip for {', '.join(changed)}; "
                           f"SERVER_CONFIG_KEYS is missing a field this {config.model_type} config needs")
