"""Greedy output through prepare -> server -> client over real gRPC equals plain transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from infemeral.client.sampling import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 32


def plain_greedy(model, tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=NEW_TOKENS, do_sample=False)
    gen = out[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return [t for t in gen if t not in eos][: NEW_TOKENS]


def test_one_turn_token_identical(reference, any_client):
    client = any_client
    model, tokenizer = reference
    question = "Write a short poem about the sea."
    expected = plain_greedy(model, tokenizer, [{"role": "user", "content": question}])
    assert len(expected) == NEW_TOKENS  # long enough to be a real test
    result = client.new_session().chat(question, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert result.token_ids == expected
    assert result.finish_reason == "length"


def test_three_turn_conversation_token_identical(reference, any_client):
    client = any_client
    model, tokenizer = reference
    session = client.new_session()
    messages = []
    for question in ("What is the capital of France?", "What is it famous for?", "Name one museum there."):
        messages.append({"role": "user", "content": question})
        expected = plain_greedy(model, tokenizer, messages)
        result = session.chat(question, SamplingParams(max_new_tokens=NEW_TOKENS))
        assert result.token_ids == expected
        assert result.text == tokenizer.decode(expected, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": result.text})
    assert session.version == 3
