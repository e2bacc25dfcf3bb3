"""The lifecycle of turns, apart from the engine's batch loop: which sessions are in a turn, and the store.

A turn is claimed (checks and a turn slot, instant: an asyncio front end never
blocks), loaded (store lock, page quota, decryption: run it on a thread),
committed, and closed; a session out of a turn may be deleted. Closing never
fails half-way and never waits: whatever the store or a running step does, the
slot and the session are released, and the pages are wiped (by the engine's
worker, if it is still running a step of the turn). A lock the store could not
release is released again when the store answers; until then its lease runs
out by itself.

With API keys, each turn carries a short hash of its key (`account`): one key
may hold at most `max_sessions_per_key` turn slots and `pages_per_key` KV
pages, so it cannot take the pool, or every slot, from the others. Without API
keys, the account is the client's address, limited to `max_sessions_per_peer` turns.

Everything here runs on the threads of the turns; the engine's worker only
runs steps and the jobs handed to it, and is told when a turn closes.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from infemeral.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from infemeral.kvcache.paged import KVPages, PagedSequence, PagePool, PageShare
from infemeral.kvcache.persistence import SessionPersistence
from infemeral.kvcache.stored import Manifest, SessionKeys
from infemeral.server.config import EngineConfig
from infemeral.server.metrics import NullMetrics
from infemeral.server.turn import Turn
from infemeral.storage.base import SessionLock, Store

log = logging.getLogger(__name__)

SESSION_ID_BYTES = 16
SESSION_KEY_BYTES = 32
BUSY_GRACE_SECONDS = 2.0
SHUTTING_DOWN = "server is shutting down; retry on another replica or later"


class SessionInTurn(Aborted):
    """This server already runs a turn of the session (a reconnecting client may wait briefly for it)."""


def short_id(session_id: bytes) -> str:
    """Enough of a session id to correlate logs, not enough to address the session."""
    return session_id.hex()[:8]


def wipe_pages(turn: Turn) -> None:
    """Wipe a closed turn's pages; never raises (closing, and the worker, go on)."""
    try:
        turn.cache.wipe()
    except Exception as e:  # noqa: BLE001 - whoever wipes goes on
        log.error("wiping a closed turn's pages failed: %s", type(e).__name__)


class Sessions:
    """The open turns by session id, the limits per API key (or address), and the session's life in the store:
    load, commit, delete, and the store locks whose release failed.

    `quota_tokens(length, reserve_tokens)`: the tokens a turn opening at `length` is granted (the scheduler's
    rule). `on_closed(turn)`: called once a turn is closed and its slot released (the engine forgets its pacing)."""

    def __init__(self, fingerprint: str, store: Store, pool: PagePool, kv: KVPages, config: EngineConfig, *,
                 quota_tokens: Callable[[int, int], int], on_closed: Callable[[Turn], None] | None = None,
                 metrics: NullMetrics | None = None):
        self.fingerprint = fingerprint
        self.store = store
        self.pool, self.kv = pool, kv
        self.config = config
        self.metrics = metrics or NullMetrics()
        self.persistence = SessionPersistence(store, fingerprint)
        self._quota_tokens = quota_tokens
        self._on_closed = on_closed
        self._active: dict[bytes, Turn] = {}
        self._active_lock = threading.Condition()
        self._turns_by_account: Counter[str] = Counter()  # open turns per API key (by its hash)
        self._shares: dict[str, PageShare] = {}            # pages held per API key, once it has opened a turn
        self._unreleased: dict[bytes, SessionLock] = {}  # store locks whose release failed, to retry
        self._unreleased_lock = threading.Lock()
        self._is_accepting = True  # new turns are welcome

    # -- what the engine and the tests ask ----------------------------------------------------------
    @property
    def active_turns(self) -> int:
        return len(self._active)

    def is_in_turn(self, session_id: bytes) -> bool:
        """Whether this server holds an open turn of the session."""
        return session_id in self._active

    @property
    def unreleased_locks(self) -> int:
        """Store locks whose release failed and is still to be retried."""
        with self._unreleased_lock:
            return len(self._unreleased)

    def pages_held_by_keys(self) -> dict[str, int]:
        """Per account with a page share: the pages its turns hold now."""
        with self._active_lock:
            return {account: share.held_pages for account, share in self._shares.items()}

    @property
    def is_limited_per_key(self) -> bool:
        return bool(self.config.max_sessions_per_key or self.config.pages_per_key or self.config.max_sessions_per_peer)

    def begin_shutdown(self) -> None:
        """Refuse new turns (UNAVAILABLE); open turns carry on."""
        self._is_accepting = False

    # -- a turn's life ------------------------------------------------------------------------------
    def claim_turn(self, session_id: bytes, session_key: bytes, fingerprint: str, turn_id: bytes = b"",
                   pending_turn_id: bytes = b"", wait: float = 0.0, account: str | None = None) -> Turn:
        """Check an open and take one of the `max_sessions` turn slots for the session. Touches no store and
        never blocks (unless `wait` > 0: how long to wait for this server's running turn of the session).

        `account` names the API key the turn came with (a hash of it), or without keys the client's address;
        it counts against that key's or address's limits when the server has any."""
        if len(session_id) != SESSION_ID_BYTES:
            raise InvalidArgument(f"session_id must be {SESSION_ID_BYTES} bytes, got {len(session_id)}")
        if len(session_key) != SESSION_KEY_BYTES:
            raise InvalidArgument(f"session_key must be {SESSION_KEY_BYTES} bytes, got {len(session_key)}")
        if len(turn_id) not in (0, 16) or len(pending_turn_id) not in (0, 16):
            raise InvalidArgument("turn_id and pending_turn_id must be 16 bytes (or empty)")
        if fingerprint != self.fingerprint:
            raise FailedPrecondition(
                "client bundle was prepared against a different server bundle "
                f"(client expects {fingerprint or 'none'}, server has {self.fingerprint}); "
                "upload the matching server bundle or use the matching client bundle")
        if not self._is_accepting:
            raise Unavailable(SHUTTING_DOWN)
        if not self.is_limited_per_key:
            account = None
        with self._active_lock:
            if session_id in self._active and wait > 0:
                self._active_lock.wait_for(lambda: session_id not in self._active, timeout=wait)
            if session_id in self._active:
                raise SessionInTurn("this session is already in a turn on this server; wait for it to finish "
                                    "(one turn at a time per session)")
            per_account = self.config.max_sessions_per_key or self.config.max_sessions_per_peer
            if account is not None and per_account and self._turns_by_account[account] >= per_account:
                who = "this API key" if self.config.max_sessions_per_key else "your address"
                raise ResourceExhausted(f"{who} has its limit of {per_account} turns open on this server (of "
                                        f"{self.config.max_sessions}); retry in a second", retry_after=1.0)
            if len(self._active) >= self.config.max_sessions:
                raise ResourceExhausted(f"server is serving its limit of {self.config.max_sessions} turns; "
                                        "retry in a second", retry_after=1.0)
            turn = Turn(session_id, SessionKeys.derive(session_id, session_key),
                        PagedSequence(self.pool, self.kv, self._share(account)), turn_id=turn_id, account=account)
            self._active[session_id] = turn
            if account is not None:
                self._turns_by_account[account] += 1
        return turn

    def _share(self, account: str | None) -> PageShare | None:
        """The page share of an API key (under `_active_lock`); None without a limit on pages per key."""
        if account is None or not self.config.pages_per_key:
            return None
        if account not in self._shares:  # one per configured key at most: the interceptor admits no other
            self._shares[account] = PageShare(self.config.pages_per_key)
        return self._shares[account]

    def load_turn(self, turn: Turn, expected_version: int, pending_turn_id: bytes = b"",
                  reserve_tokens: int = 0) -> None:
        """Take the session in the store, grant the turn its page quota and load its committed cache (store
        I/O, a wait of up to `admission_wait` for pages, decryption). On failure the turn is closed.

        `reserve_tokens` is what the client may add in this turn (0: undeclared, `default_reserve_tokens`).
        A turn that has to wait for pages waits in line, and only while fewer than half the turn slots
        already wait (see `PagePool.grant`)."""
        try:
            self._retry_release(turn.session_id)
            turn.lock = self.persistence.lock(turn.session_id)
            manifest = self.persistence.read_committed(turn.session_id, turn.keys, expected_version,
                                                       pending_turn_id)
            length = manifest.length if manifest else 0
            turn.cache.grant(self._quota_tokens(length, reserve_tokens), wait=self.config.admission_wait)
            self.persistence.fill(turn.session_id, turn.keys, manifest, turn.cache)
            turn.manifest, turn.version = manifest, manifest.version if manifest else 0
        except BaseException:
            self.close_turn(turn)
            raise
        log.info("turn opened session=%s version=%d length=%d quota=%d", short_id(turn.session_id), turn.version,
                 turn.cache.length, turn.cache.quota_tokens)

    def commit(self, turn: Turn) -> int:
        """Store what changed and move the session to its next version."""
        turn.require_open()
        written = self.store.bytes_written
        try:
            manifest = self.persistence.commit(turn.session_id, turn.keys, turn.cache, turn.manifest, turn.lock,
                                               turn.turn_id)
        except BaseException:
            turn.fail("its commit failed")
            raise
        turn.cache.commit()
        turn.mark_committed(manifest)
        self.metrics.store_written(self.store.bytes_written - written)
        log.info("turn committed session=%s version=%d length=%d chunks=%d", short_id(turn.session_id),
                 manifest.version, manifest.length, len(manifest.chunks))
        return manifest.version

    def close_turn(self, turn: Turn) -> None:
        """End a turn, committed or not: release the session and its slot, wipe its pages. Never raises and
        never waits; each part is tried whatever happened to the others."""
        was_open, can_wipe = turn.close()
        if not was_open:
            return
        if can_wipe:  # otherwise the worker wipes them once it is done with this turn's step
            wipe_pages(turn)
        if turn.lock is not None:
            self._release(turn.session_id, turn.lock)
        with self._active_lock:
            if self._active.get(turn.session_id) is turn:
                del self._active[turn.session_id]
                if turn.account is not None:
                    self._turns_by_account[turn.account] -= 1
                    if not self._turns_by_account[turn.account]:
                        del self._turns_by_account[turn.account]
                self._active_lock.notify_all()
        if self._on_closed is not None:
            self._on_closed(turn)

    # -- sessions out of a turn ---------------------------------------------------------------------
    def delete_session(self, session_id: bytes, session_key: bytes) -> None:
        if len(session_id) != SESSION_ID_BYTES or len(session_key) != SESSION_KEY_BYTES:
            raise InvalidArgument("session_id must be 16 bytes and session_key 32 bytes")
        with self._active_lock:
            if session_id in self._active:
                raise Aborted("this session is in a turn; delete it when the turn has ended")
        self._retry_release(session_id)
        lock = self.persistence.lock(session_id)
        try:
            self.persistence.delete(session_id, SessionKeys.derive(session_id, session_key))
        finally:
            self._release(session_id, lock)
        log.info("session deleted session=%s", short_id(session_id))

    def fork_session(self, source_id: bytes, source_key: bytes, source_version: int, session_id: bytes,
                     session_key: bytes, fingerprint: str, drop: int = 0, account: str | None = None) -> Manifest:
        """Make the new session `session_id` from the committed `source_id`, less its last `drop` positions,
        without its tokens crossing the wire again (`SessionPersistence.fork`; store I/O and decryption: run it
        on a thread). The new session is claimed as a turn would claim it, so a fork counts against the turn
        slots and the caller's limits like any turn; the source is held by its store lock as a turn holds it,
        and refused while this server runs a turn of it."""
        if len(source_id) != SESSION_ID_BYTES or len(source_key) != SESSION_KEY_BYTES:
            raise InvalidArgument("source_id must be 16 bytes and source_key 32 bytes")
        if source_id == session_id:
            raise InvalidArgument("a fork needs a new session id of its own")
        turn = self.claim_turn(session_id, session_key, fingerprint, account=account)
        try:
            with self._active_lock:
                if source_id in self._active:
                    raise SessionInTurn("the session to fork is in a turn; fork it when the turn has ended")
            self._retry_release(source_id)
            source_lock = self.persistence.lock(source_id)
            try:
                self._retry_release(session_id)
                turn.lock = self.persistence.lock(session_id)
                manifest = self.persistence.fork(source_id, SessionKeys.derive(source_id, source_key),
                                                 source_version, session_id, turn.keys, drop, turn.lock)
            finally:
                self._release(source_id, source_lock)
        finally:
            self.close_turn(turn)
        log.info("session forked source=%s session=%s length=%d", short_id(source_id), short_id(session_id),
                 manifest.length)
        return manifest

    # -- store locks whose release failed -------------------------------------------------------------
    def _release(self, session_id: bytes, lock: SessionLock) -> None:
        """Release a store lock; never raises. If the store is down, the release is retried when it answers
        (its lease on the session runs out by itself meanwhile)."""
        try:
            lock.release()
        except Exception as e:  # noqa: BLE001 - whoever releases goes on
            log.warning("could not release the store's lock on session=%s (%s); it is released again when the "
                        "store answers, or expires", short_id(session_id), type(e).__name__)
            with self._unreleased_lock:
                self._unreleased[session_id] = lock

    def _retry_release(self, session_id: bytes) -> None:
        """Release a lock on the session left over from a turn that closed while the store was down (store
        I/O; raises while the store is still down). The lock is fenced: it is removed only if still ours."""
        with self._unreleased_lock:
            lock = self._unreleased.pop(session_id, None)
        if lock is None:
            return
        try:
            lock.release()
        except BaseException:
            with self._unreleased_lock:
                self._unreleased.setdefault(session_id, lock)
            raise

    def release_leftover_locks(self) -> int:
        """Retry every lock release that failed (maintenance, now and then); how many are still left."""
        with self._unreleased_lock:
            session_ids = list(self._unreleased)
        for session_id in session_ids:
            try:
                self._retry_release(session_id)
            except Exception as e:  # noqa: BLE001 - still down: try again later
                log.debug("leftover lock release failed again: %s", type(e).__name__)
        return len(self._unreleased)
