"""Long phases show progress on stderr (stdout stays the result): eval server-quant's measurement and GPTQ's
calibration. Tiny fakes, so each test costs well under a second."""

from __future__ import annotations

import torch

from infemeral.eval import metrics
from infemeral.eval import server_quant as sq

VOCAB = 11


class CountingSystem:
    """A `.logits(ids, cache)` system with fixed random logits; counts the tokens it is asked about."""

    def __init__(self, seed: int):
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
        self.tokens = 0

    def new_cache(self):
        return None

    def logits(self, ids, cache):
        self.tokens += len(ids)
        return self.table[torch.tensor(ids) % VOCAB]


class DigitTokenizer:
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [int(c) for c in text if c.isdigit()]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [len(m["content"]) % VOCAB for m in messages] + [1, 2]


def test_the_bundle_measure_shows_its_phases_on_stderr(capsys):
    sq.measure_bundle(CountingSystem(0), CountingSystem(1), DigitTokenizer(), "3141592653" * 20, text_tokens=150,
                      positions=24, quant="int4 (test)", progress=True)
    out = capsys.readouterr()
    assert out.out == ""
    for phase in ("float32 greedy answers", "float32 perplexity", "int4 (test) perplexity", "int4 (test) agreement"):
        assert phase in out.err, out.err


def test_each_phase_advances_the_bar_by_the_tokens_it_did():
    done = []
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    metrics.perplexity(CountingSystem(0), ids, chunk=4, advance=done.append)
    assert done == [4, 4, 1]
    done.clear()
    sequences = metrics.greedy_sequences(CountingSystem(0), [[1, 2], [3]], 12, stop=set(), advance=done.append)
    assert sum(done) == sum(len(c) for _, c in sequences) >= 12
    done.clear()
    agreed = metrics.agreement(CountingSystem(1), sequences, advance=done.append)
    assert done == [len(c) for _, c in sequences] and sum(done) == agreed.positions


def test_the_bundle_measure_is_silent_when_asked(capsys):
    sq.measure_bundle(CountingSystem(0), CountingSystem(1), DigitTokenizer(), "271828" * 10, text_tokens=40,
                      positions=8, progress=False)
    assert capsys.readouterr().err == ""


def test_calibration_passes_show_a_bar_per_layer_on_stderr(capsys):
    from transformers import LlamaConfig

    from infemeral.quant.calibration import Calibration

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=VOCAB)
    shapes = {"input_layernorm.weight": (16,), "post_attention_layernorm.weight": (16,),
              "self_attn.q_proj.weight": (16, 16), "self_attn.k_proj.weight": (8, 16),
              "self_attn.v_proj.weight": (8, 16), "self_attn.o_proj.weight": (16, 16),
              "mlp.gate_proj.weight": (32, 16), "mlp.up_proj.weight": (32, 16), "mlp.down_proj.weight": (16, 32)}
    weights = {name: torch.randn(shape) for name, shape in shapes.items()}
    calibration = Calibration.from_tokens(config, torch.randn(VOCAB, 16), [[1, 2, 3], [4, 5]])
    calibration.progress = True
    calibration.hessians(1, weights)
    calibration.advance(1, weights)
    out = capsys.readouterr()
    assert out.out == ""
    assert "layer 1: calibration inputs (Hessians)" in out.err and "layer 1: calibration text through" in out.err
    calibration.progress = False
    calibration.advance(1, weights)
    assert capsys.readouterr().err == ""
