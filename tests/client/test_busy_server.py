"""A server at its limits: the SDK opens a turn again as the server's `retry-after-ms` hint says, within
its timeout, and never retries a turn that has started."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tests.conftest import start_server
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.errors import ResourceExhausted

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_new_tokens=6, speculate="off")


class Exhausted(grpc.RpcError):
    """RESOURCE_EXHAUSTED as the server sends it, with or without a retry hint."""

    def __init__(self, retry_after_ms: int | None):
        self.retry_after_ms = retry_after_ms

    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "server is at a limit (simulated)"

    def trailing_metadata(self):
        return (("retry-after-ms", str(self.retry_after_ms)),) if self.retry_after_ms is not None else ()


class Refuse(grpc.StreamStreamClientInterceptor):
    """Answers the `refusals` first replies of the given kind with RESOURCE_EXHAUSTED instead; counts streams."""

    def __init__(self, kind: str, refusals: int, retry_after_ms: int | None = 10):
        self.kind, self.refusals, self.retry_after_ms = kind, refusals, retry_after_ms
        self.streams = 0

    def intercept_stream_stream(self, continuation, details, request_iterator):
        self.streams += 1
        call, fault = continuation(details, request_iterator), self

        class Call:
            def __iter__(self):
                return self

            def __next__(self):
                response = next(call)
                if response.WhichOneof("kind") == fault.kind and fault.refusals > 0:
                    fault.refusals -= 1
                    call.cancel()
                    raise Exhausted(fault.retry_after_ms)
                return response

            def cancel(self):
                return call.cancel()

        return Call()


def client_with(server, bundles, fault, timeout: float = 120) -> Client:
    return Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=timeout, interceptors=[fault])


def test_opening_is_retried_as_the_hint_says(server, bundles):
    fault = Refuse("opened", refusals=3)
    with client_with(server, bundles, fault) as client:
        session = client.new_session()
        assert session.chat("Name a river.", PARAMS).generated_tokens == 6
    assert fault.streams == 4 and session.version == 1


def test_a_refusal_without_a_hint_is_final(server, bundles):
    fault = Refuse("opened", refusals=1, retry_after_ms=None)
    with client_with(server, bundles, fault) as client:
        session = client.new_session()
        with pytest.raises(ResourceExhausted):
            session.chat("Name a river.", PARAMS)
        assert fault.streams == 1 and session.version == 0
        assert session.chat("Name a river.", PARAMS).version == 1


def test_a_turn_that_has_started_is_never_retried(server, bundles):
    fault = Refuse("step", refusals=1)
    with client_with(server, bundles, fault) as client:
        session = client.new_session()
        with pytest.raises(ResourceExhausted):
            session.chat("Name a river.", PARAMS)
        assert fault.streams == 1 and session.version == 0 and session.cache.length == 0
        assert session.chat("Name a river.", PARAMS).version == 1


def test_a_turn_waits_for_the_only_slot_within_its_timeout(bundles, tmp_path):
    """A server that serves one turn at a time: a second turn opens once the first ends, and a client
    whose timeout passes first gets the refusal."""
    srv = start_server(bundles, tmp_path / "store", max_sessions=1)
    address = f"127.0.0.1:{srv.port}"
    clients = [Client(address, bundles.client_dir, timeout=timeout) for timeout in (120, 120, 1.5)]
    try:
        holder = clients[0].new_session()
        answer = holder.stream("Name a river.", SamplingParams(max_new_tokens=8, speculate="off"))
        next(answer)  # the turn is open, mid-answer: it holds the only slot
        outcome = {}

        def wait(i: int) -> None:
            started = time.monotonic()
            try:
                outcome[i] = clients[i].new_session().chat("Name a colour.", PARAMS)
            except BaseException as e:  # checked below
                outcome[i] = e
            outcome[i, "seconds"] = time.monotonic() - started

        waiters = [threading.Thread(target=wait, args=(i,)) for i in (1, 2)]
        for t in waiters:
            t.start()
        time.sleep(3)
        "".join(answer)  # the first turn ends and frees the slot
        for t in waiters:
            t.join(120)
        assert holder.version == 1
        assert outcome[1].generated_tokens == 6 and outcome[1, "seconds"] >= 2.5
        assert isinstance(outcome[2], ResourceExhausted) and outcome[2, "seconds"] < 3
    finally:
        for c in clients:
            c.close()
        srv.stop(0)
