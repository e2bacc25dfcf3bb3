"""The endpoint's errors as an OpenAI client sees them: malformed JSON, an unknown model, unsupported options,
a prompt past the context, an unreachable server, a wrong or missing API key; sessions the pool evicts are
deleted on the server; the model's name comes from the bundle directory."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.app import create_app
from infemeral.endpoint.serving_models import bundle_model_name
from infemeral.endpoint.session_pool import SessionPool

from tests.conftest import StoredSession, free_port
from tests.endpoint.openai_endpoint import MODEL, QUESTION, error_of
from tests.support.http_endpoint import Uvicorn, post

pytestmark = pytest.mark.slow


def test_malformed_json_is_a_400(endpoint):
    url = f"{endpoint.url}/chat/completions"
    status, body = post(url, b'{"model": "x", "messages": [')
    assert status == 400 and error_of(body)["type"] == "invalid_request_error" and "JSON" in error_of(body)["message"]
    status, body = post(url, json.dumps({"model": MODEL, "messages": "hello"}).encode())
    assert status == 400 and error_of(body)["param"] == "messages"
    status, body = post(url, json.dumps({"model": MODEL, "messages": QUESTION, "temperature": 7}).encode())
    assert status == 400 and error_of(body)["param"] == "temperature"
    for seed in (2**64, -2**63 - 1):  # past what torch's generator takes
        status, body = post(url, json.dumps({"model": MODEL, "messages": QUESTION, "seed": seed}).encode())
        assert status == 400 and error_of(body)["param"] == "seed"
    for seed in (2**64 - 1, -2**63):  # the largest and smallest it takes
        status, body = post(url, json.dumps({"model": MODEL, "messages": QUESTION, "seed": seed, "max_tokens": 2,
                                             "temperature": 1}).encode())
        assert status == 200, body


def test_unknown_model_is_a_404(endpoint):
    with pytest.raises(openai.NotFoundError) as e:
        endpoint.openai().chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]


@pytest.mark.parametrize("extra, param", [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                          ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                                          ({"frequency_penalty": 0.5}, "frequency_penalty")])
def test_unsupported_options_are_refused(endpoint, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        endpoint.openai().chat.completions.create(model=MODEL, messages=QUESTION, **extra)
    assert e.value.body["param"] == param


def test_a_prompt_past_the_context_is_a_400(endpoint, client):
    long = [{"role": "user", "content": "lighthouse " * client.server_info().max_context}]
    opened = len(endpoint.log.turns)
    with pytest.raises(openai.BadRequestError) as e:
        endpoint.openai().chat.completions.create(model=MODEL, messages=long, stream=True)
    assert e.value.body["code"] == "context_length_exceeded"
    assert len(endpoint.log.turns) == opened  # refused before anything was sent


def test_unreachable_server_is_a_503(bundles):
    client = Client(f"127.0.0.1:{free_port()}", bundles.client_dir, timeout=5)
    http = Uvicorn(create_app(SessionPool(client), MODEL))
    try:
        api = openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                api.chat.completions.create(model=MODEL, messages=QUESTION, stream=stream)
            assert e.value.status_code == 503 and "unreachable" in e.value.body["message"]
    finally:
        http.stop()
        client.close()


def test_wrong_or_missing_api_key_is_a_401(endpoint):
    http = Uvicorn(create_app(SessionPool(endpoint.client), MODEL, api_key="s3cret-key"))
    try:
        api = openai.OpenAI(base_url=http.url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            api.models.list()
        assert e.value.body["code"] == "invalid_api_key"
        status, body = post(f"{http.url}/chat/completions", json.dumps({"model": MODEL, "messages": QUESTION}).encode())
        assert status == 401 and error_of(body)["code"] == "invalid_api_key"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{http.url}/models", timeout=30)
        assert e.value.code == 401 and error_of(json.loads(e.value.read()))["code"] == "invalid_api_key"
        api = openai.OpenAI(base_url=http.url, api_key="s3cret-key", max_retries=0)
        assert [m.id for m in api.models.list().data] == [MODEL]
    finally:
        http.stop()


def test_evicted_sessions_are_deleted_on_the_server(server, endpoint):
    """Four different conversations through a pool of three: the least recently used session is deleted
    from the server's store; the pool's own sessions are deleted when the endpoint shuts down."""
    pool = SessionPool(endpoint.client, max_sessions=3)
    http = Uvicorn(create_app(pool, MODEL, defaults=SamplingParams(max_new_tokens=2)))
    api = openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0)
    before = len(endpoint.log.turns)
    try:
        for topic in ("rivers", "mountains", "deserts", "forests"):
            question = f"{topic} " * 12 + "- say something about these."  # conversations that share little
            api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}])
        ids = [t["requests"][0].open.session_id for t in endpoint.log.turns[before:]]
        stored = [StoredSession(server.settings.store, sid).exists() for sid in ids]
        assert len(set(ids)) == 4 and pool.stats.num_evicted == 1 and stored == [False, True, True, True]
    finally:
        http.stop()
    assert not any(StoredSession(server.settings.store, sid).exists() for sid in ids)  # deleted at shutdown


def test_model_name_comes_from_the_bundle_directory(tmp_path):
    assert bundle_model_name(tmp_path / "qwen7b" / "client") == "qwen7b"
    assert bundle_model_name(tmp_path / "my-bundle") == "my-bundle"
