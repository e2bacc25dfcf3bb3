"""One turn on the server, like nano-vllm's `Sequence`: its state, a status, and the checks on it.

A turn is opened by a client's `open` message and ends when its stream ends.
In between it holds the session's cross-replica lock and its plaintext KV in
the page pool, and moves through these states:

    OPEN ──step──▶ STEPPING ──answered──▶ OPEN ──commit──▶ COMMITTED ──▶ CLOSED
                      └──────failed──────▶ FAILED ───────────────────────▶ CLOSED

A truncation is with the worker the same way a step is (STEPPING). A turn
that failed half-way (its cache and the client's no longer agree) only
accepts being closed. Closing never waits: a turn closed while one of its steps
is with the engine's worker (the client vanished, a deadline passed) is CLOSED
at once — its session and slot are released — and the worker, which may be
writing into the turn's pages, wipes them when it is done with the step.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field

from infemeral.errors import Aborted, FailedPrecondition, InvalidArgument
from infemeral.kvcache.paged import PagedSequence
from infemeral.kvcache.stored import Manifest, SessionKeys
from infemeral.storage.base import SessionLock

LOCK_REFRESH_SECONDS = 10.0


class TurnStatus(enum.Enum):
    OPEN = "open"            # waiting for the client's next message
    STEPPING = "stepping"    # one step (or truncation) is with the engine's worker
    COMMITTED = "committed"  # the commit landed; only closing is left
    FAILED = "failed"        # a step or the commit failed; only closing is left
    CLOSED = "closed"        # session released; pages wiped (by the worker if a step was running)


@dataclass(eq=False)
class Turn:
    session_id: bytes
    keys: SessionKeys
    cache: PagedSequence
    turn_id: bytes = b""
    account: str | None = None       # hash of the API key it came with, where keys are limited
    version: int = 0                 # the committed version this turn started from (or committed)
    manifest: Manifest | None = None  # the committed state the cache was loaded from (or committed to)
    lock: SessionLock | None = None   # the store's cross-replica hold on the session
    status: TurnStatus = TurnStatus.OPEN
    failure: str = ""                 # why the turn failed, for the next message's refusal
    is_close_requested: bool = False  # closing: a step not yet started must not start
    is_step_orphaned: bool = False    # closed while a step was with the worker: the worker wipes the pages
    refreshed_at: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- checks on what the client sends ------------------------------------------------------------
    def require_open(self) -> None:
        if self.status is TurnStatus.FAILED:
            raise Aborted(f"this turn failed ({self.failure}); nothing was committed — reopen the session and retry")
        if self.status is TurnStatus.COMMITTED:
            raise FailedPrecondition("this turn has committed; open a new turn")
        if self.status is not TurnStatus.OPEN:
            raise Aborted(f"this turn is {self.status.value}; one message at a time")

    def check_cache_length(self, cache_length: int) -> None:
        if cache_length != self.cache.length:
            raise Aborted(f"client thinks the cache holds {cache_length} tokens but it holds {self.cache.length}; "
                          "the client and server are out of step — reopen the turn")

    def check_outputs(self, num_tokens: int, num_outputs: int) -> int:
        """The number of outputs to return (0 means 1)."""
        num_outputs = num_outputs or 1
        if not 1 <= num_outputs <= num_tokens:
            raise InvalidArgument(f"outputs must be between 1 and the step's {num_tokens} tokens, got {num_outputs}")
        return num_outputs

    def check_evict(self, num_evicted: int, expected: int) -> None:
        if num_evicted != expected:
            raise Aborted(f"client's window evicts {num_evicted} tokens before this step but the server's evicts "
                          f"{expected}; do client and server use the same window settings?")

    def check_truncate(self, num_tokens: int, keep: list[int] = ()) -> None:
        """`num_tokens` within the cache; `keep` (a draft tree's accepted path) ascending offsets among them."""
        if num_tokens > self.cache.length:
            raise InvalidArgument(f"cannot drop {num_tokens} tokens from a cache of {self.cache.length}")
        if any(b <= a for a, b in zip(keep, keep[1:])) or any(k >= num_tokens for k in keep):
            raise InvalidArgument(f"Truncate.keep must list ascending offsets among the {num_tokens} positions "
                                  "it drops")

    @property
    def is_lock_refresh_due(self) -> bool:
        return self.lock is not None and time.monotonic() - self.refreshed_at > LOCK_REFRESH_SECONDS

    def refresh_lock(self) -> None:
        """Keep the cross-replica lease alive during long turns (store I/O, when due)."""
        if self.is_lock_refresh_due:
            self.lock.refresh()
            self.refreshed_at = time.monotonic()

    # -- transitions ---------------------------------------------------------------------------------
    @property
    def is_closed(self) -> bool:
        return self.status is TurnStatus.CLOSED

    def begin_step(self) -> None:
        with self._lock:
            self.require_open()
            self.status = TurnStatus.STEPPING

    def end_step(self, failure: str | None = None) -> bool:
        """The step was answered, failed (`failure`) or never started. True if the turn was closed
        meanwhile: the caller, done with the turn's pages, must wipe them."""
        with self._lock:
            if self.status is TurnStatus.CLOSED:
                orphaned, self.is_step_orphaned = self.is_step_orphaned, False
                return orphaned
            if failure is not None:
                self.status, self.failure = TurnStatus.FAILED, failure
            elif self.status is TurnStatus.STEPPING:
                self.status = TurnStatus.OPEN
            return False

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.status is not TurnStatus.CLOSED:
                self.status, self.failure = TurnStatus.FAILED, reason

    def mark_committed(self, manifest: Manifest) -> None:
        with self._lock:
            self.manifest, self.version, self.status = manifest, manifest.version, TurnStatus.COMMITTED

    def close(self) -> tuple[bool, bool]:
        """Mark the turn closed, without waiting: (whether it was open, whether the caller may wipe the
        pages now). A step with the worker keeps the pages until it ends (see `end_step`)."""
        with self._lock:
            if self.status is TurnStatus.CLOSED:
                return False, False
            self.is_close_requested = True
            self.is_step_orphaned = self.status is TurnStatus.STEPPING
            self.status = TurnStatus.CLOSED
            return True, not self.is_step_orphaned
