"""The model and generation configs as `prepare` stored them, read as plain attributes, without transformers.

Importing transformers costs every laptop command 0.8-1 s (its package scans the source of every model family)
for a client that reads a few numbers from two JSON files. `prepare` stores every attribute the family's config
class resolved (rope parameters, layer types, head size), so a stored config read as attributes is the class's
own (tests/layers/test_plain_decoder.py compares them for every supported family). Where a reader needs transformers'
methods (a RoPE scaled by transformers' own functions, a family infemeral does not run in plain torch), the
config goes through transformers' classes instead: `bundle.stored_config` decides.
"""

from __future__ import annotations

import json
from pathlib import Path


class StoredConfig:
    """A stored model config: its fields as attributes (a field it lacks raises AttributeError, as on any
    object, so `getattr(config, name, default)` reads it as transformers' configs are read)."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __repr__(self) -> str:
        return f"StoredConfig(model_type={getattr(self, 'model_type', None)!r})"


class StoredGenerationConfig:
    """A stored generation config: a field it does not set reads as None, as transformers' class leaves it."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    @classmethod
    def read(cls, path: Path) -> "StoredGenerationConfig":
        return cls(json.loads(path.read_text()) if path.is_file() else {})

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None
