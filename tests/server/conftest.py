"""Fixtures of the engine's tests: a tiny random Llama's server bundle, a store of either backend, and an
engine serving the one from the other (tests/server/tiny_engine.py drives it)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from infemeral.cloak.bundle import ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.storage.open import open_store

from tests.server.tiny_engine import HIDDEN, make_engine


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> ServerBundle:
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096,
                         initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = prepare(output=tmp_path_factory.mktemp("tiny-engine"), source=ModelSource(model), progress=False)
    return ServerBundle.open(out.server_dir)


@pytest.fixture(params=["directory", "redis"])
def store(request, tmp_path):
    s = open_store(tmp_path / "store" if request.param == "directory" else request.getfixturevalue("redis_url"))
    yield s
    s.close()


@pytest.fixture
def engine(bundle, tmp_path):
    e = make_engine(bundle, open_store(tmp_path / "store"))
    yield e
    e.stop()
