"""The server engine: served layers, a shared KV page pool, open turns, and a batching scheduler.

gRPC handler threads never touch the model. They open turns here (loading the
session's stored cache straight into its pages) and submit steps; one worker
thread drains the pending steps of *all* sessions and runs them together in one
ragged forward pass (continuous batching: prefill and decode mixed, no padding,
first come first served up to a token budget). All page-pool mutations made
for steps happen on that worker, so sessions can never step on each other.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from infemeral.cloak.bundle import ServerBundle, dtype_name
from infemeral.errors import (Aborted, FailedPrecondition, InvalidArgument,
                              ResourceExhausted, Unavailable)
from infemeral.kvcache.persistence import SessionPersistence
from infemeral.kvcache.stored import Manifest, SessionKeys
from infemeral.kvcache.window import WindowPolicy, apply_window, rope_shift_frequencies
from infemeral.kvcache.paged import PagedBatch, PagedSequence, PagePool, PoolExhausted
from infemeral.model.layers import LayerStack, head_dim
from infemeral.model.paged_attention import select_backend
from infemeral.storage.base import SessionLock, Store

log = logging.getLogger(__name__)

SESSION_ID_BYTES = 16
SESSION_KEY_BYTES = 32
LOCK_REFRESH_SECONDS = 10.0
BUSY_GRACE_SECONDS = 2.0


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, not {dtype!r}") from None


def short_id(session_id: bytes) -> str:
    """Enough of a session id to correlate logs, not enough to address the session."""
    return session_id.hex()[:8]


@dataclass
class Turn:
    session_id: bytes
    keys: SessionKeys
    version: int
    cache: PagedSequence
    lock: SessionLock | None = None      # the store's cross-replica hold on the session
    manifest: Manifest | None = None     # the committed state this turn started from
    low_water: int = 0                   # shortest the cache got during the turn (truncations)
    refreshed_at: float = field(default_factory=time.monotonic)
    turn_id: bytes = b""
    closed: bool = False
    guard: threading.Lock = field(default_factory=threading.Lock)
    idle: threading.Event = field(default_factory=threading.Event)  # no step in the scheduler

    def __post_init__(self):
        self.idle.set()


@dataclass
class _Step:
    turn: Turn
    hidden: torch.Tensor
    outputs: int
    evict: int
    future: Future
    started: bool = False                # the future is running; the window has been applied
    waiting_since: float | None = None   # when it first found the pool full


class Engine:
    def __init__(self, bundle: ServerBundle, store: Store, *, device: str = "auto", dtype: str = "auto",
                 max_step_tokens: int = 2048, max_sessions: int = 64, window: WindowPolicy | None = None,
                 kv_pool_tokens: int = 65536, max_batch_tokens: int = 8192, admission_wait: float = 10.0,
                 attention_backend: str = "auto"):
        self.bundle = bundle
        self.store = store
        self.persistence = SessionPersistence(store, bundle.fingerprint)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.max_step_tokens = max_step_tokens
        self.window = window or WindowPolicy(8192)
        self.max_sessions = max_sessions
        layers = [bundle.layer_weights(i) for i in range(bundle.first_layer, bundle.first_layer + bundle.num_layers)]
        self.layers = LayerStack(bundle.config, bundle.first_layer, layers, dtype=self.dtype, device=self.device)
        del layers
        config = bundle.config
        self.hidden_size = config.hidden_size
        self.inv_freq = (rope_shift_frequencies(self.layers.rotary, config, self.window.max_context)
                         if self.window.enabled else None)
        self.pool = PagePool(max(1, kv_pool_tokens // self.window.page_size), self.window.page_size,
                             bundle.first_layer, bundle.num_layers, config.num_key_value_heads, head_dim(config),
                             self.dtype, self.device)
        self.backend = select_backend(attention_backend, self.device, config.num_attention_heads,
                                      config.num_key_value_heads, head_dim(config), self.window.page_size, self.dtype)
        self.max_batch_tokens = max(max_batch_tokens, max_step_tokens)
        self.admission_wait = admission_wait
        self.stats = {"forwards": 0, "steps": 0, "tokens": 0, "largest_batch": 0}  # scheduler counters
        self.metrics = None  # set by the server when Prometheus metrics are on
        self._active: dict[bytes, Turn] = {}
        self._active_lock = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="infemeral-engine", daemon=True)
        self._stopping = False
        self._worker.start()
        log.info("engine ready: %d layers from %d on %s in %s, %d KV pages of %d tokens, %s attention",
                 bundle.num_layers, bundle.first_layer, self.device, dtype_name(self.dtype), self.pool.num_pages,
                 self.pool.page_size, self.backend.name)

    # -- turns ------------------------------------------------------------------------------
    def open_turn(self, session_id: bytes, session_key: bytes, expected_version: int, fingerprint: str,
                  turn_id: bytes = b"", pending_turn_id: bytes = b"") -> Turn:
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
        if self._stopping:
            raise Unavailable("server is shutting down; retry on another replica or later")
        with self._active_lock:
            # A client that lost its stream may reconnect before the server has seen the old stream end:
            # give the old turn a moment to close before refusing.
            if session_id in self._active:
                self._active_lock.wait_for(lambda: session_id not in self._active, timeout=BUSY_GRACE_SECONDS)
            if session_id in self._active:
                raise Aborted("this session is already in a turn on this server; wait for it to finish "
                              "(one turn at a time per session)")
            if len(self._active) >= self.max_sessions:
                raise ResourceExhausted(f"server is serving its limit of {self.max_sessions} turns; retry shortly")
            turn = Turn(session_id, SessionKeys.derive(session_id, session_key), 0,
                        PagedSequence(self.pool, self.admission_wait), turn_id=turn_id)
            self._active[session_id] = turn
        try:
            self._load(turn, expected_version, pending_turn_id)
        except BaseException:
            self.close_turn(turn)
            raise
        log.info("turn opened session=%s version=%d length=%d", short_id(session_id), turn.version, turn.cache.length)
        return turn

    def _load(self, turn: Turn, expected_version: int, pending_turn_id: bytes = b"") -> None:
        turn.lock = self.persistence.lock(turn.session_id)
        turn.manifest = self.persistence.load(turn.session_id, turn.keys, expected_version, turn.cache,
                                              pending_turn_id)
        turn.version = turn.manifest.version if turn.manifest else 0
        turn.low_water = turn.cache.length
        turn.cache.reserve(turn.cache.length + 1, wait=self.admission_wait)  # admission: room to start

    def step(self, turn: Turn, hidden: torch.Tensor, cache_length: int, outputs: int = 1,
             evict: int = 0) -> tuple[torch.Tensor, int]:
        """Slide the window, run new positions through the served layers; return the last `outputs`
        residuals and the number of tokens the window evicted."""
        n = hidden.shape[0]
        if cache_length != turn.cache.length:
            raise Aborted(f"client thinks the cache holds {cache_length} tokens but it holds {turn.cache.length}; "
                          "the client and server are out of step — reopen the turn")
        outputs = outputs or 1
        if not 1 <= outputs <= n:
            raise InvalidArgument(f"outputs must be between 1 and the step's {n} tokens, got {outputs}")
        expected = self.window.tokens_to_evict(turn.cache.length, n)
        if evict != expected:
            raise Aborted(f"client's window evicts {evict} tokens before this step but the server's evicts "
                          f"{expected}; do client and server use the same window settings?")
        if time.monotonic() - turn.refreshed_at > LOCK_REFRESH_SECONDS:
            turn.lock.refresh()  # keep the cross-replica lease alive during long turns
            turn.refreshed_at = time.monotonic()
        future: Future = Future()
        turn.idle.clear()
        self._queue.put(_Step(turn, hidden, outputs, expected, future))
        try:
            return future.result(), expected
        finally:
            turn.idle.set()

    def truncate(self, turn: Turn, tokens: int, cache_length: int) -> int:
        if cache_length != turn.cache.length:
            raise Aborted(f"client thinks the cache holds {cache_length} tokens but it holds {turn.cache.length}")
        if tokens > turn.cache.length:
            raise InvalidArgument(f"cannot drop {tokens} tokens from a cache of {turn.cache.length}")
        turn.cache.truncate(tokens)
        turn.low_water = min(turn.low_water, turn.cache.length)
        return turn.cache.length

    def commit(self, turn: Turn) -> int:
        manifest = self.persistence.commit(turn.session_id, turn.keys, turn.cache, turn.manifest, turn.low_water,
                                           turn.lock, turn.turn_id)
        turn.manifest, turn.version, turn.low_water = manifest, manifest.version, turn.cache.length
        turn.cache.commit()
        log.info("turn committed session=%s version=%d length=%d chunks=%d", short_id(turn.session_id),
                 manifest.version, manifest.length, len(manifest.chunks))
        return manifest.version

    def close_turn(self, turn: Turn) -> None:
        """End a turn, committed or not: wipe plaintext and release the session."""
        with turn.guard:
            if turn.closed:
                return
            turn.closed = True
        try:
            turn.idle.wait(timeout=60)  # a step still in the scheduler must finish before its pages go
            turn.cache.wipe()
        finally:  # never leave the session locked in a turn, even if wiping failed
            if turn.lock is not None:
                turn.lock.release()
            with self._active_lock:
                if self._active.get(turn.session_id) is turn:
                    del self._active[turn.session_id]
                    self._active_lock.notify_all()

    def delete_session(self, session_id: bytes, session_key: bytes) -> None:
        if len(session_id) != SESSION_ID_BYTES or len(session_key) != SESSION_KEY_BYTES:
            raise InvalidArgument("session_id must be 16 bytes and session_key 32 bytes")
        with self._active_lock:
            if session_id in self._active:
                raise Aborted("this session is in a turn; delete it when the turn has ended")
        lock = self.persistence.lock(session_id)
        try:
            self.persistence.delete(session_id, SessionKeys.derive(session_id, session_key))
        finally:
            lock.release()
        log.info("session deleted session=%s", short_id(session_id))

    @property
    def active_turns(self) -> int:
        return len(self._active)

    # -- the scheduler ----------------------------------------------------------------------------
    def _run(self) -> None:
        pending: deque[_Step] = deque()
        while True:
            if not pending:
                item = self._queue.get()
                if item is None:
                    return
                pending.append(item)
            while True:  # everything that arrived meanwhile joins this round
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    for step in pending:
                        if not step.future.done():
                            step.future.set_exception(Unavailable("server is shutting down"))
                    return
                pending.append(item)
            batch, waiting, tokens = [], [], 0
            while pending and (not batch or tokens + pending[0].hidden.shape[0] <= self.max_batch_tokens):
                step = pending.popleft()  # first come, first served: nothing starves
                admitted = self._admit(step)
                if admitted is None:
                    waiting.append(step)
                elif admitted:
                    batch.append(step)
                    tokens += step.hidden.shape[0]
            pending.extendleft(reversed(waiting))  # steps waiting for pages keep their place in line
            if batch:
                self._forward(batch)
            elif waiting:
                time.sleep(0.02)  # only steps waiting for pages: let other turns free some

    def _admit(self, step: _Step) -> bool | None:
        """Slide the window and reserve pages for a step. None: wait for pages (bounded); False: failed."""
        turn, n = step.turn, step.hidden.shape[0]
        try:
            if not step.started:
                if not step.future.set_running_or_notify_cancel():
                    return False
                step.started = True
                if turn.closed:
                    raise Aborted("turn was closed")
                if step.evict:
                    apply_window(turn.cache, self.window, n, self.inv_freq)
                    turn.low_water = min(turn.low_water, turn.cache.length)  # stored positions moved: compact
            try:
                turn.cache.reserve(turn.cache.length + n)
            except PoolExhausted:
                now = time.monotonic()
                step.waiting_since = step.waiting_since or now
                if now - step.waiting_since < self.admission_wait:
                    return None
                raise
            return True
        except BaseException as e:
            step.future.set_exception(e)
            return False

    def _forward(self, batch: list[_Step]) -> None:
        try:
            paged = PagedBatch(self.pool, [s.turn.cache for s in batch], [s.hidden.shape[0] for s in batch],
                               self.backend)
            out = self.layers.forward_batch(torch.cat([s.hidden.to(self.dtype) for s in batch]), paged)
        except BaseException as e:  # delivered to every waiting handler thread
            for s in batch:
                s.future.set_exception(e)
            return
        self.stats["forwards"] += 1
        self.stats["steps"] += len(batch)
        self.stats["tokens"] += int(paged.qo_indptr[-1])
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(batch))
        if self.metrics is not None:
            self.metrics.steps.inc(len(batch))
            self.metrics.tokens.inc(int(paged.qo_indptr[-1]))
            self.metrics.batch_steps.observe(len(batch))
        ends = paged.qo_indptr.tolist()[1:]
        for s, end in zip(batch, ends):
            s.future.set_result(out[end - s.outputs:end].to("cpu"))

    def stop(self) -> None:
        self._stopping = True
        self._queue.put(None)
        self._worker.join(timeout=5)
