"""The server engine: served layers, open turns, and one worker that runs the model.

gRPC handler threads never touch the model. They open turns here and submit
steps; a single worker thread takes pending steps from a queue and runs them
through the layers. Keeping all model work on one scheduler thread is what
lets many concurrent streams share one device (and is where steps of several
sessions get batched together).
"""

from __future__ import annotations

import logging
import queue
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
from infemeral.kvcache.cache import KVCache
from infemeral.model.layers import LayerStack
from infemeral.storage.base import SessionLock, Store

log = logging.getLogger(__name__)

SESSION_ID_BYTES = 16
SESSION_KEY_BYTES = 32
LOCK_REFRESH_SECONDS = 10.0


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
    cache: KVCache
    lock: SessionLock | None = None      # the store's cross-replica hold on the session
    manifest: Manifest | None = None     # the committed state this turn started from
    low_water: int = 0                   # shortest the cache got during the turn (truncations)
    refreshed_at: float = field(default_factory=time.monotonic)
    closed: bool = False
    guard: threading.Lock = field(default_factory=threading.Lock)


class Engine:
    def __init__(self, bundle: ServerBundle, store: Store, *, device: str = "auto", dtype: str = "auto",
                 max_step_tokens: int = 2048, max_sessions: int = 64, window: WindowPolicy | None = None):
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
        self.hidden_size = bundle.config.hidden_size
        self.inv_freq = (rope_shift_frequencies(self.layers.rotary, bundle.config, self.window.max_context)
                         if self.window.enabled else None)
        self._active: dict[bytes, Turn] = {}
        self._active_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="infemeral-engine", daemon=True)
        self._stopping = False
        self._worker.start()
        log.info("engine ready: %d layers from %d on %s in %s", bundle.num_layers, bundle.first_layer,
                 self.device, dtype_name(self.dtype))

    # -- turns ------------------------------------------------------------------------------
    def open_turn(self, session_id: bytes, session_key: bytes, expected_version: int, fingerprint: str) -> Turn:
        if len(session_id) != SESSION_ID_BYTES:
            raise InvalidArgument(f"session_id must be {SESSION_ID_BYTES} bytes, got {len(session_id)}")
        if len(session_key) != SESSION_KEY_BYTES:
            raise InvalidArgument(f"session_key must be {SESSION_KEY_BYTES} bytes, got {len(session_key)}")
        if fingerprint != self.bundle.fingerprint:
            raise FailedPrecondition(
                "client bundle was prepared against a different server bundle "
                f"(client expects {fingerprint or 'none'}, server has {self.bundle.fingerprint}); "
                "upload the matching server bundle or use the matching client bundle")
        if self._stopping:
            raise Unavailable("server is shutting down; retry on another replica or later")
        with self._active_lock:
            if session_id in self._active:
                raise Aborted("this session is already in a turn on this server; wait for it to finish "
                              "(one turn at a time per session)")
            if len(self._active) >= self.max_sessions:
                raise ResourceExhausted(f"server is serving its limit of {self.max_sessions} turns; retry shortly")
            turn = Turn(session_id, SessionKeys.derive(session_id, session_key), 0, self.layers.new_cache())
            self._active[session_id] = turn
        try:
            self._load(turn, expected_version)
        except BaseException:
            self.close_turn(turn)
            raise
        log.info("turn opened session=%s version=%d length=%d", short_id(session_id), turn.version, turn.cache.length)
        return turn

    def _load(self, turn: Turn, expected_version: int) -> None:
        turn.lock = self.persistence.lock(turn.session_id)
        turn.manifest = self.persistence.load(turn.session_id, turn.keys, expected_version, turn.cache)
        turn.version = turn.manifest.version if turn.manifest else 0
        turn.low_water = turn.cache.length

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
        if expected:
            apply_window(turn.cache, self.window, n, self.inv_freq)
            turn.low_water = min(turn.low_water, turn.cache.length)  # stored positions moved: compact on commit
        future: Future = Future()
        self._queue.put((turn, hidden, outputs, future))
        return future.result(), expected

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
                                           turn.lock)
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
            turn.cache.wipe()
        finally:  # never leave the session locked in a turn, even if wiping failed
            if turn.lock is not None:
                turn.lock.release()
            with self._active_lock:
                if self._active.get(turn.session_id) is turn:
                    del self._active[turn.session_id]

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

    # -- the worker ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            turn, hidden, outputs, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if turn.closed:
                    raise Aborted("turn was closed")
                out = self.layers(hidden, turn.cache)
                future.set_result(out[-outputs:].to("cpu"))
            except BaseException as e:  # delivered to the waiting handler thread
                future.set_exception(e)

    def stop(self) -> None:
        self._stopping = True
        self._queue.put(None)
        self._worker.join(timeout=5)
