"""The server engine: turns, and one worker that batches the steps of all sessions.

gRPC handlers open turns here (loading the session's stored cache straight into
its pages), submit steps, truncate, commit and close; they never touch the
model. One worker thread runs the loop — drain the steps that arrived, let the
scheduler pick a batch, let the model runner run it, deliver the answers — so
the pending steps of *all* sessions share one ragged forward pass (continuous
batching: prefill and decode mixed, no padding). Every change to an open turn's
pages — its steps, window slides and truncations — happens on that worker,
between batches, so none races a running batch. Only a turn's own thread
touches its pages otherwise: loading them before its first step, wiping them
once it is closed and no step or truncation of it is with the worker (the
pool's free list has a lock of its own).

A step is answered in the dtype it was sent in, and checked after that cast:
an answer that is not finite on the wire (float16's range is far narrower
than the layers' float32) fails the step and the turn, like activations that
overflow inside the layers, and nothing is committed.

With API keys, each turn carries a short hash of its key (`account`): one key
may hold at most `max_sessions_per_key` turn slots and `pages_per_key` KV
pages, so it cannot take the pool, or every slot, from the others. Without API
keys, the account is the client's address, limited to `max_sessions_per_peer` turns.

Opening a turn is two moves so that an asyncio front end never blocks: `claim_turn`
(checks and a turn slot, instant) and `load_turn` (store lock, page quota,
decryption: run it on a thread). Closing never fails half-way and never
waits: whatever the store or a running step does, the slot and the session
are released, and the pages are wiped (by the worker, if it is still running a
step of the turn). A lock the store could not release is released again when
the store answers; until then its lease runs out by itself.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infemeral.cloak.bundle import ServerBundle
from infemeral.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted, StatusError, Unavailable
from infemeral.kvcache.paged import PagedSequence, PagePool, PageShare
from infemeral.kvcache.persistence import SessionPersistence
from infemeral.kvcache.stored import SessionKeys
from infemeral.kvcache.window import WindowPolicy
from infemeral.layers.stack import LayerStack
from infemeral.server.config import EngineConfig
from infemeral.server.metrics import NullMetrics
from infemeral.server.layer_runner import LayerRunner
from infemeral.server.scheduler import Scheduler, StepRequest
from infemeral.server.turn import Turn
from infemeral.storage.base import SessionLock, Store

log = logging.getLogger(__name__)

SESSION_ID_BYTES = 16
SESSION_KEY_BYTES = 32
BUSY_GRACE_SECONDS = 2.0
WAIT_POLL_SECONDS = 0.02  # how often steps waiting for pages are retried
SHUTTING_DOWN = "server is shutting down; retry on another replica or later"
OVERFLOWED = ("the step's activations overflowed to inf/NaN in the server's {dtype} (the hidden states sent are "
              "far larger than the model produces); the turn was aborted and nothing was committed — reopen the "
              "session and retry")
NOT_SENDABLE = ("the step's answer overflows to inf/NaN in {wire}, the dtype the step was sent in and is answered in "
                "(the hidden states sent are far larger than the model produces); the turn was aborted and nothing "
                "was committed — reopen the session and retry (bfloat16 and float32 have a wider range)")


class SessionInTurn(Aborted):
    """This server already runs a turn of the session (a reconnecting client may wait briefly for it)."""


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def short_id(session_id: bytes) -> str:
    """Enough of a session id to correlate logs, not enough to address the session."""
    return session_id.hex()[:8]


@dataclass(eq=False)
class WorkerJob:
    """Work on the pool that is not a forward pass — a truncation, forgetting a closed turn — run by the
    worker between batches. A job on a turn holds it the way a step does (one message at a time)."""

    run: Callable[[], Any]
    turn: Turn | None = None
    future: Future = field(default_factory=Future)


@dataclass
class StepOutput:
    hidden: torch.Tensor  # residuals of the step's last `num_outputs` positions [num_outputs, d], on the CPU
    cache_length: int     # after the step
    num_evicted: int      # tokens the window evicted before the step


@dataclass
class EngineStats:
    forwards: int = 0
    steps: int = 0
    tokens: int = 0
    largest_batch: int = 0


class Engine:
    def __init__(self, bundle: ServerBundle, store: Store, config: EngineConfig | None = None, *,
                 metrics: NullMetrics | None = None, runner: LayerRunner | None = None):
        """`runner`: the served layers, if not a `LayerRunner` of the bundle on one device (tensor parallelism
        passes rank 0's)."""
        self.bundle = bundle
        self.store = store
        self.config = config or EngineConfig()
        self.metrics = metrics or NullMetrics()
        self.persistence = SessionPersistence(store, bundle.fingerprint)
        self.runner = runner or LayerRunner(bundle, self.config)
        self.scheduler = Scheduler(self.config.window, self.runner.inv_freq, self.config.batch_token_budget,
                                   self.config.admission_wait, max_batch_hold=self.config.max_batch_hold,
                                   default_reserve_tokens=self.config.default_reserve_tokens)
        self._stats = EngineStats()
        self._active: dict[bytes, Turn] = {}
        self._active_lock = threading.Condition()
        self._turns_by_account: Counter[str] = Counter()  # open turns per API key (by its hash)
        self._shares: dict[str, PageShare] = {}            # pages held per API key, once it has opened a turn
        self._unreleased: dict[bytes, SessionLock] = {}  # store locks whose release failed, to retry
        self._unreleased_lock = threading.Lock()
        self._queue: queue.Queue[StepRequest | WorkerJob | None] = queue.Queue()
        self._submit_lock = threading.Lock()  # orders submissions against the stop sentinel
        self._is_accepting = True             # new turns are welcome
        self._is_stopped = False              # no step will be run any more
        self._worker = threading.Thread(target=self._run, name="infemeral-engine", daemon=True)
        self._worker.start()
        log.info("engine ready: %d layers from %d on %s in %s, %d KV pages of %d tokens, %s attention",
                 bundle.num_layers, bundle.first_layer, self.device, dtype_label(self.dtype),
                 self.pool.num_pages, self.pool.page_size, self.runner.backend.name)

    # -- what the service reads -----------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.bundle.config.hidden_size

    @property
    def max_step_tokens(self) -> int:
        return self.config.max_step_tokens

    @property
    def window(self) -> WindowPolicy:
        return self.config.window

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def pool(self) -> PagePool:
        return self.runner.pool

    @property
    def layers(self) -> LayerStack:
        return self.runner.layers

    @layers.setter
    def layers(self, layers: LayerStack) -> None:
        """Instrumentation (the benchmarks' layer timer) may wrap the served layer stack."""
        self.runner.layers = layers

    @property
    def stats(self) -> dict[str, int]:
        """Scheduler counters: forward passes, steps and tokens run, the largest batch."""
        return asdict(self._stats)

    @property
    def active_turns(self) -> int:
        return len(self._active)

    # -- turns -------------------------------------------------------------------------------------
    def open_turn(self, session_id: bytes, session_key: bytes, expected_version: int, fingerprint: str,
                  turn_id: bytes = b"", pending_turn_id: bytes = b"", reserve_tokens: int = 0,
                  account: str | None = None) -> Turn:
        """`claim_turn` (waiting briefly for a reconnecting client's old turn to end), then `load_turn`."""
        turn = self.claim_turn(session_id, session_key, fingerprint, turn_id, pending_turn_id,
                               wait=BUSY_GRACE_SECONDS, account=account)
        self.load_turn(turn, expected_version, pending_turn_id, reserve_tokens)
        return turn

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
        if fingerprint != self.bundle.fingerprint:
            raise FailedPrecondition(
                "client bundle was prepared against a different server bundle "
                f"(client expects {fingerprint or 'none'}, server has {self.bundle.fingerprint}); "
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
                        PagedSequence(self.pool, self._share(account)), turn_id=turn_id, account=account)
            self._active[session_id] = turn
            if account is not None:
                self._turns_by_account[account] += 1
        return turn

    @property
    def is_limited_per_key(self) -> bool:
        return bool(self.config.max_sessions_per_key or self.config.pages_per_key or self.config.max_sessions_per_peer)

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
            turn.cache.grant(self.scheduler.quota_tokens(length, reserve_tokens), wait=self.config.admission_wait)
            self.persistence.fill(turn.session_id, turn.keys, manifest, turn.cache)
            turn.manifest, turn.version = manifest, manifest.version if manifest else 0
        except BaseException:
            self.close_turn(turn)
            raise
        log.info("turn opened session=%s version=%d length=%d quota=%d", short_id(turn.session_id), turn.version,
                 turn.cache.length, turn.cache.quota_tokens)

    def submit_step(self, turn: Turn, hidden: torch.Tensor, cache_length: int, num_outputs: int = 1,
                    num_evicted: int = 0) -> Future:
        """Queue new positions [n, d] for the served layers; the future resolves to a `StepOutput`.

        Everything the client claims is checked here, before anything moves: its view of the cache
        length, the outputs it asks for, and the eviction its window makes before this step. Never
        blocks; keeping the session's store lease alive (`Turn.refresh_lock`) is the caller's job."""
        num_tokens = hidden.shape[0]
        turn.require_open()
        turn.check_cache_length(cache_length)
        num_outputs = turn.check_outputs(num_tokens, num_outputs)
        turn.check_evict(num_evicted, self.window.tokens_to_evict(turn.cache.length, num_tokens))
        step = StepRequest(turn, hidden, num_tokens, num_outputs, num_evicted, answer_dtype=hidden.dtype)
        self._submit(step)
        return step.future

    def _submit(self, item: StepRequest | WorkerJob) -> None:
        """Hand a step or a job on an open turn to the worker; the turn is busy until it is answered."""
        turn = item.turn
        turn.begin_step()
        with self._submit_lock:
            if self._is_stopped:
                if turn.end_step():
                    self._wipe(turn)
                raise Unavailable(SHUTTING_DOWN)
            self._queue.put(item)

    def step(self, turn: Turn, hidden: torch.Tensor, cache_length: int, num_outputs: int = 1,
             num_evicted: int = 0) -> StepOutput:
        """Refresh the store lease when due, `submit_step`, and wait for the answer."""
        turn.refresh_lock()
        return self.submit_step(turn, hidden, cache_length, num_outputs, num_evicted).result()

    def submit_truncate(self, turn: Turn, num_tokens: int, cache_length: int) -> Future:
        """Drop the last `num_tokens` positions (rejected drafts, a re-tokenised tail); the future resolves to
        the new length. Checked here; the pages are freed (and zeroed) on the worker, between batches."""
        turn.require_open()
        turn.check_cache_length(cache_length)
        turn.check_truncate(num_tokens)

        def truncate() -> int:
            turn.cache.truncate(num_tokens)
            return turn.cache.length

        job = WorkerJob(truncate, turn)
        self._submit(job)
        return job.future

    def truncate(self, turn: Turn, num_tokens: int, cache_length: int) -> int:
        """`submit_truncate`, and wait for the new length."""
        return self.submit_truncate(turn, num_tokens, cache_length).result()

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
        try:
            if can_wipe:  # otherwise the worker wipes them once it is done with this turn's step
                turn.cache.wipe()
        except Exception as e:  # noqa: BLE001 - closing must go on
            log.error("wiping a closed turn's pages failed: %s", type(e).__name__)
        try:
            if turn.lock is not None:
                turn.lock.release()
        except Exception as e:  # noqa: BLE001 - the store is down: its lease on the session runs out by itself
            log.warning("could not release the store's lock on session=%s (%s); it is released again when the "
                        "store answers, or expires", short_id(turn.session_id), type(e).__name__)
            with self._unreleased_lock:
                self._unreleased[turn.session_id] = turn.lock
        with self._active_lock:
            if self._active.get(turn.session_id) is turn:
                del self._active[turn.session_id]
                if turn.account is not None:
                    self._turns_by_account[turn.account] -= 1
                    if not self._turns_by_account[turn.account]:
                        del self._turns_by_account[turn.account]
                self._active_lock.notify_all()
        if self.scheduler.is_pacing:  # after the turn's last step, which the queue holds, if any
            with self._submit_lock:
                if not self._is_stopped:
                    self._queue.put(WorkerJob(lambda: self.scheduler.forget(turn)))

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
            try:
                lock.release()
            except Exception as e:  # noqa: BLE001 - as in close_turn
                log.warning("could not release the store's lock after a delete (%s)", type(e).__name__)
                with self._unreleased_lock:
                    self._unreleased[session_id] = lock
        log.info("session deleted session=%s", short_id(session_id))

    # -- lifecycle ---------------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Refuse new turns (UNAVAILABLE); open turns carry on."""
        self._is_accepting = False

    def stop(self) -> None:
        """Stop the worker; every step not yet answered, and every later one, gets UNAVAILABLE."""
        self.begin_shutdown()
        with self._submit_lock:
            if not self._is_stopped:
                self._is_stopped = True
                self._queue.put(None)
        self._worker.join(timeout=5)

    # -- the worker: drain, schedule, run, deliver ---------------------------------------------------
    def _run(self) -> None:
        reason = SHUTTING_DOWN
        try:
            hold = None
            while self._drain(hold):
                hold = self.scheduler.hold_until()  # turns about to send their next step: let them join
                if hold is not None:
                    continue
                schedule = self.scheduler.schedule()
                for step in schedule.failed:
                    self._fail(step, step.error)
                if schedule.batch:
                    started = time.monotonic()
                    self._run_batch(schedule.batch)
                    self.scheduler.ran(schedule.batch, time.monotonic() - started)
                elif self.scheduler.num_waiting:
                    time.sleep(WAIT_POLL_SECONDS)  # only steps waiting for pages: let other turns free some
        except BaseException:
            log.exception("the engine's worker failed")
            reason = "the server's engine failed; retry on another replica or later"
        finally:
            with self._submit_lock:  # from here on nothing new is queued
                self._is_stopped = True
            left = list(self.scheduler.waiting)
            self.scheduler.waiting.clear()
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    left.append(item)
            for item in left:
                self._fail(item, Unavailable(reason))

    def _drain(self, until: float | None = None) -> bool:
        """Hand the steps that arrived to the scheduler and run the jobs that arrived, blocking while there
        is nothing to do (or, with `until`, until then or the next step); False on stop."""
        block = self.scheduler.num_waiting == 0 or until is not None
        while True:
            timeout = None if until is None else max(0.0, until - time.monotonic())
            try:
                item = self._queue.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            if item is None:
                return False
            if not item.future.set_running_or_notify_cancel():  # cancelled before it started: nothing
                if item.turn is not None and item.turn.end_step():  # happened to the turn, which has closed
                    self._wipe(item.turn)                           # meanwhile
            elif isinstance(item, WorkerJob):
                self._run_job(item)  # between batches; a hold goes on
                continue
            else:
                self.scheduler.add(item)
            block, until = False, None

    def _run_job(self, job: WorkerJob) -> None:
        if job.turn is not None and job.turn.is_close_requested:  # nobody waits for it: the turn is gone
            self._fail(job, Aborted("the turn was closed before this truncation ran"))
            return
        try:
            result = job.run()
        except Exception as e:  # noqa: BLE001 - a job failing fails its turn, never the worker
            log.error("a job on the page pool failed: %s", type(e).__name__)
            self._fail(job, e if isinstance(e, StatusError) else Unavailable(
                f"the server failed to change this turn's cache ({type(e).__name__}); nothing was committed — "
                "retry the turn"))
            return
        if job.turn is not None and job.turn.end_step():
            self._wipe(job.turn)
        try:
            job.future.set_result(result)
        except InvalidStateError:  # cancelled meanwhile
            pass

    def _run_batch(self, batch: list[StepRequest]) -> None:
        try:
            outputs = self.runner.run([s.turn.cache for s in batch], [s.hidden for s in batch],
                                      [s.num_outputs for s in batch])
        except Exception as e:  # noqa: BLE001 - out of memory, a driver error: fail this batch, serve on
            log.error("a forward pass of %d steps failed: %s", len(batch), type(e).__name__)
            error = e if isinstance(e, StatusError) else Unavailable(
                f"the server failed to run this step ({type(e).__name__}; out of memory?); nothing was committed "
                "— retry the turn")
            for step in batch:
                self._fail(step, error)
            return
        num_tokens = sum(s.num_tokens for s in batch)
        self._stats.forwards += 1
        self._stats.steps += len(batch)
        self._stats.tokens += num_tokens
        self._stats.largest_batch = max(self._stats.largest_batch, len(batch))
        self.metrics.batch_ran(len(batch), num_tokens)
        for step, hidden in zip(batch, outputs):
            if hidden is None:
                self._fail(step, InvalidArgument(OVERFLOWED.format(dtype=dtype_label(self.dtype))))
                continue
            if step.answer_dtype is not None and hidden.dtype != step.answer_dtype:
                hidden = hidden.to(step.answer_dtype)  # what is sent: checked after the cast, not before
                if not bool(torch.isfinite(hidden).all()):
                    self._fail(step, InvalidArgument(NOT_SENDABLE.format(wire=dtype_label(step.answer_dtype))))
                    continue
            answer = StepOutput(hidden, step.turn.cache.length, step.num_evicted)
            if step.turn.end_step():
                self._wipe(step.turn)
            try:
                step.future.set_result(answer)
            except InvalidStateError:  # cancelled meanwhile
                pass

    def _fail(self, item: StepRequest | WorkerJob, error: StatusError) -> None:
        """A step (or job) that did not run or whose result is unusable: its turn no longer agrees with the
        client, so the turn fails too."""
        if item.turn is not None and item.turn.end_step(error.message):
            self._wipe(item.turn)
        try:
            item.future.set_exception(error)
        except InvalidStateError:  # cancelled meanwhile
            pass

    @staticmethod
    def _wipe(turn: Turn) -> None:
        """Wipe the pages of a turn that closed while its step was running here."""
        try:
            turn.cache.wipe()
        except Exception as e:  # noqa: BLE001 - the worker serves on
            log.error("wiping a closed turn's pages failed: %s", type(e).__name__)
