"""Keep a turn open while the client is busy between messages.

The server aborts a turn whose client sends nothing for `turn_idle_seconds`
(announced in ServerInfo), so that a vanished or stalled client cannot hold a
session and its KV pages. A client can be busy that long for good reasons: a
slow laptop running its layers over a long prompt chunk, or a caller that
pauses between the streamed pieces of an answer. While a turn's stream is
open, `KeepAlive` sends an empty `KeepAlive` message whenever nothing else
went out for a third of that bound; the server does not answer it. A client
process that dies stops sending, so the server still frees its turn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from infemeral.protocol import pb

MESSAGE = pb.TurnRequest(keepalive=pb.KeepAlive())


class KeepAlive:
    def __init__(self, send: Callable[[pb.TurnRequest], None], idle_seconds: float):
        """`send` queues a request on the stream; `idle_seconds` is the server's bound (0: none, send nothing)."""
        self._send = send
        self.interval = idle_seconds / 3
        self._last_sent = time.monotonic()
        self._lock = threading.Lock()
        self._is_stopped = threading.Event()
        if idle_seconds > 0:
            threading.Thread(target=self._run, name="infemeral-keepalive", daemon=True).start()

    def sent(self) -> None:
        """The client just sent a message of its own."""
        self._last_sent = time.monotonic()

    def stop(self) -> None:
        """No more keep-alives (before the stream is half-closed)."""
        with self._lock:
            self._is_stopped.set()

    def _run(self) -> None:
        while not self._is_stopped.wait(self.interval / 4):
            if time.monotonic() - self._last_sent < self.interval:
                continue
            with self._lock:
                if self._is_stopped.is_set():
                    return
                self._send(MESSAGE)
                self._last_sent = time.monotonic()
