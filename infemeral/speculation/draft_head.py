"""A draft head on the laptop (EAGLE-style): drafts from the model's own top-layer feature.

The laptop already holds what such a head needs (docs/design.md §9): the feature of
every verified position (the server's final residual, un-rotated and passed
through the final norm — exactly what the LM head reads), its own embedding
table and its own LM head. The head itself is one decoder layer:

    x_i = fc(concat(embedding(t_{i+1}), f_i))        f_i: the feature at position i
    h_i = layer(x_i | x_{<i})                        over the head's own small KV cache
    h_i ≈ f_{i+1};  LM head(h_i) drafts t_{i+2}

and it continues from its own prediction for as many drafts as the step carries.
Verification is the model's own (`acceptance.accept_drafts`), so greedy output stays
token-identical and sampling keeps the target distribution whatever the head proposes.
Public EAGLE / EAGLE-2 heads load as they are (the layout: above `read_checkpoint`).

A `DraftHead` holds the weights, shared and only read; every session drafts through its own
`HeadDrafter` (`fork()`), with a KV cache and a window of recent features of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from infemeral.errors import FailedPrecondition, InfemeralError
from infemeral.files import write_private
from infemeral.kvcache.cache import KVCache
from infemeral.layers import architecture
from infemeral.layers.stack import head_dim, runtime_config

FORMAT = "infemeral-draft-head"
FORMAT_VERSION = 1
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYER_PREFIX = "layers.0."
PROBE_ROWS = 64
_LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_TRAINING_HINT = "`infemeral-client train-drafter` trains a head for this model"


# -- the module -------------------------------------------------------------------------------------

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

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """embeds, features [B, n, d] (embedding of the token after each position, feature of the position)
        -> predicted features of the next positions [B, n, d]. With `cache` (B = 1) the n positions follow
        the cached ones and are appended to it."""
        x = self.fc(torch.cat([embeds, features], dim=-1))
        n = x.shape[1]
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + n, device=x.device).unsqueeze(0)
        cos_sin = self.rotary(x, positions)
        if cache is not None:
            cache.begin_step()
        x = self.layers[0](x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin,
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


# -- reading and writing the layout ---------------------------------------------------------------------

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
# trained here (`train_head.py`) use the same convention and add, in the EAGLE-3 manner, a reduced draft
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
                                f"and weights; {_TRAINING_HINT})")
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
                                 f"or {_TRAINING_HINT}")
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


# -- the vocabulary drafts are read over ---------------------------------------------------------------

class DraftVocab:
    """The LM head a head's feature is read by: the client's own (full vocabulary), or only the rows of a
    reduced draft vocabulary, whose argmax is mapped back to the target's ids."""

    def __init__(self, table, target_ids: torch.Tensor | None = None, *, vocab_size: int | None = None):
        self.table = table
        self.target_ids = None if target_ids is None else target_ids.long().cpu()
        self._ids = None if target_ids is None else self.target_ids.tolist()
        self.size = vocab_size if target_ids is None else len(self.target_ids)  # tokens drafts are read over

    @classmethod
    def of(cls, model, target_ids: torch.Tensor | None) -> "DraftVocab":
        """Over `model`'s LM head, restricted to `target_ids` (None: the whole vocabulary)."""
        if target_ids is None:
            return cls(model.head, vocab_size=model.embed.shape[0])  # a packed head keeps no shape of its own
        return cls(rows_of(model.head, target_ids.to(model.device), model.dtype, model.device), target_ids)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table.project(hidden)

    def best(self, hidden: torch.Tensor) -> int:
        """The target id of the most likely token for one feature [1, d]."""
        i = int(self.project(hidden)[-1].argmax())
        return i if self._ids is None else self._ids[i]


def rows_of(table, ids: torch.Tensor, dtype: torch.dtype, device: torch.device):
    """A table of only `ids`' rows of the client's LM head `table` (dense, int8 or packed), held as the client
    holds its own (packed where its dtype packs)."""
    from infemeral.client_half import packed
    from infemeral.client_half.tables import DenseTokenTable, Int8TokenTable

    if hasattr(table, "codes"):
        return Int8TokenTable(table.codes[ids], table.scales[ids], dtype, device)
    weight = table.weight
    if weight.is_mkldnn:
        weight = weight.to_dense()
    weight = weight[ids].to(device, dtype).contiguous()
    if packed.packs(device.type, dtype):
        return packed.PackedHead(weight)
    return DenseTokenTable(weight)


# -- the head, shared --------------------------------------------------------------------------------

class DraftHead:
    """A draft head bound to one client half: its weights in the half's dtype, on its device, int8 where the
    half is int8 (`quant` overrides), packed where the half packs; read over a reduced draft vocabulary when
    the head has one (unless `full_vocab`). Sessions draft through `fork()`."""

    name = "head"

    def __init__(self, module: HeadModel, model, *, draft_ids: torch.Tensor | None = None,
                 quant: str | None = None, description: str = "draft head", keep_features: int = 512,
                 max_positions: int = 2048, prompt_features: int = 64):
        from infemeral.client_half import packed
        from infemeral.quant import int8

        self.model, self.description = model, description
        self.dtype, self.device = model.dtype, model.device
        self.quant = quant or getattr(getattr(model, "compute", None), "quant", "none")
        module = module.to(self.device, self.dtype).eval().requires_grad_(False)
        module.rotary = module._rotary(self.device)  # RoPE angles stay float32 whatever the weights' dtype
        if self.quant == "int8":
            _to_int8(module, self.dtype)
        elif packed.packs(self.device.type, self.dtype):
            packed.pack_linears(module)
        self.module = module
        self.vocab = DraftVocab.of(model, draft_ids)
        self.keep_features, self.max_positions = keep_features, max_positions
        self.prompt_features = prompt_features  # features of a turn's last prompt positions a session asks for
        self.threads = DraftThreads(self.device)

    @classmethod
    def load(cls, path: str | Path, model, *, full_vocab: bool = False, quant: str | None = None) -> "DraftHead":
        """A head from a directory in the public layout, checked against the client half `model`."""
        config, raw, tensors = read_checkpoint(path)
        problem = target_mismatch(config, tensors, model)
        if problem:
            raise FailedPrecondition(f"{path} is a draft head for another model: {problem}. A head drafts from "
                                     f"this model's own features, so it must be built for it; {_TRAINING_HINT}")
        module = HeadModel.from_tensors(layer_config(config, tensors.keys()), tensors)
        draft_ids = None
        if "d2t" in tensors and not full_vocab:
            d2t = tensors["d2t"].long()
            draft_ids = torch.arange(len(d2t)) + d2t
            if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= model.embed.shape[0]:
                raise InfemeralError(f"{path}: its draft vocabulary (d2t) names tokens outside the vocabulary")
        return cls(module, model, draft_ids=draft_ids, quant=quant, description=str(path))

    @property
    def hidden_size(self) -> int:
        return self.module.hidden_size

    def new_cache(self) -> KVCache:
        return self.module.new_cache(self.dtype, self.device)

    def embed(self, ids: Sequence[int]) -> torch.Tensor:
        return self.model.embed.lookup(torch.tensor(list(ids), dtype=torch.long, device=self.device))

    def memory_bytes(self) -> int:
        from infemeral.client_half import packed

        tensors = [*self.module.parameters(), *self.module.buffers()]
        if self.vocab.target_ids is not None:
            tensors += self.vocab.table.tensors()
        return sum(packed.nbytes(t) for t in tensors)

    def fork(self) -> "HeadDrafter":
        """One session's drafter: these weights, a cache and features of its own."""
        return HeadDrafter(self)


class DraftThreads:
    """How many CPU threads drafting runs on: one or all, whichever drafts faster, measured on the proposals
    themselves (a few at each, again every `recheck` proposals, as the machine's load changes).

    A head is a few small products per draft token; with several threads each one waits for them all, and on
    a CPU that other work keeps busy that wait is most of the cost (the default model's head on the loaded
    2-core machine: 5.4 ms per draft token on one thread, 14 ms on two). A large head (8B shape) gains from
    all threads when the machine is quiet. Sessions share it: the choice is the machine's, not the text's."""

    trials = 3

    def __init__(self, device: torch.device, recheck: int = 256):
        self.is_cpu = device.type == "cpu"
        self.most = torch.get_num_threads()
        self.recheck = recheck
        self._count = 0
        self._timings: dict[int, list[float]] = {1: [], self.most: []}
        self.chosen: int | None = None if self.is_cpu and self.most > 1 else self.most

    def run(self, draft):
        """`draft()` on the chosen number of threads (or one being tried), timed while trying."""
        if not self.is_cpu or self.most <= 1:
            return draft()
        self._count += 1
        if self._count % self.recheck == 0:
            self.chosen, self._timings = None, {1: [], self.most: []}
        trying = None
        if self.chosen is None:
            trying = 1 if len(self._timings[1]) < self.trials else self.most
        threads = trying or self.chosen
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        started = time.perf_counter()
        try:
            drafts = draft()
        finally:
            torch.set_num_threads(before)
        if trying is not None:
            self._timings[trying].append((time.perf_counter() - started) / max(len(drafts), 1))  # per draft token
            if all(len(t) >= self.trials for t in self._timings.values()):
                self.chosen = min(self._timings, key=lambda n: sorted(self._timings[n])[self.trials // 2])
        return drafts


def _to_int8(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every linear of `module` as int8 codes with a scale per row (the client's int8 kernel)."""
    from infemeral.quant.int8 import Int8Linear, aligned, quantize_rows

    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                q = Int8Linear(child.in_features, child.out_features, child.bias is not None)
                codes, scales = quantize_rows(child.weight.detach())
                q.weight, q.scale = aligned(codes.to(child.weight.device)), scales.to(child.weight.device, dtype)
                if child.bias is not None:
                    q.bias = child.bias.detach()
                setattr(parent, name, q)


# -- one session's drafter ----------------------------------------------------------------------------

class HeadDrafter:
    """Drafts for one conversation from the features the turn loop hands it (`observe`).

    It keeps the head's KV cache for positions [start, start + cache.length) — position i read the
    embedding of token i+1 and the feature of position i — and the features of the last
    `keep_features` verified positions, so it catches up by itself on steps that drafted from another
    source. A proposal feeds the positions it has not read, then drafts from its own predictions and
    drops them again: only verified positions stay in its cache. When the conversation changes under
    it (a rewind, a rejected draft) it forgets what no longer holds; when it lacks the features it
    needs (the start of a turn whose prompt came without them) it proposes nothing."""

    name = "head"
    is_free = False  # every draft token is a forward pass of the head and a product with the LM head

    def __init__(self, head: DraftHead):
        self.head = head
        self.prompt_features = head.prompt_features
        self.cache = head.new_cache()
        self.start = 0              # the absolute position of the cache's first position
        self.tokens: list[int] = []  # the verified context the features and the cache belong to
        d = head.hidden_size
        self._features = torch.empty(2 * head.keep_features, d, dtype=head.dtype, device=head.device)
        self._feature_start = self._feature_end = 0  # absolute positions held in _features[: end - start]

    # -- what the turn loop reports -------------------------------------------------------------------
    def observe(self, context_ids: Sequence[int], features: torch.Tensor) -> None:
        """`features` [n, d]: the features of the last n positions of `context_ids`, every token of which is
        verified (the model's own output or the prompt)."""
        ids = list(context_ids)
        self._agree(ids)
        self.tokens = ids
        keep = self.head.keep_features
        rows = features[-keep:]
        end = len(ids)
        start = end - len(rows)
        if not len(rows):
            return
        if not self._feature_start <= start <= self._feature_end or self._feature_end == self._feature_start:
            self._feature_start = self._feature_end = start  # not adjacent to what is held: begin again here
        if start - self._feature_start + len(rows) > self._features.shape[0]:  # full: keep the last `keep`
            first = end - keep
            held = self._features[first - self._feature_start:start - self._feature_start].clone()
            self._features[:len(held)] = held
            self._feature_start = first
        offset = start - self._feature_start
        self._features[offset:offset + len(rows)] = rows.to(self._features.dtype)
        self._feature_end = end

    def reset(self) -> None:
        self.cache.truncate(self.cache.length)
        self.tokens, self.start = [], 0
        self._feature_start = self._feature_end = 0

    # -- drafting ------------------------------------------------------------------------------------
    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        """Up to `max_draft` tokens after `context_ids`, whose last token is sampled and not yet verified."""
        return self.head.threads.run(lambda: self._propose(context_ids, max_draft))

    @torch.inference_mode()
    def _propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        m = len(context_ids) - 1
        if max_draft <= 0 or m < 1:
            return []
        self._agree(context_ids)
        if self._feature_end < m or self._feature_start > m - 1:
            return []  # the feature of the position before the last token is unknown
        head = self.head
        end = self.start + self.cache.length
        if end > m - 1 and self.cache.length:  # its cache already read position m-1: read it again for its output
            self.cache.truncate(end - (m - 1))
            end = m - 1
        if self.cache.length == 0 or end < self._feature_start or m - self.start > head.max_positions:
            self.cache.truncate(self.cache.length)
            self.start = end = max(self._feature_start, m - head.keep_features, 0)
        feats = self._features[end - self._feature_start:m - self._feature_start]
        h = head.module(head.embed(context_ids[end + 1:m + 1]).unsqueeze(0), feats.unsqueeze(0), self.cache)[0, -1:]
        verified = self.cache.length
        drafts = [head.vocab.best(h)]
        while len(drafts) < max_draft:
            h = head.module(head.embed(drafts[-1:]).unsqueeze(0), h.unsqueeze(0), self.cache)[0]
            drafts.append(head.vocab.best(h))
        self.cache.truncate(self.cache.length - verified)
        return drafts

    def _agree(self, context_ids: Sequence[int]) -> None:
        """Forget what does not belong to `context_ids`: features of positions past where it leaves the verified
        tokens, and cached positions that read them."""
        tokens = self.tokens
        n = len(tokens)
        if len(context_ids) >= n and list(context_ids[:n]) == tokens:
            return
        q = 0
        for a, b in zip(tokens, context_ids):
            if a != b:
                break
            q += 1
        self.tokens = tokens[:q]
        self._feature_end = min(self._feature_end, q)
        if self._feature_end <= self._feature_start:
            self._feature_start = self._feature_end = 0
        keep = q - 1 - self.start  # position i read token i + 1
        if keep <= 0:
            self.cache.truncate(self.cache.length)
            self.start = 0
        elif keep < self.cache.length:
            self.cache.truncate(self.cache.length - keep)

