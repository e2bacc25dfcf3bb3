"""A turn's gRPC stream (docs/design.md §4: one bidirectional Turn RPC per turn), and opening it with retries.

Opening a turn is retried while the server answers RESOURCE_EXHAUSTED with a
`retry-after-ms` hint, within the client's timeout: nothing has been sent
then but the request to open. Once a turn has started, nothing is retried.
A fork, which takes a turn slot as a turn does, is retried by the same rule
(`retry_at_limits`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from infemeral.client.keepalive import KeepAlive
from infemeral.errors import ResourceExhausted, StatusError, from_rpc_error
from infemeral.protocol import pb

log = logging.getLogger(__name__)
RETRY_AFTER_KEY = "retry-after-ms"  # the server's hint on RESOURCE_EXHAUSTED (infemeral.server.turn_call)
MIN_RETRY_WAIT = 0.05  # seconds
T = TypeVar("T")


class TurnStream:
    """One bidirectional Turn RPC: send requests, read responses in order.

    Requests may be sent ahead of the replies (a truncation and the next step travel together);
    the server answers each in order. While the client is busy between messages (a slow laptop), keep-alives
    stop the server's turn-idle deadline from firing."""

    def __init__(self, client):
        self._requests: queue.Queue = queue.Queue()
        self._keepalive = KeepAlive(self._requests.put, client.server_info().turn_idle_seconds)
        self._responses = client.stub.Turn(iter(self._requests.get, None), timeout=client.timeout)
        self._reading = threading.Lock()  # one reader at a time: gRPC refuses two at once on one call

    def send(self, request: pb.TurnRequest) -> None:
        self._keepalive.sent()
        self._requests.put(request)

    def receive(self, expect: str):
        try:
            with self._reading:
                response = next(self._responses)
        except grpc.RpcError as e:
            raise status_error(e) from None
        except StopIteration:
            raise StatusError("server ended the turn unexpectedly") from None
        kind = response.WhichOneof("kind")
        if kind != expect:
            raise StatusError(f"protocol error: expected {expect}, got {kind}")
        return getattr(response, kind)

    def call(self, request: pb.TurnRequest, expect: str):
        self.send(request)
        return self.receive(expect)

    def close(self) -> None:
        """End the stream. Half-close first and wait for the server to finish the call, so that the
        session is released on the server before the next turn opens; then make sure it is over."""
        self._keepalive.stop()
        self._requests.put(None)
        try:
            while True:
                with self._reading:  # a `ReplyReader` may still be reading replies to steps sent before
                    next(self._responses)
        except (StopIteration, grpc.RpcError):
            pass
        self._responses.cancel()


class ReplyReader:
    """A stream's replies read on a thread as they come, each with the time it came: a caller that sends several
    requests without waiting (a prompt's steps) takes each answer, and learns when it came, while it sends on.

    Each `expect_one` reads one more reply; `stop` ends the thread once it has read what it was asked to. A
    failed read ends it too: `get` raises that error, in order after the replies before it."""

    def __init__(self, stream: TurnStream, expect: str):
        self._stream, self._expect = stream, expect
        self._wanted: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="infemeral-replies", daemon=True).start()

    def expect_one(self) -> None:
        self._wanted.put(True)

    def stop(self) -> None:
        self._wanted.put(False)

    def get(self, block: bool = True):
        """The next (reply, when it came: perf_counter seconds), waiting for it if `block`; else None if it has not
        come yet."""
        try:
            reply, arrived, error = self._replies.get(block=block)
        except queue.Empty:
            return None
        if error is not None:
            raise error
        return reply, arrived

    def _run(self) -> None:
        while self._wanted.get():
            try:
                reply = self._stream.receive(self._expect)
            except BaseException as e:  # handed to the caller, whose turn it ends
                self._replies.put((None, time.perf_counter(), e))
                return
            self._replies.put((reply, time.perf_counter(), None))


def status_error(e: grpc.RpcError) -> StatusError:
    """The StatusError of a failed call. RESOURCE_EXHAUSTED carries the server's `retry-after-ms` hint as
    `retry_after` in seconds, or None where the server gave none (a limit that waiting will not lift)."""
    error = from_rpc_error(e)
    if isinstance(error, ResourceExhausted):
        error.retry_after = None
        metadata = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
        for key, value in metadata or ():
            if key == RETRY_AFTER_KEY:
                try:
                    error.retry_after = max(int(value), 0) / 1000
                except ValueError:
                    pass
    return error


def retry_at_limits(attempt: Callable[[float], T], timeout: float, what: str) -> T:
    """What `attempt(seconds_left)` returns, asking again while the server is at a limit (RESOURCE_EXHAUSTED with a
    retry hint, `status_error`): wait as it says and try again, until `timeout` seconds from now would pass, then
    raise the refusal. Only for a call the server refuses before it does anything (opening a turn, a fork), so that
    trying again repeats nothing; `what` names it in the log."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt(deadline - time.monotonic())
        except ResourceExhausted as e:
            if e.retry_after is None:
                raise
            wait = max(e.retry_after, MIN_RETRY_WAIT)
            if time.monotonic() + wait > deadline:
                raise
            log.info("server is at a limit; %s again in %.2f s", what, wait)
            time.sleep(wait)


def open_turn(client, request: pb.OpenTurn) -> tuple[TurnStream, pb.Opened]:
    """Open a Turn stream: the stream and the server's `opened` reply, asked again while the server is at a limit
    (`retry_at_limits`) within the client's timeout: the open is all that was sent."""

    def attempt(_seconds_left: float) -> tuple[TurnStream, pb.Opened]:
        stream = TurnStream(client)
        try:
            return stream, stream.call(pb.TurnRequest(open=request), "opened")
        except BaseException:
            stream.close()
            raise

    return retry_at_limits(attempt, client.timeout, "opening the turn")
