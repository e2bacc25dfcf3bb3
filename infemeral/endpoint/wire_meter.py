"""What one answer's turns put on the wire to the pod and got back, in bytes, for the chat page's figures.

A gRPC interceptor on the endpoint's Client counts every Turn call's messages
(their serialized size, framing left out). A turn's call is opened in the thread that runs the answer, so the answer marks
itself as the one being counted (`counting`) and the interceptor charges that
call, whichever threads then move its messages, to it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

_counted: contextvars.ContextVar[WireBytes | None] = contextvars.ContextVar("infemeral_wire_bytes", default=None)


@dataclass
class WireBytes:
    """Bytes of Turn messages sent to the pod and received from it."""

    sent: int = 0
    received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received


@contextmanager
def counting(meter: WireBytes) -> Iterator[None]:
    """Charge the Turn calls opened in this block (in this thread) to `meter`."""
    token = _counted.set(meter)
    try:
        yield
    finally:
        _counted.reset(token)


class WireMeter(grpc.StreamStreamClientInterceptor):
    """Counts the messages of each Turn call opened inside `counting`; other calls pass untouched."""

    def intercept_stream_stream(self, continuation, details, request_iterator):
        meter = _counted.get()
        if meter is None:
            return continuation(details, request_iterator)

        def sent():
            for request in request_iterator:
                meter.add(sent=request.ByteSize())
                yield request

        return _CountedResponses(continuation(details, sent()), meter)


class _CountedResponses:
    """A call's responses, each counted as it is read; the rest of the call (cancel, code) as it was."""

    def __init__(self, call, meter: WireBytes):
        self._call, self._meter = call, meter

    def __iter__(self):
        return self

    def __next__(self):
        response = next(self._call)
        self._meter.add(received=response.ByteSize())
        return response

    def __getattr__(self, name):
        return getattr(self._call, name)
