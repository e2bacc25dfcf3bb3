"""One Turn RPC on the asyncio server: the client's messages become engine calls, under two deadlines.

A stream waiting for its client costs no thread: the call awaits the next
message on the event loop, for at most `turn_idle_seconds` (time the server
spends on a step does not count), and the whole turn lasts at most
`max_turn_seconds`. Past either bound the turn is aborted with
DEADLINE_EXCEEDED and nothing is committed. Steps are awaited as futures of the
engine's batching worker; store I/O and encryption (open, commit, close) run
on the service's turn threads, one job at a time per turn.

However the call ends — commit, error, deadline, the client cancelling or
vanishing — the turn is closed (session lock, turn slot and pages released)
before the client hears the outcome, and a job still running for the turn
(a load, a commit) finishes before the close touches the turn. A turn that
is refused or fails leaves one WARNING line: the short session id and the
status code, never the message (it may quote what the client sent).

The API key a call came with (the interceptor has checked it) counts as the
turn's account, by a keyed hash that never leaves this process: with several
keys, each has limits of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import unquote

import grpc

from infemeral.cloak.bundle import dtype_name
from infemeral.errors import DeadlineExceeded, InvalidArgument, StatusError
from infemeral.protocol import pb
from infemeral.protocol.tensors import EIGHT_BIT, from_proto, to_proto
from infemeral.server.config import ServiceLimits
from infemeral.server.engine import Engine
from infemeral.server.sessions import BUSY_GRACE_SECONDS, SessionInTurn, short_id
from infemeral.server.turn import Turn
from infemeral.storage.open import store_errors
from infemeral.transport import API_KEY_HEADER, is_loopback

log = logging.getLogger(__name__)
STORE_ERRORS = store_errors()
BUSY_POLL_SECONDS = 0.05
RETRY_AFTER_KEY = "retry-after-ms"
READ_AHEAD_BYTES = 8 << 20  # a turn's messages read and waiting while an earlier one is answered (always one)
_ACCOUNT_SALT = os.urandom(16)  # account names mean nothing outside this process, nor across restarts


def api_key_account(context: grpc.aio.ServicerContext) -> str | None:
    """A short keyed hash of the API key the call came with (None: it came with none); for counting what
    each key holds. Never the key itself, and never logged."""
    for name, value in context.invocation_metadata() or ():
        if name == API_KEY_HEADER:
            raw = value.encode() if isinstance(value, str) else bytes(value)
            return hashlib.blake2b(raw, key=_ACCOUNT_SALT, digest_size=8).hexdigest()
    return None


def peer_account(peer: str) -> str | None:
    """The client's address without its port (`ipv4:10.0.0.7`, from gRPC's `context.peer()`), for counting what
    each address holds when the server has no API keys; None for this machine's own clients (loopback, a Unix
    socket), which are the pod's own processes or everyone behind a tunnel or proxy there. Never logged."""
    kind, _, rest = peer.partition(":")
    host = unquote(rest.rpartition(":")[0]).strip("[]")
    if kind not in ("ipv4", "ipv6") or not host or is_loopback(host):
        return None
    return f"{kind}:{host}"


@dataclass(frozen=True)
class TurnCallResources:
    """What a turn call needs from the service that runs it."""

    engine: Engine
    limits: ServiceLimits
    executor: ThreadPoolExecutor  # the turn threads: store I/O and encryption, one job at a time per turn


class TurnCall:
    def __init__(self, resources: TurnCallResources, context: grpc.aio.ServicerContext, account: str | None = None):
        self.engine = resources.engine
        self.limits = resources.limits
        self.executor = resources.executor
        self.context = context
        self.account = account
        self.session_id: bytes | None = None  # once the open message named one
        self.is_opened = False                 # the client was told the turn is open
        self.loop = asyncio.get_running_loop()
        self.deadline = self.loop.time() + self.limits.max_turn_seconds
        self.turn: Turn | None = None
        self.job: concurrent.futures.Future | None = None  # the turn's blocking job, at most one at a time
        self.outcome = "abandoned"

    async def run(self) -> None:
        """Serve the turn; close it; then tell the client how it ended."""
        error: StatusError | None = None
        cause = ""
        try:
            await self._converse()
        except StatusError as e:
            error, self.outcome = e, e.code.name.lower()
        except STORE_ERRORS as e:
            self.outcome, cause = "store_error", f" (store error: {type(e).__name__})"
            self.engine.metrics.store_failed()
            error = StatusError("session store is unavailable; the session is unchanged, retry",
                                grpc.StatusCode.UNAVAILABLE)
        except asyncio.CancelledError:
            self.outcome = "cancelled"  # the client went away (or the server is stopping)
            raise
        finally:
            # before the close: a call cancelled again while it waits for the close would skip the line
            if self.outcome in ("cancelled", "abandoned") and self.is_opened:  # the others log their status below
                log.info("turn %s session=%s: the client ended it without a commit, or the server is stopping; "
                         "nothing committed", self.outcome, short_id(self.session_id))
            if self.turn is not None:
                await self._close()
            self.engine.metrics.turn_ended(self.outcome)
        if error is not None:
            log.log(logging.ERROR if cause else logging.WARNING, "turn %s session=%s status=%s%s",
                    "failed" if self.is_opened else "refused",
                    short_id(self.session_id) if self.session_id else "-", error.code.name, cause)
            await abort(self.context, error)

    # -- the conversation ---------------------------------------------------------------------------
    async def _converse(self) -> None:
        first = await self._receive()
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidArgument("a turn must start with an `open` message")
        o = first.open
        await self._open(o)
        turn = self.turn
        await self._send(pb.TurnResponse(opened=pb.Opened(
            version=turn.version, cache_length=turn.cache.length,
            pending_committed=turn.version == o.expected_version + 1)))
        self.is_opened = True
        inbox = Inbox(READ_AHEAD_BYTES)
        reader = asyncio.create_task(self._read_ahead(inbox))
        try:
            await self._serve_requests(inbox)
        finally:
            reader.cancel()

    async def _serve_requests(self, inbox: Inbox) -> None:
        """Answer the client's messages in the order they came; `inbox` holds those read ahead."""
        turn = self.turn
        while True:
            request = await self._bounded(inbox.get(), idle=True)
            if isinstance(request, BaseException):  # reading failed (the turn's time ran out)
                raise request
            if request is None:  # the client ended the stream without a commit: nothing changes
                return
            kind = request.WhichOneof("kind")
            if kind == "keepalive":
                await self._refresh_lock()
            elif kind == "step":
                await self._send(await self._step(request.step))
            elif kind == "truncate":  # the pages are freed on the engine's worker, between batches
                t = request.truncate
                future = self.engine.submit_truncate(turn, t.tokens, t.cache_length, list(t.keep))
                length = await self._bounded(asyncio.wrap_future(future))
                await self._send(pb.TurnResponse(truncated=pb.Truncated(cache_length=length)))
            elif kind == "commit":
                version, length = await self._blocking(self._commit_and_close, bounded=False)
                self.outcome = "committed"
                await self._send(pb.TurnResponse(committed=pb.Committed(version=version, cache_length=length)))
                return
            else:
                raise InvalidArgument(f"unexpected message {kind!r} inside a turn")

    async def _open(self, o: pb.OpenTurn) -> None:
        # A client that lost its stream may reconnect before this server has closed the old turn: give the
        # old turn a moment to close before refusing (polling, so no thread waits).
        self.session_id = o.session_id
        give_up = self.loop.time() + BUSY_GRACE_SECONDS
        while True:
            try:
                self.turn = self.engine.claim_turn(o.session_id, o.session_key, o.bundle_fingerprint, o.turn_id,
                                                   o.pending_turn_id, account=self.account)
                break
            except SessionInTurn:
                if self.loop.time() >= give_up:
                    raise
                await asyncio.sleep(BUSY_POLL_SECONDS)
        await self._blocking(self.engine.load_turn, self.turn, o.expected_version, o.pending_turn_id,
                             o.reserve_tokens)

    async def _step(self, step: pb.Step) -> pb.TurnResponse:
        started = time.perf_counter()
        answer_dtype = self._answer_dtype(step)
        hidden = from_proto(step.hidden, self.engine.hidden_size, self.engine.max_step_tokens)
        if step.hidden.dtype in EIGHT_BIT:  # decoded to float32: into the layers' dtype, which it is answered in
            hidden = hidden.to(self.engine.dtype)
        await self._refresh_lock()
        future = self.engine.submit_step(self.turn, hidden, step.cache_length, step.outputs, step.evict,
                                         list(step.parents))
        out = await self._bounded(asyncio.wrap_future(future))
        self.engine.metrics.step_answered(time.perf_counter() - started)
        # The engine answers in the dtype of `hidden`, and checked the answer in it; any finite row fits 8 bits.
        wire = answer_dtype if answer_dtype in EIGHT_BIT else None
        return pb.TurnResponse(step=pb.StepResult(hidden=to_proto(out.hidden, wire),
                                                  cache_length=out.cache_length, evicted=out.num_evicted))

    def _answer_dtype(self, step: pb.Step) -> str:
        """The dtype the step is answered in: the one it was sent in, or the server's for an 8-bit upload."""
        if not step.answer_dtype:
            return step.hidden.dtype
        own = dtype_name(self.engine.dtype)  # as ServerInfo.dtype names it
        if step.hidden.dtype not in EIGHT_BIT or step.answer_dtype != own:
            raise InvalidArgument(f"answer_dtype {step.answer_dtype!r}: only a step sent in 8 bits "
                                  f"({' or '.join(EIGHT_BIT)}) may ask for its answer in another dtype, and only "
                                  f"in this server's ({own}); leave it empty to be answered in the dtype sent")
        return step.answer_dtype

    async def _refresh_lock(self) -> None:
        """Keep the session's store lease alive during a long turn (store I/O, so on a turn thread)."""
        if self.turn.is_lock_refresh_due:
            await self._blocking(self.turn.refresh_lock)

    def _commit_and_close(self) -> tuple[int, int]:
        """Commit, then release the session before the client hears "committed" (so its next turn opens)."""
        version = self.engine.commit(self.turn)
        length = self.turn.cache.length
        self.engine.close_turn(self.turn)
        return version, length

    # -- deadlines ----------------------------------------------------------------------------------
    async def _read_ahead(self, inbox: Inbox) -> None:
        """Read the client's messages into `inbox` while the turn answers earlier ones, so that a prompt's next
        steps come in while the layers run this one (and the client's link does not wait on the layers). Ends
        with None at the end of the stream, or with the error reading met, handed on in order."""
        while True:
            try:
                request = await self._bounded(self.context.read())
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                await inbox.put(e)
                return
            if request is grpc.aio.EOF:
                await inbox.put(None)
                return
            await inbox.put(request, request.ByteSize())

    async def _receive(self) -> pb.TurnRequest | None:
        """The client's next message (None once it ended the stream), within both deadlines."""
        request = await self._bounded(self.context.read(), idle=True)
        return None if request is grpc.aio.EOF else request

    async def _send(self, response: pb.TurnResponse) -> None:
        await self._bounded(self.context.write(response), idle=True)  # a client that stops reading is idle too

    async def _bounded(self, awaitable, idle: bool = False):
        """Await within what is left of the turn (and, waiting on the client, within the idle bound)."""
        left = self.deadline - self.loop.time()
        timeout = max(0.0, min(left, self.limits.turn_idle_seconds) if idle else left)
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                return await awaitable
        except TimeoutError:
            if not scope.expired():  # a timeout of the work itself (a store socket), not a deadline
                raise
            if idle and timeout < left:
                raise DeadlineExceeded(
                    f"the client sent nothing for {self.limits.turn_idle_seconds:g} s; the turn was aborted and "
                    "nothing was committed — reopen the session and retry (clients that compute longer between "
                    "messages send KeepAlive)") from None
            raise DeadlineExceeded(
                f"the turn was open longer than this server's limit of {self.limits.max_turn_seconds:g} s; it was "
                "aborted and nothing was committed — reopen the session and continue in a new turn") from None

    # -- blocking work and closing -------------------------------------------------------------------
    async def _blocking(self, fn, *args, bounded: bool = True):
        """Run store I/O or encryption for this turn on a turn thread. A turn waits for no one else's
        thread: the pool has one per turn slot."""
        self.job = self.executor.submit(fn, *args)
        if bounded:
            return await self._bounded(asyncio.wrap_future(self.job))
        return await asyncio.shield(asyncio.wrap_future(self.job))  # a commit that started finishes

    async def _close(self) -> None:
        """Close the turn once its running job (if any) is done; if this call is cancelled meanwhile, the
        close still happens."""
        job, turn, engine = self.job, self.turn, self.engine

        def close() -> None:
            if job is not None:
                concurrent.futures.wait([job])  # a job of this call that never started was cancelled with it
            engine.close_turn(turn)

        await asyncio.shield(asyncio.wrap_future(self.executor.submit(close)))


class Inbox:
    """A turn's messages read ahead, in order: up to `max_bytes` of them wait (always at least one)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: deque = deque()
        self._bytes = 0
        self._changed = asyncio.Condition()

    async def put(self, item, size: int = 0) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._items or self._bytes + size <= self.max_bytes)
            self._items.append((item, size))
            self._bytes += size
            self._changed.notify_all()

    async def get(self):
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._items))
            item, size = self._items.popleft()
            self._bytes -= size
            self._changed.notify_all()
            return item


async def abort(context: grpc.aio.ServicerContext, error: StatusError) -> None:
    """End the call with the error's status, and a retry hint where it has one."""
    retry_after = getattr(error, "retry_after", None)
    if retry_after:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, str(int(retry_after * 1000))),))
    await context.abort(error.code, error.message)
