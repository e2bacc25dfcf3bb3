"""How the engine refuses and fails: a step whose eviction disagrees with the server's window is refused;
a step after the engine stopped is answered at once; a failed forward pass fails exactly the turns in its
batch, with a clear status, and everyone else carries on; a failed load leaves no thread holding decrypted
state."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from infemeral.errors import Aborted, Unavailable
from infemeral.kvcache.paged import PagedSequence
from infemeral.server.turn import TurnStatus
from infemeral.storage.open import open_store

from tests.server.tiny_engine import HIDDEN, Client, assert_same, make_engine, snapshot


def test_step_whose_eviction_disagrees_with_the_window_is_refused(engine):
    c = Client(engine)
    turn = c.open()
    c.step(turn, 40)
    for wrong in (0, 1, 16):  # the window evicts 8 before a step of 9 at 40 tokens
        with pytest.raises(Aborted, match=f"client's window evicts {wrong} tokens before this step but the "
                                          "server's evicts 8"):
            engine.step(turn, torch.randn(9, HIDDEN), 40, 1, wrong)
    assert turn.status is TurnStatus.OPEN and turn.cache.length == 40
    with pytest.raises(Aborted, match="client's window evicts 8 tokens before this step but the server's evicts 0"):
        engine.step(turn, torch.randn(1, HIDDEN), 40, 1, 8)
    assert c.step(turn, 9).num_evicted == 8
    engine.close_turn(turn)


def test_step_after_the_engine_stopped_is_answered_at_once(bundle, tmp_path):
    engine = make_engine(bundle, open_store(tmp_path / "store"), kv_pool_tokens=64, admission_wait=30.0)
    a, b = Client(engine, 1), Client(engine, 2)
    hog, small = a.open(reserve_tokens=40), b.open(reserve_tokens=8)
    b.step(small, 8)
    waiting = engine.submit_step(small, torch.randn(20, HIDDEN), 8)  # past its quota: waits for spare pages
    time.sleep(0.2)
    assert not waiting.done()
    engine.stop()
    with pytest.raises(Unavailable, match="shutting down"):
        waiting.result(timeout=5)  # a step waiting in the scheduler is answered
    with pytest.raises(Unavailable, match="shutting down"):
        engine.submit_step(hog, torch.randn(1, HIDDEN), 0).result(timeout=5)  # and one submitted afterwards
    with pytest.raises(Unavailable, match="shutting down"):
        a.open()
    engine.close_turn(hog)
    engine.close_turn(small)


def test_a_failed_forward_fails_only_its_batch(bundle, store, monkeypatch):
    engine = make_engine(bundle, store)
    try:
        a, b = Client(engine, 1), Client(engine, 2)
        a.turn(12)
        b.turn(9)
        b_committed = snapshot(b.stored_cache())
        ta, tb = a.open(), b.open()
        real_run = engine.runner.run

        def out_of_memory(caches, hidden, num_outputs, trees=None):
            if tb.cache in caches:
                raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return real_run(caches, hidden, num_outputs, trees)

        monkeypatch.setattr(engine.runner, "run", out_of_memory)
        with pytest.raises(Unavailable, match=r"failed to run this step \(RuntimeError; out of memory\?\); "
                                              "nothing was committed — retry"):
            b.step(tb, 3)
        assert tb.status is TurnStatus.FAILED
        with pytest.raises(Aborted, match="this turn failed"):
            engine.step(tb, torch.randn(1, HIDDEN), b.length)
        with pytest.raises(Aborted, match="this turn failed"):
            engine.commit(tb)
        engine.close_turn(tb)
        for _ in range(3):  # the other session carries on, and commits
            a.step(ta, 2)
        a.commit(ta)
        engine.close_turn(ta)
        monkeypatch.setattr(engine.runner, "run", real_run)
        assert_same(snapshot(b.stored_cache()), b_committed, "the failed session's committed state")
        b.length = 9
        b.turn(1)  # and the failed session itself goes on from its last commit
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def decrypt_threads() -> int:
    return sum(t.name == "infemeral-decrypt" for t in threading.enumerate())


def test_a_failed_load_leaves_no_thread_behind(engine, monkeypatch):
    """Filling the pages fails (say, the device is out of memory): the decrypting thread must stop too,
    rather than block forever on its queue holding ciphertext and decrypted layers."""
    c = Client(engine)
    c.turn(20)
    before = decrypt_threads()

    def no_memory(self, slot, keys, values):
        raise torch.OutOfMemoryError("no room for this layer")

    monkeypatch.setattr(PagedSequence, "load_layer", no_memory)
    for _ in range(3):
        with pytest.raises(torch.OutOfMemoryError):
            c.open()
    deadline = time.monotonic() + 5
    while decrypt_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decrypt_threads() == before
    monkeypatch.undo()
    assert engine.active_turns == 0 and engine.pool.free_pages == engine.pool.num_pages
    c.turn(1)  # nothing was left locked or half-loaded
