"""Logs carry sizes and timings only: no keys, no full session ids, no payloads.

A refused or failed turn (a wrong session key, invalid input, a client gone
quiet) leaves exactly one WARNING line: the short session id and the status
code name, never the message (which can quote what the client sent).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import sys

import grpc
import pytest
import torch
from tests.conftest import start_server

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import to_proto

pytestmark = pytest.mark.slow

API_KEY = "api-key-7f3e91c2d8"
MARKER = "payload-5b1d7a"  # text a client puts where a message could echo it


def test_turn_logs_contain_no_secrets(client, caplog):
    caplog.set_level(logging.DEBUG)
    session = client.new_session()
    result = session.chat("My password is hunter2-swordfish.", SamplingParams(max_new_tokens=8))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "turn committed" in text  # the server did log the turn
    for secret in (session.key.hex(), session.id.hex(), "hunter2", result.text.strip()[:12]):
        assert secret and secret not in text
    assert session.key.hex() not in repr(session)


@pytest.fixture(scope="module")
def quick_pod(bundles, tmp_path_factory):
    """An API key, and a turn that goes quiet is aborted after a second."""
    srv = start_server(bundles, tmp_path_factory.mktemp("logging-store"), api_keys=API_KEY, turn_idle_seconds=1.0,
                       verify_bundle=False)
    c = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120, api_key=API_KEY)
    yield srv, c
    c.close()
    srv.stop(0)


def call(stub, requests: list[pb.TurnRequest], close: bool = True) -> grpc.RpcError:
    """Send `requests` on one Turn stream (and end it, unless told to keep it open); the error it ends with."""
    pending: queue.Queue = queue.Queue()
    for request in requests:
        pending.put(request)
    if close:
        pending.put(None)
    responses = stub.Turn(iter(pending.get, None), timeout=60)
    with pytest.raises(grpc.RpcError) as info:
        for _ in responses:
            pass
    pending.put(None)
    return info.value


def test_refused_and_failed_turns_leave_one_warning_each(quick_pod, caplog):
    """(Old code: none of these left any line.)"""
    srv, c = quick_pod
    session = c.new_session()
    session.chat("Hello there.", SamplingParams(max_new_tokens=2))
    stub = pb_grpc.InfemeralStub(c.channel)
    fp, hidden = c.bundle.server_fingerprint, c.model.hidden_size

    def open_turn(**over) -> pb.TurnRequest:
        fields = dict(session_id=session.id, session_key=session.key, expected_version=1, bundle_fingerprint=fp)
        return pb.TurnRequest(open=pb.OpenTurn(**{**fields, **over}))

    nan = torch.full((1, hidden), float("nan"))
    cases = {  # what a client does: (its requests, whether it then goes quiet, the status, "refused" or "failed")
        "hijack": ([open_turn(session_key=os.urandom(32))], False, "PERMISSION_DENIED", "refused"),
        "another bundle": ([open_turn(bundle_fingerprint=MARKER)], False, "FAILED_PRECONDITION", "refused"),
        "invalid input": ([open_turn(), pb.TurnRequest(step=pb.Step(hidden=to_proto(nan),
                                                                    cache_length=session.cache.length))],
                          False, "INVALID_ARGUMENT", "failed"),
        "gone quiet": ([open_turn()], True, "DEADLINE_EXCEEDED", "failed"),
    }
    short = session.id.hex()[:8]
    caplog.set_level(logging.DEBUG)
    for name, (requests, quiet, status, verb) in cases.items():
        caplog.clear()
        err = call(stub, requests, close=not quiet)
        assert err.code().name == status, (name, err.details())
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert warnings == [f"turn {verb} session={short} status={status}"], (name, warnings)
        text = "\n".join(r.getMessage() for r in caplog.records)
        for secret in (API_KEY, session.key.hex(), session.id.hex(), MARKER):
            assert secret not in text, (name, secret)
    caplog.clear()
    with pytest.raises(grpc.RpcError) as info:
        stub.DeleteSession(pb.DeleteSessionRequest(session_id=session.id, session_key=os.urandom(32)), timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"delete refused session={short} status=PERMISSION_DENIED"]
    assert session.chat("Still here?", SamplingParams(max_new_tokens=2)).version == 2


def test_a_call_with_a_wrong_api_key_leaves_one_warning_without_the_key(quick_pod, caplog):
    srv, c = quick_pod
    wrong = "wrong-key-" + MARKER
    stranger = Client(f"127.0.0.1:{srv.port}", c.bundle.directory, timeout=30, api_key=wrong)
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.InfemeralStub(stranger.channel).GetServerInfo(pb.ServerInfoRequest(), timeout=30)
    finally:
        stranger.close()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["call refused method=GetServerInfo status=UNAUTHENTICATED"]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert wrong not in text and API_KEY not in text


def test_the_log_handler_follows_stderr_when_it_is_swapped(monkeypatch):
    """A process that swaps stderr (tests capturing it, a host embedding the command line) after logging was set
    up must not log into the old, possibly closed, stream."""
    import io
    import logging

    from infemeral.logs import StderrHandler

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler = StderrHandler()
    record = logging.LogRecord("infemeral.test", logging.WARNING, __file__, 1, "written where stderr is now", None,
                               None)
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    handler.emit(record)
    assert "written where stderr is now" in second.getvalue()


def test_a_cancelled_turn_leaves_one_line(quick_pod, caplog):
    """(Old code: a turn the client cancelled left no line at all.)"""
    import time

    srv, c = quick_pod
    session = c.new_session()
    session.chat("Hello there.", SamplingParams(max_new_tokens=2))
    stub = pb_grpc.InfemeralStub(c.channel)
    caplog.set_level(logging.INFO)
    pending: queue.Queue = queue.Queue()
    pending.put(pb.TurnRequest(open=pb.OpenTurn(session_id=session.id, session_key=session.key, expected_version=1,
                                                bundle_fingerprint=c.bundle.server_fingerprint)))
    responses = stub.Turn(iter(pending.get, None), timeout=60)
    assert next(responses).WhichOneof("kind") == "opened"
    responses.cancel()
    pending.put(None)
    deadline = time.monotonic() + 10
    while not [r for r in caplog.records if "without a commit" in r.getMessage()] and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [r.getMessage() for r in caplog.records if "without a commit" in r.getMessage()]
    # gRPC hands the server a cancelled stream either as a cancellation or as the stream's end
    assert len(lines) == 1 and re.fullmatch(
        f"turn (cancelled|abandoned) session={session.id.hex()[:8]}: the client ended it without a commit, or the "
        "server is stopping; nothing committed", lines[0]), [r.getMessage() for r in caplog.records]
    assert session.chat("Still here?", SamplingParams(max_new_tokens=2)).version == 2
