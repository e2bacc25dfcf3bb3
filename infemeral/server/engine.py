"""The server engine: one worker that batches the steps of all sessions.

gRPC handlers open turns here (their lifecycle — claim, load, commit, close,
delete, per-key limits — is `sessions.Sessions`, which the engine's turn
methods hand over to), submit steps and truncate; they never touch the model.
One worker thread runs the loop — drain the steps that arrived, let the
scheduler pick a batch, let the layer runner run it, deliver the answers — so
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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infemeral.cloak.bundle import ServerBundle
from infemeral.errors import Aborted, InvalidArgument, StatusError, Unavailable
from infemeral.kvcache.paged import KVPages, PagePool
from infemeral.kvcache.persistence import SessionPersistence
from infemeral.kvcache.stored import Manifest
from infemeral.kvcache.window import WindowPolicy
from infemeral.layers.draft_tree import check_parents, is_chain
from infemeral.layers.stack import LayerStack
from infemeral.server.config import EngineConfig
from infemeral.server.metrics import NullMetrics
from infemeral.server.layer_runner import LayerRunner
from infemeral.server.scheduler import Scheduler, StepRequest
from infemeral.server.sessions import (BUSY_GRACE_SECONDS, SHUTTING_DOWN, SessionInTurn, Sessions, short_id,
                                       wipe_pages)
from infemeral.server.turn import Turn
from infemeral.storage.base import Store

log = logging.getLogger(__name__)

# server/turn_call.py imports the session names it needs with the engine, from here.
__all__ = ["BUSY_GRACE_SECONDS", "Engine", "SessionInTurn", "StepOutput", "short_id"]

WAIT_POLL_SECONDS = 0.02  # how often steps waiting for pages are retried
OVERFLOWED = ("the step's activations overflowed to inf/NaN in the server's {dtype} (the hidden states sent are "
              "far larger than the model produces); the turn was aborted and nothing was committed — reopen the "
              "session and retry")
NOT_SENDABLE = ("the step's answer overflows to inf/NaN in {wire}, the dtype the step was sent in and is answered in "
                "(the hidden states sent are far larger than the model produces); the turn was aborted and nothing "
                "was committed — reopen the session and retry (bfloat16 and float32 have a wider range)")


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
        self.runner = runner or LayerRunner(bundle, self.config)
        self.scheduler = Scheduler(self.config.window, self.runner.inv_freq, self.config.batch_token_budget,
                                   self.config.admission_wait, max_batch_hold=self.config.max_batch_hold,
                                   default_reserve_tokens=self.config.default_reserve_tokens)
        self.sessions = Sessions(bundle.fingerprint, store, self.pool, self.runner.kv, self.config, metrics=self.metrics,
                                 quota_tokens=self.scheduler.quota_tokens, on_closed=self._forget_pacing)
        self._stats = EngineStats()
        self._queue: queue.Queue[StepRequest | WorkerJob | None] = queue.Queue()
        self._submit_lock = threading.Lock()  # orders submissions against the stop sentinel
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
        """Which KV pages are free, promised or taken."""
        return self.runner.pool

    @property
    def kv(self) -> KVPages:
        """The keys and values in the pages."""
        return self.runner.kv

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
    def persistence(self) -> SessionPersistence:
        return self.sessions.persistence

    @property
    def active_turns(self) -> int:
        return self.sessions.active_turns

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
        """`Sessions.claim_turn`: checks and a turn slot, instant."""
        return self.sessions.claim_turn(session_id, session_key, fingerprint, turn_id, pending_turn_id, wait, account)

    def load_turn(self, turn: Turn, expected_version: int, pending_turn_id: bytes = b"",
                  reserve_tokens: int = 0) -> None:
        """`Sessions.load_turn`: store lock, page quota, decryption (run it on a thread)."""
        self.sessions.load_turn(turn, expected_version, pending_turn_id, reserve_tokens)

    @property
    def draft_trees(self) -> bool:
        """Whether steps may carry draft trees (ServerInfo.draft_trees)."""
        return self.runner.draft_trees

    def submit_step(self, turn: Turn, hidden: torch.Tensor, cache_length: int, num_outputs: int = 1,
                    num_evicted: int = 0, parents: list[int] | None = None) -> Future:
        """Queue new positions [n, d] for the served layers; the future resolves to a `StepOutput`.

        Everything the client claims is checked here, before anything moves: its view of the cache
        length, the outputs it asks for, the eviction its window makes before this step, and the draft tree
        its positions form (`parents`, if any). Never blocks; keeping the session's store lease alive
        (`Turn.refresh_lock`) is the caller's job."""
        num_tokens = hidden.shape[0]
        turn.require_open()
        if parents:
            if not self.draft_trees:
                raise InvalidArgument("this server verifies chains only (ServerInfo.draft_trees is false): send "
                                      "the step without parents")
            check_parents(parents, num_tokens)
        turn.check_cache_length(cache_length)
        num_outputs = turn.check_outputs(num_tokens, num_outputs)
        turn.check_evict(num_evicted, self.window.tokens_to_evict(turn.cache.length, num_tokens))
        step = StepRequest(turn, hidden, num_tokens, num_outputs, num_evicted, answer_dtype=hidden.dtype,
                           parents=list(parents) if parents and not is_chain(parents) else None)
        self._submit(step)
        return step.future

    def _submit(self, item: StepRequest | WorkerJob) -> None:
        """Hand a step or a job on an open turn to the worker; the turn is busy until it is answered."""
        turn = item.turn
        turn.begin_step()
        with self._submit_lock:
            if self._is_stopped:
                if turn.end_step():
                    wipe_pages(turn)
                raise Unavailable(SHUTTING_DOWN)
            self._queue.put(item)

    def step(self, turn: Turn, hidden: torch.Tensor, cache_length: int, num_outputs: int = 1,
             num_evicted: int = 0) -> StepOutput:
        """Refresh the store lease when due, `submit_step`, and wait for the answer."""
        turn.refresh_lock()
        return self.submit_step(turn, hidden, cache_length, num_outputs, num_evicted).result()

    def submit_truncate(self, turn: Turn, num_tokens: int, cache_length: int, keep: list[int] = ()) -> Future:
        """Drop the last `num_tokens` positions (rejected drafts, a re-tokenised tail) but those at offsets
        `keep` among them (a draft tree's accepted path), which move down in order; the future resolves to the
        new length. Checked here; the pages are freed (and zeroed) on the worker, between batches."""
        turn.require_open()
        turn.check_cache_length(cache_length)
        turn.check_truncate(num_tokens, list(keep))

        def truncate() -> int:
            turn.cache.keep_positions(turn.cache.length - num_tokens, list(keep))
            return turn.cache.length

        job = WorkerJob(truncate, turn)
        self._submit(job)
        return job.future

    def truncate(self, turn: Turn, num_tokens: int, cache_length: int, keep: list[int] = ()) -> int:
        """`submit_truncate`, and wait for the new length."""
        return self.submit_truncate(turn, num_tokens, cache_length, keep).result()

    def commit(self, turn: Turn) -> int:
        """`Sessions.commit`: store what changed; the session's next version."""
        return self.sessions.commit(turn)

    def close_turn(self, turn: Turn) -> None:
        """`Sessions.close_turn`: never raises, never waits."""
        self.sessions.close_turn(turn)

    def delete_session(self, session_id: bytes, session_key: bytes) -> None:
        self.sessions.delete_session(session_id, session_key)

    def fork_session(self, source_id: bytes, source_key: bytes, source_version: int, session_id: bytes,
                     session_key: bytes, fingerprint: str, drop: int = 0, account: str | None = None) -> Manifest:
        """`Sessions.fork_session`: store I/O and re-encryption (run it on a thread)."""
        return self.sessions.fork_session(source_id, source_key, source_version, session_id, session_key,
                                          fingerprint, drop, account)

    def release_leftover_locks(self) -> int:
        """`Sessions.release_leftover_locks`: how many failed lock releases are still left."""
        return self.sessions.release_leftover_locks()

    def _forget_pacing(self, turn: Turn) -> None:
        """A turn closed: the scheduler forgets its pace, after the turn's last step, which the queue holds if any."""
        if self.scheduler.is_pacing:
            with self._submit_lock:
                if not self._is_stopped:
                    self._queue.put(WorkerJob(lambda: self.scheduler.forget(turn)))

    # -- lifecycle ---------------------------------------------------------------------------------
    def begin_shutdown(self) -> None:
        """Refuse new turns (UNAVAILABLE); open turns carry on."""
        self.sessions.begin_shutdown()

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
                    wipe_pages(item.turn)                           # meanwhile
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
            wipe_pages(job.turn)
        try:
            job.future.set_result(result)
        except InvalidStateError:  # cancelled meanwhile
            pass

    def _run_batch(self, batch: list[StepRequest]) -> None:
        try:
            outputs = self.runner.run([s.turn.cache for s in batch], [s.hidden for s in batch],
                                      [s.num_outputs for s in batch], [s.parents for s in batch])
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
                wipe_pages(step.turn)
            try:
                step.future.set_result(answer)
            except InvalidStateError:  # cancelled meanwhile
                pass

    def _fail(self, item: StepRequest | WorkerJob, error: StatusError) -> None:
        """A step (or job) that did not run or whose result is unusable: its turn no longer agrees with the
        client, so the turn fails too."""
        if item.turn is not None and item.turn.end_step(error.message):
            wipe_pages(item.turn)
        try:
            item.future.set_exception(error)
        except InvalidStateError:  # cancelled meanwhile
            pass
