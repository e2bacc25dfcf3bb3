"""Faults the tests inject between the SDK and a real server: a Turn stream that breaks, and waiting."""

from __future__ import annotations

import time

import grpc


class LostConnection(grpc.RpcError):
    """What the SDK sees when the connection drops mid-stream."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection lost (simulated)"


class TurnFault(grpc.StreamStreamClientInterceptor):
    """A client interceptor on every Turn stream; subclasses say where the connection drops.

    `on_request` sees each request before it leaves (True: the stream breaks instead of sending it);
    `on_response` sees each reply as it arrives (True: the client never hears it).
    """

    def on_stream(self) -> None:
        """Called as each Turn stream opens."""

    def on_request(self, request) -> bool:
        return False

    def on_response(self, response) -> bool:
        return False

    def intercept_stream_stream(self, continuation, details, request_iterator):
        self.on_stream()

        def requests():
            for request in request_iterator:
                if self.on_request(request):
                    raise LostConnection()
                yield request

        return _FaultyCall(continuation(details, requests()), self)


class _FaultyCall:
    """The Turn call as the SDK uses it (iterate, cancel), with replies that can be lost."""

    def __init__(self, call, fault: TurnFault):
        self._call, self._fault = call, fault

    def __iter__(self):
        return self

    def __next__(self):
        response = next(self._call)
        if self._fault.on_response(response):
            raise LostConnection()
        return response

    def cancel(self):
        return self._call.cancel()


def wait_until(predicate, timeout: float = 15.0) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()
