"""The client's plain-torch decoder layers compute exactly what transformers' own classes compute.

Every supported family (biases, q/k norms, sliding windows, scaled RoPE) runs a prompt and decode
steps through a LayerStack of transformers' classes and one of plain_decoder.py's, each over its own
cache, from the same randomised weights: the outputs must be bitwise equal at every step. And a client
half built from a bundle runs without importing transformers at all (the point of the twins).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tests.cloak.test_tiny_models import COMMON, CONFIGS, build
from transformers import LlamaConfig, Qwen2Config

from infemeral.layers import plain_decoder
from infemeral.layers.stack import LayerStack

ROPE_CONFIGS = {
    "llama-rope-llama3": lambda: LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-rope-linear": lambda: Qwen2Config(**COMMON, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
}


def stacks(config):
    model = build(config)
    state = model.model.state_dict()
    layers = [{k[len(f"layers.{i}."):]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
              for i in range(config.num_hidden_layers)]
    return (LayerStack(config, 0, layers, plain=False), LayerStack(config, 0, layers, plain=True),
            model.model.embed_tokens.weight.detach())


@pytest.mark.parametrize("family", [*CONFIGS, *ROPE_CONFIGS])
def test_plain_layers_equal_transformers_layers_bit_for_bit(family):
    config = {**CONFIGS, **ROPE_CONFIGS}[family]()
    reference, plain, embedding = stacks(config)
    assert plain_decoder.handles(config)
    assert all(isinstance(layer, plain_decoder.DecoderLayer) for layer in plain.layers)
    assert not any(isinstance(layer, plain_decoder.DecoderLayer) for layer in reference.layers)
    ref_cache, plain_cache = reference.new_cache(), plain.new_cache()
    g = torch.Generator().manual_seed(2)
    steps = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (10, 1, 1, 3, 1)]
    for ids in steps:  # a prompt, then decode steps and a short chunk (as verified drafts come)
        want, got = reference(embedding[ids], ref_cache), plain(embedding[ids], plain_cache)
        assert torch.equal(want, got), (family, (want - got).abs().max().item())
    for slot in range(config.num_hidden_layers):  # the caches hold the same keys and values
        for want, got in zip(ref_cache.layer_tensors(slot), plain_cache.layer_tensors(slot)):
            assert torch.equal(want, got), (family, slot)


def test_a_rope_that_changes_with_length_is_left_to_transformers():
    config = LlamaConfig(**COMMON, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert not plain_decoder.handles(config)
    _, plain, _ = stacks(config)
    assert not any(isinstance(layer, plain_decoder.DecoderLayer) for layer in plain.layers)


def test_a_client_half_runs_without_importing_transformers(bundles):
    client_dir = bundles.client_dir
    script = f"""
import sys
from infemeral.cloak.bundle import ClientBundle
from infemeral.client_half.half import ClientModel
half = ClientModel(ClientBundle.open({str(client_dir)!r}))
cache = half.new_cache()
hidden = half.cloak([1, 2, 3], cache)
assert hidden.shape[0] == 3 and cache.length == 3, (hidden.shape, cache.length)
heavy = ("transformers", "torch._dynamo", "torch.distributed.tensor", "hqq")
loaded = sorted(m for m in heavy if m in sys.modules)
print("loaded:", loaded)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded: []" in out.stdout, out.stdout


@pytest.mark.parametrize("family", [*CONFIGS, *ROPE_CONFIGS])
def test_a_stored_config_reads_as_the_familys_own_class_reads_it(family, tmp_path):
    """A fixed RoPE reads as plain attributes (no transformers), a scaled one through a config class; either way
    every field the family's class holds that says anything about the model reads the same (what is left out
    is PretrainedConfig's own defaults), and the client's layers built from it compute the same, bit for bit."""
    from transformers import AutoConfig, PretrainedConfig

    from infemeral.cloak.bundle import stored_config
    from infemeral.cloak.stored_config import StoredConfig

    config = {**CONFIGS, **ROPE_CONFIGS}[family]()
    config.save_pretrained(tmp_path)  # as prepare writes the client bundle's config
    want, got = AutoConfig.from_pretrained(tmp_path), stored_config(tmp_path)
    is_plain = config.rope_parameters["rope_type"] == "default"
    assert isinstance(got, StoredConfig) == is_plain, type(got)
    assert type(got).__name__.startswith("Stored") and got.model_type == want.model_type
    wanted = {k: v for k, v in want.to_dict().items() if k not in ("_name_or_path", "use_cache")}
    read = {k: v for k, v in got.to_dict().items() if k not in ("_name_or_path", "use_cache")}
    assert {k: read[k] for k in read.keys() & wanted.keys()} == {k: wanted[k] for k in read.keys() & wanted.keys()}
    assert read.keys() <= wanted.keys() | {"transformers_version"}
    base = PretrainedConfig().to_dict()
    assert {k: wanted[k] for k in wanted.keys() - read.keys()} == {k: base[k] for k in wanted.keys() - read.keys()}

    model = build(want)
    state = model.model.state_dict()
    layers = [{k[len(f"layers.{i}."):]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
              for i in range(want.num_hidden_layers)]
    reference, plain = LayerStack(want, 0, layers, plain=True), LayerStack(got, 0, layers, plain=True)
    x = model.model.embed_tokens.weight.detach()[torch.arange(7)]
    assert torch.equal(reference(x, reference.new_cache()), plain(x, plain.new_cache()))
