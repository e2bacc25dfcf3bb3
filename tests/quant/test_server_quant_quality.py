"""Quantised served layers of the default model against float32 in perplexity, at the issue's thresholds.

Float32 arithmetic on the quantised-then-dequantised weights (the `methods` measurement of
scripts/studies/server_quant.py), on held text that calibration never sees; that the kernels compute
exactly the dequantised weights is tested in test_server_quant.py. The full measurement (two texts,
greedy agreement, the real bundles) is the benchmark section `server_quant`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from infemeral.eval.metrics import DEFAULT_TEXT, perplexity
from infemeral.quant import served
from infemeral.quant.calibration import calibration_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from studies import server_quant as sq  # noqa: E402

TOKENS = 512
# GPTQ calibrates on the first CALIBRATION_TOKENS of the chat text (prepare's `calibration_tokens`) rather than all
# ~10k: each served layer is run twice over them, about half the cost. Measured on the rotated weights at g=64:
# all 10112 tokens 1.181x, 8192 1.146x, 6144 1.171x, 4096 1.240x, 1024 1.338x (above the baseline's 1.276x).
CALIBRATION_TOKENS = 6144


@pytest.fixture(scope="module")
def held(reference):
    model, tokenizer = reference
    ref = sq.Reference.from_transformers(model, tokenizer)
    ids = tokenizer(DEFAULT_TEXT.read_text(), add_special_tokens=False)["input_ids"][:TOKENS]
    base = perplexity(sq.FloatSplit(ref, "rotated", sq.quantize_row(ref, "rotated", None)), ids)
    return ref, ids, base


def perplexity_ratio(held, row: str, mode: sq.Mode) -> float:
    ref, ids, base = held
    return perplexity(sq.FloatSplit(ref, row, sq.quantize_row(ref, row, mode)), ids) / base


def test_int8_served_layers_stay_within_one_percent_of_float32(held):
    ratio = perplexity_ratio(held, "rotated", sq.Mode.of(served.ServerQuant("int8", "rtn")))
    assert ratio != 1.0 and ratio <= 1.01, f"int8 perplexity {ratio:.4f}x float32"


@pytest.mark.slow
def test_the_default_int4_beats_plain_round_to_nearest(held, monkeypatch):
    """The default int4 (prepare --server-quant int4: GPTQ at g=64; here calibrated on the first
    CALIBRATION_TOKENS of the chat text, as prepare(calibration_tokens=...) does, where prepare itself reads all of
    it) on the pod's rotated weights against the baseline the issue measured first: the plain model's own layers,
    round-to-nearest symmetric int4 in groups of 32.
    The issue's 1.15x is the best int4's: GPTQ at g=32 reaches it in the benchmark section (1.050x/1.080x); the
    default g=64 reaches 1.15x-1.25x depending on the basis and text (docs/server_quant.md), so the bound guards
    that."""
    monkeypatch.setattr(sq, "calibration_ids", lambda tokenizer: calibration_ids(tokenizer, CALIBRATION_TOKENS))
    default = perplexity_ratio(held, "rotated", sq.Mode.of(served.ServerQuant("int4")))
    baseline = perplexity_ratio(held, "plain", sq.Mode("int4", "rtn-sym", 32))
    assert default <= 1.25, f"default int4 perplexity {default:.3f}x float32"
    assert default < baseline, f"default int4 {default:.3f}x, plain round-to-nearest g=32 {baseline:.3f}x"
