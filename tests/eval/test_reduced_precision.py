"""bfloat16 and float16 serving on the CPU: close to plain transformers in the same dtype, measured.

Exact equality is not expected (the rotated weights round differently), so the split system's greedy
tokens are teacher-forced through plain transformers in the same dtype and compared position by position
(infemeral/eval/serving_precision.py). Measured on the default model over 2 x 256 tokens: bfloat16 96-97 % top-1,
largest margin at a divergence 0.25; float16 99.6 %, margin 0.03. A wrong basis or a broken cache gives a
low rate and large margins.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.conftest import start_server
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.eval.serving_precision import MAX_MARGIN, MIN_TOP1_RATE, teacher_forced_agreement

pytestmark = pytest.mark.slow

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
TOKENS = 128


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_split_server_agrees_with_plain_transformers_in_the_same_dtype(dtype, reference, bundles, tmp_path):
    model, tokenizer = reference
    srv = start_server(bundles, tmp_path / "store", dtype=dtype)
    client = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=300)
    client.eos_ids = set()  # a long answer: every position counts
    try:
        assert client.server_info().dtype == dtype
        result = client.new_session().chat(PROMPT, SamplingParams(max_new_tokens=TOKENS))
    finally:
        client.close()
        srv.stop(0)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    plain = copy.deepcopy(model).to(getattr(torch, dtype))
    agreement = teacher_forced_agreement(plain, ids, result.token_ids)
    print(f"{dtype}: {agreement.describe()}")
    assert agreement.positions == TOKENS
    assert agreement.top1_rate >= MIN_TOP1_RATE[dtype], agreement.describe()
    assert agreement.max_margin <= MAX_MARGIN[dtype], agreement.describe()


def test_agreement_measure_catches_a_wrong_continuation(reference):
    """The measure itself can fail: tokens that are not the model's choices score low, with large margins."""
    model, tokenizer = reference
    ids = tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
    wrong = tokenizer(" purple elephants sing loudly under seven moons", add_special_tokens=False)["input_ids"]
    agreement = teacher_forced_agreement(model, ids, wrong)
    assert agreement.first_divergence == 0
    assert agreement.top1_rate < 0.5 and agreement.max_margin > 2.0
