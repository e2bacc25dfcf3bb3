"""The gRPC face of the engine, on grpc's asyncio server: one bidirectional stream per turn.

Handlers translate messages to engine calls and StatusErrors to gRPC statuses.
A stream that ends, is cancelled or fails before its commit message leaves the
stored session exactly as it was: the engine only writes on commit.

Nothing here waits on a thread for a client: an open stream is a coroutine,
so silent streams cost no worker, and server info (answered on the event loop)
and deletes (on their own threads) answer whatever the turns do; a fork runs on a turn thread
and holds a turn slot, as the new session's first turn would. Limits answer
at once: past `max_streams` open Turn streams, or `max_sessions` open turns, a
new one gets RESOURCE_EXHAUSTED with a `retry-after-ms` hint, never a queue;
with several API keys, likewise past one key's share of either; without API keys,
past one client address's share.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc

from infemeral import __version__
from infemeral.cloak.bundle import dtype_name
from infemeral.errors import ResourceExhausted, StatusError
from infemeral.protocol import PROTOCOL_VERSION, pb, pb_grpc
from infemeral.server.config import ServiceLimits
from infemeral.server.engine import Engine
from infemeral.server.sessions import short_id
from infemeral.server.turn_call import STORE_ERRORS, TurnCall, TurnCallResources, abort, api_key_account, peer_account

log = logging.getLogger(__name__)


class InfemeralService(pb_grpc.InfemeralServicer):
    def __init__(self, engine: Engine, limits: ServiceLimits, max_message_bytes: int, *, bundle_verified: bool = True):
        self.engine = engine
        self.limits = limits
        self.max_message_bytes = max_message_bytes
        self.bundle_verified = bundle_verified  # its files' hashes were checked at start-up; clients are told if not
        # One thread per turn slot (and a few for closes that follow a running job): a turn's store I/O never
        # waits for another turn's. Deletes have their own threads.
        self.turn_executor = ThreadPoolExecutor(engine.config.max_sessions + 4, thread_name_prefix="infemeral-turn")
        self.delete_executor = ThreadPoolExecutor(limits.delete_threads, thread_name_prefix="infemeral-delete")
        self.turn_resources = TurnCallResources(engine, limits, self.turn_executor)
        self._calls: set[asyncio.Task] = set()
        self._streams_by_account: Counter[str] = Counter()  # per API key or client address; on the event loop only

    @property
    def num_streams(self) -> int:
        return len(self._calls)

    async def Turn(self, request_iterator, context):
        account = api_key_account(context)
        per_account, who = self.limits.max_streams_per_key, "this API key"
        if account is None:  # a server without API keys: clients told apart by address
            account = peer_account(context.peer())
            per_account, who = self.limits.max_streams_per_peer, "your address"
        if self.num_streams >= self.limits.max_streams:
            await self._refuse(context, f"server has its limit of {self.limits.max_streams} turn streams open")
        if per_account and account is not None and self._streams_by_account[account] >= per_account:
            await self._refuse(context, f"{who} has its limit of {per_account} turn streams open on this server "
                                        f"(of {self.limits.max_streams})")
        task = asyncio.current_task()
        self._calls.add(task)
        if account is not None:
            self._streams_by_account[account] += 1
        try:
            await TurnCall(self.turn_resources, context, account).run()
        finally:
            self._calls.discard(task)
            if account is not None:
                self._streams_by_account[account] -= 1
                if not self._streams_by_account[account]:
                    del self._streams_by_account[account]

    async def _refuse(self, context, limit: str) -> None:
        self.engine.metrics.turn_ended("resource_exhausted")
        log.warning("turn refused session=- status=RESOURCE_EXHAUSTED")
        await abort(context, ResourceExhausted(f"{limit}; retry in a second", retry_after=1.0))

    async def GetServerInfo(self, request, context):
        e = self.engine
        return pb.ServerInfo(
            bundle_fingerprint=e.bundle.fingerprint, model_type=e.bundle.config.model_type,
            hidden_size=e.hidden_size, first_layer=e.bundle.first_layer, num_layers=e.bundle.num_layers,
            total_layers=e.bundle.config.num_hidden_layers, dtype=dtype_name(e.dtype), device=str(e.device),
            max_step_tokens=e.max_step_tokens, max_context=e.window.max_context, window=e.window.enabled,
            sink_tokens=e.window.sink_tokens, page_size=e.window.page_size,
            max_message_bytes=self.max_message_bytes, server_version=__version__,
            protocol_version=PROTOCOL_VERSION, turn_idle_seconds=self.limits.turn_idle_seconds,
            max_turn_seconds=self.limits.max_turn_seconds, bundle_unverified=not self.bundle_verified,
            draft_trees=e.draft_trees)

    async def DeleteSession(self, request, context):
        job = self.delete_executor.submit(self.engine.delete_session, request.session_id, request.session_key)
        await self._settle(job, context, "delete", "session", request.session_id)
        return pb.DeleteSessionResponse()

    async def ForkSession(self, request, context):
        account = api_key_account(context)
        if account is None:
            account = peer_account(context.peer())
        job = self.turn_executor.submit(
            self.engine.fork_session, request.source_id, request.source_key, request.source_version,
            request.session_id, request.session_key, request.bundle_fingerprint, request.drop, account)
        manifest = await self._settle(job, context, "fork", "source", request.source_id)
        return pb.ForkSessionResponse(version=manifest.version, cache_length=manifest.length)

    @staticmethod
    async def _settle(job, context, call: str, what: str, session_id: str):
        """The result of a call run on an executor, or the call aborted with the status its failure maps to:
        a refusal's own status, UNAVAILABLE for a store that failed (the client may retry). Logs name the
        session by its short id, never its key."""
        sid = short_id(session_id) if session_id else "-"
        try:
            return await asyncio.wrap_future(job)
        except StatusError as e:
            log.warning("%s refused %s=%s status=%s", call, what, sid, e.code.name)
            await abort(context, e)
        except STORE_ERRORS as e:
            log.error("%s failed %s=%s status=UNAVAILABLE (store error: %s)", call, what, sid, type(e).__name__)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "session store is unavailable; retry")

    async def finish(self, timeout: float = 10.0) -> None:
        """Wait for the calls the server cancelled while stopping to close their turns."""
        if self._calls:
            await asyncio.wait(set(self._calls), timeout=timeout)

    def close(self) -> None:
        """After `finish`: let the threads finish what they run (closes included), then end them."""
        self.turn_executor.shutdown(wait=True, cancel_futures=False)
        self.delete_executor.shutdown(wait=True, cancel_futures=True)
