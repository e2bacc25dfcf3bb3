"""Attention sinks + sliding window: exact re-rotation, exact attention after eviction, bounded long chats."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from tests.conftest import StoredSession, start_server
from infemeral.client.sampling import SamplingParams
from infemeral.errors import FailedPrecondition, OutOfRange
from infemeral.kvcache.window import WindowPolicy, apply_window, rerotate, rope_shift_frequencies
from infemeral.layers.stack import LayerStack

ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


def tiny_config(rope: dict, layers: int = 1) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rope_parameters=rope)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_rerotated_keys_equal_keys_computed_at_the_new_positions(rope_type):
    config = tiny_config(ROPE_TYPES[rope_type])
    rotary = LlamaRotaryEmbedding(config)
    inv_freq = rope_shift_frequencies(rotary, config, max_context=200)
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(1, 2, 50, 16, generator=g)  # pre-RoPE keys
    for shift in (1, 16, 37, 150):
        old = torch.arange(shift, shift + 50).unsqueeze(0)
        new = torch.arange(0, 50).unsqueeze(0)
        cos, sin = rotary(raw, old)
        at_old, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
        cos, sin = rotary(raw, new)
        at_new, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
        moved = rerotate(at_old, -shift, inv_freq)
        assert (moved - at_new).abs().max() < 1e-5, (rope_type, shift)
        assert (at_old - at_new).abs().max() > 1e-2  # the shift really moves the keys


def test_rope_types_that_cannot_be_shifted_are_refused():
    config = tiny_config(ROPE_TYPES["dynamic"])
    with pytest.raises(FailedPrecondition, match="max_context <= 256"):
        rope_shift_frequencies(LlamaRotaryEmbedding(config), config, max_context=1024)


def test_eviction_policy_is_whole_pages_after_the_sinks():
    p = WindowPolicy(max_context=64, sink_tokens=4, page_size=16)
    assert p.tokens_to_evict(60, 4) == 0
    assert p.tokens_to_evict(64, 1) == 16
    assert p.tokens_to_evict(50, 30) == 16
    assert p.tokens_to_evict(64, 40) == 48
    assert p.tokens_to_evict(20, 60) == 16  # never evicts the sinks
    with pytest.raises(OutOfRange):
        p.tokens_to_evict(10, 61)
    with pytest.raises(OutOfRange, match="max_context"):
        WindowPolicy(max_context=64, enabled=False).tokens_to_evict(60, 5)


@pytest.mark.parametrize("rope_type", ["default", "llama3", "yarn"])
def test_attention_after_eviction_equals_attention_from_scratch(rope_type):
    """One decoder layer: K/V of a token depend only on its input and position, so the windowed
    output must equal running the retained inputs from scratch at cache-relative positions."""
    torch.manual_seed(1)
    config = tiny_config(ROPE_TYPES[rope_type])
    config.initializer_range = 0.3  # peaked attention, so positions matter visibly
    model = AutoModelForCausalLM.from_config(config).eval()
    weights = {k.removeprefix("model.layers.0."): v for k, v in model.state_dict().items()
               if k.startswith("model.layers.0.")}
    stack = LayerStack(config, 0, [weights])
    policy = WindowPolicy(max_context=40, sink_tokens=4, page_size=8)
    inputs = torch.randn(90, 64)
    for rerotated in (True, False):
        p = WindowPolicy(40, 4, 8, rerotate=rerotated)
        cache, kept = stack.new_cache(), []
        for t in range(90):
            evicted = apply_window(cache, p, 1, stack.rotary.inv_freq.double())
            if evicted:
                kept = kept[:p.sink_tokens] + kept[p.sink_tokens + evicted:]
            out = stack(inputs[t:t + 1], cache)
            kept.append(t)
            assert cache.length == len(kept) <= policy.max_context
        reference = stack(inputs[kept], stack.new_cache())[-1]
        error = (out[-1] - reference).abs().max() / reference.abs().max()  # relative to the output's scale
        if rerotated:
            assert error < 1e-5
        else:
            assert error > 1e-3  # without re-rotation the positions are wrong


@pytest.mark.slow
def test_long_conversation_stays_bounded_and_in_step(bundles, tmp_path):
    from infemeral.client.client import Client

    window, page = 128, 16
    srv = start_server(bundles, tmp_path / "store", max_context=window, page_size=page, sink_tokens=4)
    try:
        client = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=300)
        session = client.new_session()
        per_token = 2 * srv.engine.layers.config.num_key_value_heads * 64 * 4 * srv.engine.bundle.num_layers
        fed, evicted = 0, 0
        questions = ["Tell me about rivers.", "And about mountains?", "What about the sea?", "And deserts?",
                     "Forests, then?", "What about cities?", "Finally, the sky?"]
        for question in questions:
            result = session.chat(question, SamplingParams(max_new_tokens=48))
            fed += result.prompt_tokens + result.generated_tokens
            evicted += result.evicted_tokens
            assert session.cache.length <= window and session.cache.capacity <= 256
            assert result.cache_length == session.cache.length
            stored = StoredSession(srv.settings.store, session.id)
            chunk_bytes = sum(len(v) for k, v in stored.files().items() if k != "manifest")
            assert chunk_bytes <= (window + page) * per_token * 1.05
        assert fed >= 3 * window, fed
        assert evicted > 0 and evicted % page == 0
        assert session.version == len(questions)
        client.close()
    finally:
        srv.stop(0)
