"""The server engine: turns, and one worker that batches the steps of all sessions.

gRPC handlers open turns here (loading the session's stored cache straight into
its pages), submit steps, truncate, commit and close; they never touch the
model. One worker thread runs the loop — drain the steps that arrived, let the
scheduler pick a batch, let the model runner run it, deliver the answers — so
the pending steps of *all* sessions share one ragged forward pass (continuous
batching: prefill and decode mixed, no padding). All page-pool mutations made
for steps happen on that worker, so sessions can never step on each other.

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
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass

import torch

from infemeral.cloak.bundle import ServerBundle
from infemeral.errors import Aborted, FailedPrecondition, InvalidArgument, ResourceExhausted, StatusError, Unavailable
from infemeral.kvcache.paged import PagedSequence, PagePool
from infemeral.kvcache.persistence import SessionPersistence
from infemeral.kvcache.stored import SessionKeys
from infemeral.kvcache.window import WindowPolicy
from infemeral.model.layers import LayerStack
from infemeral.server.config import EngineConfig
from infemeral.server.metrics import NullMetrics
from infemeral.server.model_runner import ModelRunner
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


class SessionInTurn(Aborted):
    """This server already runs a turn of the session (a reconnecting client may wait briefly for it)."""


def short_id(session_id: bytes) -> str:
    """Enough of a session id to correlate logs, not enough to address the session."""
    return session_id.hex()[:8]


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
                 metrics: NullMetrics | None = None):
        self.bundle = bundle
        self.store = store
        self.config = config or EngineConfig()
        self.metrics = metrics or NullMetrics()
        self.persistence = SessionPersistence(store, bundle.fingerprint)
        self.runner = ModelRunner(bundle, self.config)
        self.scheduler = Scheduler(self.config.window, self.runner.inv_freq, self.config.batch_token_budget,
                                   self.config.admission_wait, max_batch_hold=self.config.max_batch_hold)
        self._stats = EngineStats()
        self._active: dict[bytes, Turn] = {}
        self._active_lock = threading.Condition()
        self._unreleased: dict[bytes, SessionLock] = {}  # store locks whose release failed, to retry
        self._unreleased_lock = threading.Lock()
        self._queue: queue.Queue[StepRequest | None] = queue.Queue()
        self._submit_lock = threading.Lock()  # orders submissions against the stop sentinel
        self._is_accepting = True             # new turns are welcome
        self._is_stopped = False              # no step will be run any more
        self._worker = threading.Thread(target=self._run, name="infemeral-engine", daemon=True)
        self._worker.start()
        log.info("engine ready: %d layers from %d on %s in %s, %d KV pages of %d tokens, %s attention",
                 bundle.num_layers, bundle.first_layer, self.device, str(self.dtype).removeprefix("torch."),
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
                  turn_id: bytes = b"", pending_turn_id: bytes = b"", reserve_tokens: int = 0) -> Turn:
        """`claim_turn` (waiting briefly for a reconnecting client's old turn to end), then `load_turn`."""
        turn = self.claim_turn(session_id, session_key, fingerprint, turn_id, pending_turn_id,
                               wait=BUSY_GRACE_SECONDS)
        self.load_turn(turn, expected_version, pending_turn_id, reserve_tokens)
        return turn

    def claim_turn(self, session_id: bytes, session_key: bytes, fingerprint: str, turn_id: bytes = b"",
                   pending_turn_id: bytes = b"", wait: float = 0.0) -> Turn:
        """Check an open and take one of the `max_sessions` turn slots for the session. Touches no store and
        never blocks (unless `wait` > 0: how long to wait for this server's running turn of the session)."""
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
        with self._active_lock:
            if session_id in self._active and wait > 0:
                self._active_lock.wait_for(lambda: session_id not in self._active, timeout=wait)
            if session_id in self._active:
                raise SessionInTurn("this session is already in a turn on this server; wait for it to finish "
                                    "(one turn at a time per session)")
            if len(self._active) >= self.config.max_sessions:
                raise ResourceExhausted(f"server is serving its limit of {self.config.max_sessions} turns; "
                                        "retry in a second", retry_after=1.0)
            turn = Turn(session_id, SessionKeys.derive(session_id, session_key), PagedSequence(self.pool),
                        turn_id=turn_id)
            self._active[session_id] = turn
        return turn

    def load_turn(self, turn: Turn, expected_version: int, pending_turn_id: bytes = b"",
                  reserve_tokens: int = 0) -> None:
        """Take the session in the store, grant the turn its page quota and load its committed cache (store
        I/O, a wait of up to `admission_wait` for pages, decryption). On failure the turn is closed.

        `reserve_tokens` is what the client may add in this turn (0: undeclared, a whole window)."""
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
        step = StepRequest(turn, hidden, num_tokens, num_outputs, num_evicted)
        turn.begin_step()
        with self._submit_lock:
            if self._is_stopped:
                if turn.end_step():
                    self._wipe(turn)
                raise Unavailable(SHUTTING_DOWN)
            self._queue.put(step)
        return step.future

    def step(self, turn: Turn, hidden: torch.Tensor, cache_length: int, num_outputs: int = 1,
             num_evicted: int = 0) -> StepOutput:
        """Refresh the store lease when due, `submit_step`, and wait for the answer."""
        turn.refresh_lock()
        return self.submit_step(turn, hidden, cache_length, num_outputs, num_evicted).result()

    def truncate(self, turn: Turn, num_tokens: int, cache_length: int) -> int:
        """Drop the last `num_tokens` positions (rejected drafts, a re-tokenised tail); the new length."""
        turn.require_open()
        turn.check_cache_length(cache_length)
        turn.check_truncate(num_tokens)
        turn.cache.truncate(num_tokens)
        return turn.cache.length

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
                self._active_lock.notify_all()

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
            for step in left:
                self._fail(step, Unavailable(reason))

    def _drain(self, until: float | None = None) -> bool:
        """Hand the steps that arrived to the scheduler, blocking while there is nothing to do (or, with
        `until`, until then or the next step); False on stop."""
        block = self.scheduler.num_waiting == 0 or until is not None
        while True:
            timeout = None if until is None else max(0.0, until - time.monotonic())
            try:
                step = self._queue.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return True
            block, until = False, None
            if step is None:
                return False
            if step.future.set_running_or_notify_cancel():
                self.scheduler.add(step)
            elif step.turn.end_step():  # cancelled before it started: nothing happened to the turn...
                self._wipe(step.turn)     # ...which has closed meanwhile

    def _run_batch(self, batch: list[StepRequest]) -> None:
        try:
            outputs = self.runner.run([s.turn.cache for s in batch], [s.hidden for s in batch],
                                      [s.num_outputs for s in batch])
        except Exception as e:  # noqa: BLE001 - out of memory, a driver error: fail this batch, serve on
            log.error("a forward pass of %d steps failed: %s", len(batch), type(e).__name__)
            error = Unavailable(f"the server failed to run this step ({type(e).__name__}; out of memory?); "
                                "nothing was committed — retry the turn")
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
                self._fail(step, InvalidArgument(OVERFLOWED.format(dtype=str(self.dtype).removeprefix("torch."))))
                continue
            answer = StepOutput(hidden, step.turn.cache.length, step.num_evicted)
            if step.turn.end_step():
                self._wipe(step.turn)
            try:
                step.future.set_result(answer)
            except InvalidStateError:  # cancelled meanwhile
                pass

    def _fail(self, step: StepRequest, error: StatusError) -> None:
        """A step that did not run or whose result is unusable: its turn no longer agrees with the client,
        so the turn fails too."""
        if step.turn.end_step(error.message):
            self._wipe(step.turn)
        try:
            step.future.set_exception(error)
        except InvalidStateError:  # cancelled meanwhile
            pass

    @staticmethod
    def _wipe(turn: Turn) -> None:
        """Wipe the pages of a turn that closed while its step was running here."""
        try:
            turn.cache.wipe()
        except Exception as e:  # noqa: BLE001 - the worker serves on
            log.error("wiping a closed turn's pages failed: %s", type(e).__name__)
