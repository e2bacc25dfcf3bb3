"""On-disk client and server bundles, and the server bundle's fingerprint.

Server bundle (safe to upload to a pod): config, one safetensors file per served
layer (folded and rotated, and quantised if the manifest's `server_quant` says so:
those bundles are format version 2), manifest with a fingerprint. The fingerprint is a
SHA-256 over the manifest fields and the files' hashes: it identifies the exact
weights without revealing anything about Q.

Client bundle (owner-only, never leaves the laptop): tokenizer, configs, the
embedding, the first `client_layers` layers (plain), final norm, LM head, the
secret basis Q, and the fingerprint of the server bundle it matches.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from infemeral.cloak import resolved_tokenizer
from infemeral.cloak.manifest import (CLIENT_FORMAT, FORMAT_VERSION, QUANTIZED_FORMAT_VERSION,  # noqa: F401
                                      SERVER_FORMAT, fingerprint, read_manifest)
from infemeral.cloak.stored_config import StoredConfig, StoredGenerationConfig
from infemeral.errors import FailedPrecondition
from infemeral.layers.architecture import SUPPORTED

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def layer_file(index: int) -> str:
    return f"layer-{index:05d}.safetensors"


def clean_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config without load-time leftovers (e.g. GGUF quantization info)."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


@dataclass
class ServerBundle:
    directory: Path
    manifest: dict
    config: PretrainedConfig

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    @property
    def first_layer(self) -> int:
        return self.manifest["first_layer"]

    @property
    def num_layers(self) -> int:
        return self.manifest["num_layers"]

    @classmethod
    def open(cls, directory: str | Path, verify: bool = True) -> "ServerBundle":
        """The manifest and model config (quick); with `verify`, also every file's hash (reads the weights)."""
        directory = Path(directory).expanduser()
        manifest = read_manifest(directory, SERVER_FORMAT, (FORMAT_VERSION, QUANTIZED_FORMAT_VERSION))
        bundle = cls(directory, manifest, auto_config(directory))
        if verify:
            bundle.verify()
        return bundle

    def verify(self) -> None:
        for name, digest in self.manifest["files"].items():
            if sha256_file(self.directory / name) != digest:
                raise FailedPrecondition(f"server bundle file {name} does not match its manifest; re-upload the bundle")
        if fingerprint(self.manifest) != self.manifest["fingerprint"]:
            raise FailedPrecondition("server bundle manifest has been modified; re-upload the bundle")

    def layer_weights(self, index: int) -> dict[str, torch.Tensor]:
        """Layer `index` as stored: float weights, or quantised codes and their scales (see `float_layer_weights`)."""
        return load_file(str(self.directory / layer_file(index)))

    def float_layer_weights(self, index: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Layer `index` with plain float weights (quantised ones dequantised), e.g. for analysis."""
        from infemeral.quant.served import dequantize_layer

        return dequantize_layer(self.layer_weights(index), dtype)


def auto_config(directory: Path) -> PretrainedConfig:
    """The config through its family's class (imported here: transformers' map of families is slow to build)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def stored_config(directory: Path) -> PretrainedConfig | StoredConfig:
    """The model's config as `prepare` stored it, where it can be read without transformers (stored_config.py).

    A family infemeral runs in plain torch with fixed RoPE frequencies reads as plain attributes (the
    laptop's commands start without importing transformers); a RoPE scaled by transformers' own functions
    needs the config's methods, and reads through a config class without the family's modeling imports
    (importing a family's config class brings transformers' weight-loading and distributed stacks along,
    0.7 s more); a config that lacks the resolved attributes (another family, an older layout) reads
    through transformers' class for its family.
    """
    data = json.loads((directory / "config.json").read_text())
    model_type = data.get("model_type")
    if model_type not in SUPPORTED or "rope_parameters" not in data:
        return auto_config(directory)
    if (data["rope_parameters"] or {}).get("rope_type") == "default":
        return StoredConfig(data)
    return _stored_config_class(model_type).from_dict(data)


@functools.cache
def _stored_config_class(model_type: str) -> type[PretrainedConfig]:
    from transformers import PretrainedConfig

    return type(f"Stored{SUPPORTED[model_type]}Config", (PretrainedConfig,), {"model_type": model_type})


# Saved tokenizer classes that AutoTokenizer resolves to transformers' generic tokenizers-library class itself.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(directory: Path):
    """The tokenizer saved in `directory`, as `AutoTokenizer` loads it.

    A tokenizer saved as transformers' generic class is that class whatever the model, so it is loaded through
    the class directly: `AutoTokenizer` first builds transformers' map of every model family (it reads the
    source of each), 0.3-0.6 s of every start of a laptop's command. Any other class (a family's own tokenizer
    with its own rules) goes through `AutoTokenizer` as before.
    """
    try:
        saved = json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        saved = None
    if saved in GENERIC_TOKENIZERS and (directory / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


@dataclass
class ClientBundle:
    directory: Path
    manifest: dict
    config: PretrainedConfig

    @property
    def server_fingerprint(self) -> str:
        return self.manifest["server_fingerprint"]

    @property
    def client_layers(self) -> int:
        return self.manifest["client_layers"]

    @classmethod
    def open(cls, directory: str | Path) -> "ClientBundle":
        directory = Path(directory).expanduser()
        manifest = read_manifest(directory, CLIENT_FORMAT)
        return cls(directory, manifest, stored_config(directory))

    def tokenizer(self):
        """The tokenizer as transformers loads it."""
        return load_tokenizer(self.directory / "tokenizer")

    def laptop_tokenizer(self):
        """What the client encodes, decodes and renders chats with: the tokenizer read without transformers
        where `prepare` resolved it (resolved_tokenizer.py), else as transformers loads it. A bundle prepared
        before such files existed gets one written now, so only its first start pays for transformers."""
        directory = self.directory / "tokenizer"
        found = resolved_tokenizer.load(directory)
        if found is not None:
            return found
        tokenizer = self.tokenizer()
        try:
            resolved_tokenizer.write(tokenizer, directory)
        except OSError as e:  # a read-only bundle: every start loads through transformers
            log.info("could not add the resolved tokenizer to %s (%s)", directory, e.strerror)
        return tokenizer

    def generation_config(self) -> StoredGenerationConfig:
        """The model's generation config as stored (a field it does not set reads as None)."""
        return StoredGenerationConfig.read(self.directory / "generation_config.json")

    def tensors(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.directory / "client.safetensors"))

    def basis(self) -> torch.Tensor:
        return load_file(str(self.directory / "basis.safetensors"))["basis"]


def make_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def restrict_tree(path: Path) -> None:
    """Make every file under path owner-only (the client bundle holds the secret basis)."""
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o700)
        for f in files:
            os.chmod(os.path.join(root, f), 0o600)
