"""The endpoint's pooled sessions whose state went wrong: expired or restored to an older version (retried on a
new session), a turn the server aborts (a 409 that keeps the session), a stream cut off after the window slid
(the session stays sound)."""

from __future__ import annotations

import http.client
import json
import os
import queue
import shutil
import time

import openai
import pytest

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.endpoint.app import create_app
from infemeral.endpoint.session_pool import SessionPool
from infemeral.protocol import pb

from tests.conftest import StoredSession, start_server
from tests.endpoint.openai_endpoint import MODEL, TOKENS, TurnLog, error_of, sdk_answer
from tests.support.http_endpoint import Uvicorn, post

pytestmark = pytest.mark.slow


def test_a_pooled_session_whose_state_expired_is_retried_on_a_new_one(server, endpoint, client):
    """The server no longer holds a pooled session (expired, deleted): the request is answered from a new
    session, once, sending the conversation whole."""
    api = endpoint.openai()
    messages = [{"role": "user", "content": "Tell me about the tides of the Atlantic ocean."}]
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS)
    committed = endpoint.log.committed()[-1]["requests"][0].open
    shutil.rmtree(StoredSession(server.settings.store, committed.session_id).folder)  # what its TTL does
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Why do they change?"}]
    expected = sdk_answer(client, messages)
    before, discarded = len(endpoint.log.turns), endpoint.pool.stats.num_discarded
    again = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS)
    assert again.choices[0].message.content == expected.text
    refused, retried = endpoint.log.opens(before)
    assert refused.session_id == committed.session_id and refused.expected_version == committed.expected_version + 1
    assert retried.session_id != committed.session_id and retried.expected_version == 0
    assert endpoint.pool.stats.num_discarded == discarded + 1


def test_a_pooled_session_restored_to_an_older_version_is_retried_on_a_new_one(server, endpoint, client):
    """The store holds an older copy of a pooled session (a backup restored): the server refuses the version
    the endpoint expects, and a streamed request is answered from a new session."""
    api = endpoint.openai()
    messages = [{"role": "user", "content": "Describe the life of a honeybee."}]
    for follow_up in ("What do they eat?", "And in winter?"):
        reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS)
        if follow_up == "What do they eat?":
            committed = endpoint.log.committed()[-1]["requests"][0].open
            stored = StoredSession(server.settings.store, committed.session_id)
            backup = stored.files()
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
    stored.restore(backup)
    expected = sdk_answer(client, messages)
    before = len(endpoint.log.turns)
    stream = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
    refused, retried = endpoint.log.opens(before)
    assert refused.session_id == committed.session_id and refused.expected_version == committed.expected_version + 2
    assert retried.session_id != committed.session_id and retried.expected_version == 0


def test_a_turn_the_server_aborts_is_a_409_and_keeps_the_session(server, endpoint, client):
    """Another turn holds the pooled session on the server: the request fails with 409 (nothing committed,
    send it again), the session is neither dropped nor deleted, and the next request continues it."""
    api = endpoint.openai()
    messages = [{"role": "user", "content": "Name three kinds of clouds."}]
    reply = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS)
    committed = endpoint.log.committed()[-1]["requests"][0].open
    version = committed.expected_version + 1
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Which one brings rain?"}]
    discarded = endpoint.pool.stats.num_discarded
    requests: queue.Queue = queue.Queue()
    holder = client.stub.Turn(iter(requests.get, None))
    requests.put(pb.TurnRequest(open=pb.OpenTurn(
        session_id=committed.session_id, session_key=committed.session_key, expected_version=version,
        bundle_fingerprint=client.bundle.server_fingerprint, turn_id=os.urandom(16), reserve_tokens=1)))
    try:
        assert next(holder).WhichOneof("kind") == "opened"
        status, body = post(f"{endpoint.url}/chat/completions",
                            json.dumps({"model": MODEL, "messages": messages, "max_tokens": TOKENS}).encode())
    finally:
        requests.put(None)
        holder.cancel()
    assert status == 409 and error_of(body)["code"] == "aborted" and "sent again" in error_of(body)["message"]
    assert endpoint.pool.stats.num_discarded == discarded
    assert StoredSession(server.settings.store, committed.session_id).exists()
    before = len(endpoint.log.turns)
    again = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=TOKENS)
    assert again.choices[0].message.content == sdk_answer(client, messages).text
    (opened,) = endpoint.log.opens(before)
    assert opened.session_id == committed.session_id and opened.expected_version == version
    prefill = next(r.step for r in endpoint.log.turns[before]["requests"] if r.WhichOneof("kind") == "step")
    assert prefill.cache_length > 0  # the conversation so far is not sent again


def test_a_stream_cut_off_after_the_window_slid_leaves_the_session_sound(bundles, tmp_path):
    """A streamed answer runs past a small window (pages evicted mid-turn) and its client leaves: nothing is
    committed, and the next request, on another topic, continues the pooled session at its committed version
    (it shares the default system prompt) without an error, a retry or a resend."""
    srv = start_server(bundles, tmp_path / "store", max_context=96, page_size=16)
    log = TurnLog()
    client = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120, interceptors=[log])
    pool = SessionPool(client, max_sessions=4)
    http = Uvicorn(create_app(pool, MODEL, defaults=SamplingParams(max_new_tokens=TOKENS)))
    try:
        api = openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0)
        story = [{"role": "user", "content": "Tell me a story."}]
        reply = api.chat.completions.create(model=MODEL, messages=story, max_tokens=6)
        committed = log.committed()[-1]["requests"][0].open
        version = committed.expected_version + 1
        stored = StoredSession(srv.settings.store, committed.session_id)
        kept = stored.read_bytes()
        story += [{"role": "assistant", "content": reply.choices[0].message.content},
                  {"role": "user", "content": "Go on, make it a long one."}]
        body = {"model": MODEL, "messages": story, "max_tokens": 300, "stream": True}
        before = len(log.turns)
        connection = http_connection(http.url)
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200

        def evicted() -> bool:
            return any(r.WhichOneof("kind") == "step" and r.step.evict for r in log.turns[before]["requests"])

        while not evicted():
            line = response.readline()
            assert line and b"[DONE]" not in line, "the answer ended before the window slid"
        connection.sock.shutdown(2)
        connection.close()
        deadline = time.monotonic() + 30
        while log.turns[before]["ended"] is None or pool.num_busy:
            assert time.monotonic() < deadline, "the turn went on after the client left"
            time.sleep(0.05)
        assert "commit" not in [r.WhichOneof("kind") for r in log.turns[before]["requests"]]
        assert stored.read_bytes() == kept  # the committed state is untouched
        before = len(log.turns)
        other = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                            max_tokens=4)
        assert other.choices[0].finish_reason in ("stop", "length")
        (opened,) = log.opens(before)  # one turn: no retry on a new session
        assert opened.session_id == committed.session_id and opened.expected_version == version
        prefill = next(r.step for r in log.turns[before]["requests"] if r.WhichOneof("kind") == "step")
        assert prefill.cache_length > 0  # the shared system prompt is not sent again
        assert pool.stats.num_discarded == 0 and stored.exists()
    finally:
        http.stop()
        client.close()
        srv.stop(0)


def http_connection(url: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", int(url.split(":")[2].split("/")[0]), timeout=60)
