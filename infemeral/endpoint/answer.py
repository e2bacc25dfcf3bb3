"""One request's turn: a session leased from the pool, and its answer's text as it is sampled.

The SDK is synchronous, so each request's turn runs in a worker thread. A
client that goes away mid-stream stops its turn (nothing is committed; the
session stays usable): however a streamed response ends, `AnswerStream` gives
the session back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

import anyio
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from infemeral.endpoint.session_pool import SessionPool
from infemeral.endpoint.wire_meter import WireBytes, counting
from infemeral.errors import Aborted, DataLoss, NotFound, StatusError

log = logging.getLogger(__name__)

# How the server refuses a session whose stored version is not the one the client holds (kvcache/persistence.py):
# it moved on, or an older copy was restored. The pooled copy can never continue that state again.
OUT_OF_DATE = "but the client expects version"


def session_is_gone(e: Exception) -> bool:
    """Whether a turn failed because the session's stored state is gone (expired, deleted: NOT_FOUND), damaged
    (DATA_LOSS) or out of date (the server holds another version). Only then is a pooled session dropped and
    the request started over on a new one. Any other refusal (ABORTED for a session still in a turn, a busy
    lock, a disagreement about the cache) leaves the committed state as it was: the session stays pooled and
    the request fails with 409, since dropping the session would delete a conversation the server still holds."""
    if isinstance(e, (NotFound, DataLoss)):
        return True
    return isinstance(e, Aborted) and OUT_OF_DATE in str(e)


class Answer:
    """One request's turn: a session leased from the pool and its answer's text as it is sampled.

    Blocking (the SDK is synchronous): run its methods in a worker thread, one at a time. `conversation` names
    the saved conversation the request continues (`SessionPool.acquire`, with `resume` to load its session);
    `finished(session)` runs once the turn has committed, before the session goes back to the pool."""

    def __init__(self, pool: SessionPool, prompt_ids: list[int], start: Callable[[object], Iterator[str]], *,
                 conversation: str | None = None, resume: Callable[[], object | None] | None = None,
                 finished: Callable[[object], None] | None = None):
        self.pool, self.prompt_ids, self.start = pool, prompt_ids, start
        self.conversation, self.resume, self.finished = conversation, resume, finished
        self.session = None
        self.wire = WireBytes()  # what this answer's turns sent to the pod and got back
        self._deltas: Iterator[str] | None = None

    def first(self) -> str | None:
        """Open the turn; its first text (None if the answer is empty). A reused session whose stored state
        is gone (`session_is_gone`) is dropped and the request starts over, once, on a new one."""
        for attempt in range(2):
            lease = {"conversation": self.conversation, "resume": None if attempt else self.resume} \
                if self.conversation is not None else {}
            self.session = self.pool.acquire(self.prompt_ids, **lease, fresh=bool(attempt))  # a retry starts afresh
            had_state = bool(self.session.version)
            self._deltas = self.start(self.session)
            try:
                with counting(self.wire):  # the turn's call opens here
                    return self._next()
            except StatusError as e:
                if not session_is_gone(e):
                    raise  # the session keeps its committed state; close() gives it back to the pool
                self.pool.discard(self.session)
                self.session = self._deltas = None
                if attempt or not had_state:
                    raise
                log.info("a pooled session was refused by the server (%s); starting a new one", e.code.name)
        raise AssertionError("unreachable")

    def next(self) -> str | None:
        return self._next()

    def rest(self) -> None:
        while self._next() is not None:
            pass

    def _next(self) -> str | None:
        delta = next(self._deltas, None)
        if delta is None and self.finished is not None:  # the turn has committed
            self.finished(self.session)
            self.finished = None
        return delta

    @property
    def result(self):
        return self.session.last_result

    def close(self) -> None:
        """Stop the turn if it is still running (it rolls back) and give the session back. Idempotent."""
        if self._deltas is not None:
            self._deltas.close()
            self._deltas = None
        if self.session is not None:
            self.pool.release(self.session)
            self.session = None


class AnswerStream(StreamingResponse):
    """Server-sent events of one answer; the turn is stopped and the session given back however the
    response ends (finished, client gone, or never started)."""

    def __init__(self, events: Iterator[str], answer: Answer):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(self.answer.close)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
