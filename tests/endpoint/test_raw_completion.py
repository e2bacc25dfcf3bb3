"""Raw completion on a model without a chat template (a base model), end to end.

A tiny random Llama with the packaged tokenizer minus its chat template is
prepared and served for real. Chat is refused with an error that points to raw
mode; raw completion (SDK, CLI, /v1/completions) is token-identical to plain
transformers greedy generation of the same model.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.conftest import start_server
from tests.support.http_endpoint import Uvicorn, post
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams, generation_defaults
from infemeral.endpoint.app import create_app
from infemeral.endpoint.session_pool import SessionPool
from infemeral.errors import NoChatTemplate

PROMPT = "Once upon a time, in a small village by the sea,"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def base_model(reference, tmp_path_factory):
    """Bundles of a tiny random Llama whose tokenizer has no chat template, and a server for them."""
    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource

    _, tokenizer = reference
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = None
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = tmp_path_factory.mktemp("base-model")
    bundles = prepare(output=out, source=ModelSource(model, tokenizer, "tiny base model"), progress=False)
    server = start_server(bundles, out / "store")
    client = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=60)
    yield model, tokenizer, bundles, server, client
    client.close()
    server.stop(0)


def plain_greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_chat_on_a_model_without_template_points_to_raw_mode(base_model):
    _, _, _, _, client = base_model
    with pytest.raises(NoChatTemplate, match=r"no chat template.*generate --raw.*Session\.complete.*/v1/completions"):
        client.new_session().chat("Hello")


def test_raw_completion_equals_plain_transformers(base_model):
    model, tokenizer, _, _, client = base_model
    ids = tokenizer(PROMPT)["input_ids"]
    expected = plain_greedy(model, ids, 2 * NEW_TOKENS)
    session = client.new_session()
    eos, client.eos_ids = client.eos_ids, set()  # a random model may sample its eos token early: fixed length
    first = session.complete(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert first.token_ids == expected[:NEW_TOKENS]
    assert first.text == tokenizer.decode(expected[:NEW_TOKENS], skip_special_tokens=True)
    assert session.messages == [] and session.history_ids[:len(ids)] == ids
    # The same text extended: the cache keeps the prompt and what it generated, only the rest is sent.
    second = session.complete(ids + first.token_ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert second.token_ids == expected[NEW_TOKENS:]
    assert second.truncated_tokens == 0 and second.prompt_tokens == 1  # the last sampled token, never fed
    session.delete()
    client.eos_ids = eos


def test_generate_raw_on_the_command_line(base_model, capsys):
    from infemeral.cli import main as cli

    model, tokenizer, bundles, server, _ = base_model
    args = ["generate", PROMPT, "--server", f"127.0.0.1:{server.port}", "--client-bundle", str(bundles.client_dir),
            "--max-new-tokens", str(NEW_TOKENS), "--no-answer-index", "--greedy"]
    assert cli.main(args) == 2
    assert "no chat template" in capsys.readouterr().err
    assert cli.main(args + ["--raw"]) == 0
    expected = plain_greedy(model, tokenizer(PROMPT)["input_ids"], NEW_TOKENS)
    text = capsys.readouterr().out
    if tokenizer.eos_token_id in expected:  # the CLI stops at the model's eos token
        expected = expected[:expected.index(tokenizer.eos_token_id)]
    assert text == tokenizer.decode(expected, skip_special_tokens=True) + "\n"


def test_the_endpoint_refuses_chat_and_completes_raw_text(base_model):
    _, tokenizer, _, _, client = base_model
    http = Uvicorn(create_app(SessionPool(client), "base", defaults=SamplingParams(max_new_tokens=4)))
    try:
        status, body = post(f"{http.url}/chat/completions",
                            json.dumps({"model": "base", "messages": [{"role": "user", "content": "Hi"}]}).encode())
        assert status == 400 and body["error"]["code"] == "no_chat_template"
        assert "/v1/completions" in body["error"]["message"]
        status, body = post(f"{http.url}/completions", json.dumps({"model": "base", "prompt": PROMPT}).encode())
        assert status == 200 and body["usage"]["prompt_tokens"] == len(tokenizer(PROMPT)["input_ids"])
        assert body["usage"]["completion_tokens"] <= 4 and body["object"] == "text_completion"
    finally:
        http.stop()


def test_sampling_defaults_follow_the_generation_config():
    from transformers import GenerationConfig

    from infemeral.client.settings import ClientSettings

    sampled = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.1)
    assert generation_defaults(sampled) == {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1}
    assert generation_defaults(GenerationConfig(temperature=0.6)) == {}  # greedy unless the config samples
    assert generation_defaults(GenerationConfig()) == {}
    params = ClientSettings().sampling(generation_defaults(sampled))
    assert (params.temperature, params.top_p, params.repetition_penalty) == (0.6, 0.9, 1.1)
    params = ClientSettings(temperature=0.2).sampling(generation_defaults(sampled))  # a flag or env var wins
    assert (params.temperature, params.top_p) == (0.2, 0.9)
