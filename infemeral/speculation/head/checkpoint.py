"""A draft head on disk: the public EAGLE / EAGLE-2 layout read and written, and the checks that a head belongs
to this model (its shape, and a probe of the target's embedding)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from infemeral.errors import FailedPrecondition, InfemeralError
from infemeral.files import write_private
from infemeral.layers import architecture
from infemeral.speculation.head.model import LAYER_PREFIX, HeadModel

FORMAT = "infemeral-draft-head"
FORMAT_VERSION = 1
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
PROBE_ROWS = 64
TRAINING_HINT = "`infemeral-client train-drafter` trains a head for this model"

# The public EAGLE / EAGLE-2 checkpoint's layout (e.g. the heads published for Llama-3-Instruct and Qwen2):
#
#   config.json   a one-layer Llama or Qwen2 config of the target's hidden size and vocabulary
#   weights       model.safetensors or pytorch_model.bin: `fc.weight` [d, 2d] (and `fc.bias` where the
#                 head has one), `layers.0.*` of one decoder layer whose `input_layernorm` is absent (fc's
#                 output goes into attention as it is), optionally `embed_tokens.weight` (the target's own
#                 table: used here only to check that the head belongs to this model)
#
# The input is concat(embedding, feature) in that order, and the feature is the top layer's output *after*
# the final norm, as in EAGLE's reference code (`torch.cat((inputs_embeds, hidden_states), -1)`, features
# taken from the base model's normed output, drafts read by the base LM head with no further norm). Heads
# trained here (`train.py`) use the same convention and add, in the EAGLE-3 manner, a reduced draft
# vocabulary: `d2t` maps each draft-vocabulary id to its target id (as an offset, target = draft +
# d2t[draft]) and `t2d` marks those target ids; drafting then multiplies by only those rows of the LM
# head, which is most of a draft token's cost on a laptop. They also keep `target_probe.ids` /
# `target_probe.weight`, a few rows of the target's embedding, so that a head trained for another model of
# the same shape is refused too. EAGLE-3 heads (fc over three layers' features, `midlayer.*`) need
# features the laptop never sees and are refused.


def read_checkpoint(path: str | Path) -> tuple[PretrainedConfig, dict, dict[str, torch.Tensor]]:
    """(config, the raw config.json, tensors) of a head directory in the public EAGLE layout."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise FileNotFoundError(f"draft head not found: {directory} (give the directory holding its config.json "
                                f"and weights; {TRAINING_HINT})")
    config_file = directory / "config.json"
    if not config_file.exists():
        raise InfemeralError(f"{directory} holds no config.json: not a draft head directory")
    raw = json.loads(config_file.read_text())
    tensors: dict[str, torch.Tensor] = {}
    files = [directory / name for name in WEIGHT_FILES if (directory / name).exists()]
    if not files:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InfemeralError(f"{directory} holds no weights ({' or '.join(WEIGHT_FILES)})")
    weights = files[0]
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(weights))
    else:
        tensors = torch.load(str(weights), map_location="cpu", weights_only=True)
    if "fc.weight" not in tensors:  # a saved wrapper module: strip its one prefix
        prefixes = {name[:-len("fc.weight")] for name in tensors if name.endswith(".fc.weight")}
        if len(prefixes) == 1:
            prefix = prefixes.pop()
            tensors = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    if any(name.startswith("midlayer.") for name in tensors):
        raise FailedPrecondition(f"{directory} is an EAGLE-3 head: it reads the features of three of the model's "
                                 "layers, and the laptop sees only the top layer's. Use an EAGLE or EAGLE-2 head, "
                                 f"or {TRAINING_HINT}")
    if "fc.weight" not in tensors or not any(name.startswith(LAYER_PREFIX) for name in tensors):
        raise InfemeralError(f"{weights} is not a draft head in the EAGLE layout (it needs fc.weight and "
                             f"{LAYER_PREFIX}*)")
    model_type = raw.get("model_type")
    if model_type not in architecture.SUPPORTED:
        raise FailedPrecondition(f"{directory}: a draft head of model_type={model_type!r} is not supported "
                                 f"(supported: {', '.join(sorted(architecture.SUPPORTED))})")
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "layer_types", "infemeral")}
    config = AutoConfig.for_model(model_type, **fields)  # layer types, if any, are the base model's, not one layer's
    return config, raw, tensors


def target_mismatch(config: PretrainedConfig, tensors: Mapping[str, torch.Tensor], model) -> str | None:
    """Why a head with this config and these tensors cannot draft for the client half `model`, or None."""
    d, vocab = model.config.hidden_size, model.embed.shape[0]
    if config.hidden_size != d:
        return f"its hidden size is {config.hidden_size}, this model's is {d}"
    if config.vocab_size != vocab:
        return f"its vocabulary has {config.vocab_size} tokens, this model's {vocab}"
    fc = tensors["fc.weight"]
    if tuple(fc.shape) != (d, 2 * d):
        return f"its fc.weight is {list(fc.shape)}, a head over [embedding, feature] of this model has {[d, 2 * d]}"
    if "embed_tokens.weight" in tensors:
        table = tensors["embed_tokens.weight"]
        if tuple(table.shape) != (vocab, d):
            return f"its embedding table is {list(table.shape)}, this model's {[vocab, d]}"
        ids = torch.linspace(0, vocab - 1, PROBE_ROWS).long().unique()
        rows = table[ids]
    elif "target_probe.ids" in tensors:
        ids, rows = tensors["target_probe.ids"].long(), tensors["target_probe.weight"]
        if ids.numel() and (int(ids.max()) >= vocab or rows.shape[-1] != d):
            return "its probe of the target's embedding does not fit this model's table"
    else:
        return None
    with torch.inference_mode():
        ours = model.embed.lookup(ids.to(model.device)).float().cpu()
        cosine = torch.nn.functional.cosine_similarity(rows.float(), ours, dim=-1)
        nonzero = (rows.float().norm(dim=-1) > 0) & (ours.norm(dim=-1) > 0)
    if nonzero.any() and float(cosine[nonzero].median()) < 0.95:
        return (f"its copy of the embedding table is not this model's (median cosine {float(cosine[nonzero].median()):.2f} "
                "over sampled rows): it was trained for another model of the same shape")
    return None


def save_head(directory: str | Path, module: HeadModel, *, draft_ids: torch.Tensor | None = None,
              vocab_size: int, probe_ids: torch.Tensor | None = None, probe_rows: torch.Tensor | None = None,
              info: dict | None = None) -> Path:
    """Write `module` in the public layout (config.json + model.safetensors), with a draft vocabulary
    (`draft_ids`: target ids, EAGLE-3's d2t/t2d) and a probe of the target's embedding where given. Each file
    is replaced whole; both are owner-only, like everything else infemeral keeps on the laptop."""
    from safetensors.torch import save as save_tensors

    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()
               if k.startswith(("fc.", LAYER_PREFIX))}
    config = module.config.to_dict()
    for key in ("_attn_implementation_autoset", "_attn_implementation", "attn_implementation", "id2label",
                "label2id", "torch_dtype"):
        config.pop(key, None)
    config.update(num_hidden_layers=1, vocab_size=vocab_size, dtype="float32",
                  architectures=[f"{architecture.SUPPORTED[module.config.model_type]}ForCausalLM"])
    if draft_ids is not None:
        draft_ids = draft_ids.long().cpu()
        tensors["d2t"] = draft_ids - torch.arange(len(draft_ids))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        tensors["t2d"] = t2d
        config["draft_vocab_size"] = len(draft_ids)
    if probe_ids is not None:
        tensors["target_probe.ids"] = probe_ids.long().cpu()
        tensors["target_probe.weight"] = probe_rows.float().cpu().contiguous()
    config["infemeral"] = {"format": FORMAT, "format_version": FORMAT_VERSION,
                           "input": "fc(concat(embedding of the next token, feature of the position))",
                           "feature": "top layer output after the final norm (the LM head's input)", **(info or {})}
    write_private(directory / "model.safetensors", save_tensors(tensors, metadata={"format": "pt"}))
    config_text = json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"
    write_private(directory / "config.json", config_text.encode())
    return directory


def probe_of(table_rows, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the target's embedding a trained head keeps as the probe: evenly spread ids."""
    ids = torch.linspace(0, vocab - 1, PROBE_ROWS).long().unique()
    return ids, table_rows(ids)
