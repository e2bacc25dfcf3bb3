"""A tiny random Llama served by an in-process `Engine` over a real store (no gRPC), for the engine's tests
to drive one session at a time as a client would: they run in seconds. The fixtures are in conftest.py."""

from __future__ import annotations

import contextlib
import os
import time

import torch

from infemeral.kvcache import stored
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.window import WindowPolicy
from infemeral.server.config import EngineConfig
from infemeral.server.engine import Engine



HIDDEN = 64
WINDOW = WindowPolicy(max_context=48, sink_tokens=4, page_size=8)


def make_engine(bundle, store, **overrides) -> Engine:
    config = dict(device="cpu", dtype="float32", window=WINDOW, kv_pool_tokens=1024, admission_wait=2.0)
    return Engine(bundle, store, EngineConfig(**{**config, **overrides}))


class Client:
    """One session as a client drives it: its id, key, version and view of the cache length."""

    def __init__(self, engine: Engine, seed: int = 0):
        self.engine, self.gen = engine, torch.Generator().manual_seed(seed)
        self.id, self.key = os.urandom(16), os.urandom(32)
        self.version, self.length = 0, 0

    def open(self, reserve_tokens: int = 0, account: str | None = None):
        turn = self.engine.open_turn(self.id, self.key, self.version, self.engine.bundle.fingerprint,
                                     os.urandom(16), reserve_tokens=reserve_tokens, account=account)
        assert turn.cache.length == self.length
        return turn

    def step(self, turn, n: int, num_outputs: int = 1):
        evict = self.engine.window.tokens_to_evict(self.length, n)
        out = self.engine.step(turn, torch.randn(n, HIDDEN, generator=self.gen), self.length, num_outputs, evict)
        self.length += n - evict
        assert (out.cache_length, out.num_evicted, out.hidden.shape) == (self.length, evict, (num_outputs, HIDDEN))
        return out

    def truncate(self, turn, n: int) -> None:
        self.length = self.engine.truncate(turn, n, self.length)

    def commit(self, turn) -> None:
        self.version = self.engine.commit(turn)

    def turn(self, *sizes: int, reserve_tokens: int = 0) -> None:
        turn = self.open(reserve_tokens)
        try:
            for n in sizes:
                self.step(turn, n)
            self.commit(turn)
        finally:
            self.engine.close_turn(turn)

    def stored_cache(self) -> KVCache:
        """The committed cache, decrypted straight from the store."""
        kv = self.engine.kv
        cache = KVCache(kv.first_layer, kv.num_layers, kv.kv_heads, kv.head_dim, kv.dtype)
        self.engine.persistence.load(self.id, stored.SessionKeys.derive(self.id, self.key), self.version, cache)
        return cache


def snapshot(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.clone() for t in cache.layer_tensors(slot)) for slot in range(cache.num_layers)]


def assert_same(a: list, b: list, what: str) -> None:
    assert len(a) == len(b)
    for slot, ((k, v), (k0, v0)) in enumerate(zip(a, b)):
        assert k.shape == k0.shape, f"{what}: layer slot {slot} holds {k.shape[1]} tokens, not {k0.shape[1]}"
        assert torch.equal(k, k0) and torch.equal(v, v0), (
            f"{what}: layer slot {slot} differs by up to {max((k - k0).abs().max(), (v - v0).abs().max()):.3g}")



def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@contextlib.contextmanager
def arriving_together(engine):
    """Steps submitted inside reach the engine's worker in one go when the block ends (held back, then queued
    under the queue's own lock), instead of racing it one by one: whether two steps share a forward pass no
    longer depends on how fast the worker wakes."""
    q, held = engine._queue, []
    q.put = held.append
    try:
        yield
    finally:
        del q.put
        with q.mutex:
            for item in held:
                q._put(item)
            q.unfinished_tasks += len(held)
            q.not_empty.notify()
