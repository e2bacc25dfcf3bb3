"""Closing a turn and overflowing steps: a close never waits for the turn's running step (the worker wipes
the pages afterwards); a step whose activations overflow to inf/NaN, in the layers or in the dtype its
answer is sent in, fails only its own turn and stores nothing."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from infemeral.errors import Aborted, InvalidArgument
from infemeral.server.turn import TurnStatus
from infemeral.storage.open import open_store

from tests.server.tiny_engine import HIDDEN, Client, arriving_together, assert_same, make_engine, snapshot, wait_for


def test_closing_a_turn_never_waits_for_its_running_step(bundle, tmp_path, monkeypatch):
    """The client vanished while the worker computes its step: the session and its slot are released at
    once (a reconnect opens it), and the worker wipes the pages when it is done with them."""
    engine = make_engine(bundle, open_store(tmp_path / "store"))
    try:
        c = Client(engine)
        c.turn(10)
        running, release = threading.Event(), threading.Event()
        real_run = engine.runner.run

        def slow_run(caches, hidden, num_outputs, trees=None):
            running.set()
            release.wait(10)
            return real_run(caches, hidden, num_outputs, trees)

        monkeypatch.setattr(engine.runner, "run", slow_run)
        turn = c.open()
        future = engine.submit_step(turn, torch.randn(3, HIDDEN), c.length)
        assert running.wait(5)
        started = time.monotonic()
        engine.close_turn(turn)
        assert time.monotonic() - started < 1
        assert turn.status is TurnStatus.CLOSED and engine.active_turns == 0
        assert engine.pool.free_pages < engine.pool.num_pages  # the worker still writes into those pages
        again = c.open()  # the session is free again at once
        release.set()
        future.result(timeout=10)  # the orphaned step finishes...
        assert wait_for(lambda: engine.pool.free_pages == engine.pool.num_pages - len(again.cache.pages))
        monkeypatch.setattr(engine.runner, "run", real_run)
        c.step(again, 2)  # ...its pages are wiped, and the new turn is undisturbed
        c.commit(again)
        engine.close_turn(again)
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def test_an_overflowed_step_fails_only_its_turn(bundle, tmp_path):
    """Rows that are finite as sent (float32) but past float16's range overflow in a float16 server. That turn
    fails (INVALID_ARGUMENT) and stores nothing; a turn stepping beside it, in the same batches, carries on."""
    engine = make_engine(bundle, open_store(tmp_path / "store"), dtype="float16")
    try:
        a, b = Client(engine, 1), Client(engine, 2)
        a.turn(6)
        b.turn(6)
        b_committed = snapshot(b.stored_cache())
        ta, tb = a.open(), b.open()
        batches = []
        real_run = engine.runner.run

        def recording_run(caches, hidden, num_outputs, trees=None):
            batches.append({id(cache) for cache in caches})
            return real_run(caches, hidden, num_outputs, trees)

        engine.runner.run = recording_run
        with arriving_together(engine):  # both steps reach the worker at once, so they share one forward pass
            healthy = engine.submit_step(ta, torch.randn(1, HIDDEN, dtype=torch.float16), a.length)
            huge = engine.submit_step(tb, torch.full((2, HIDDEN), 1e5), b.length)
        with pytest.raises(InvalidArgument, match=r"overflowed to inf/NaN in the server's float16.*nothing "
                                                  "was committed"):
            huge.result(timeout=10)
        assert torch.isfinite(healthy.result(timeout=10).hidden).all()
        a.length += 1
        assert tb.status is TurnStatus.FAILED
        with pytest.raises(Aborted, match="this turn failed"):
            engine.commit(tb)
        engine.close_turn(tb)
        assert {id(ta.cache), id(tb.cache)} <= batches[-1], "the two steps never shared a batch"
        a.commit(ta)
        engine.close_turn(ta)
        assert_same(snapshot(b.stored_cache()), b_committed, "the overflowed session's committed state")
        live = snapshot(a.stored_cache())
        assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in live)
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def test_an_answer_that_overflows_the_wire_dtype_fails_its_turn(engine, monkeypatch):
    """A float32 server whose answer is finite in float32 but past float16's range, for a step sent in float16:
    what would be sent is inf, so the step and its turn fail (old code: checked before the cast, and sent inf).
    The same answer for a step sent in float32 is fine."""
    a = Client(engine, 1)
    a.turn(4)
    committed = snapshot(a.stored_cache())
    real_run = engine.runner.run

    def huge_answers(caches, hidden, num_outputs, trees=None):
        return [None if h is None else h * 0 + 1e5 for h in real_run(caches, hidden, num_outputs, trees)]

    monkeypatch.setattr(engine.runner, "run", huge_answers)
    turn = a.open()
    out = engine.step(turn, torch.randn(2, HIDDEN), a.length)  # float32 on the wire: 1e5 fits
    assert out.hidden.dtype == torch.float32 and torch.isfinite(out.hidden).all()
    with pytest.raises(InvalidArgument, match=r"overflows to inf/NaN in float16, the dtype the step was sent in.*"
                                              "nothing was committed"):
        engine.step(turn, torch.randn(1, HIDDEN, dtype=torch.float16), a.length + 2)
    assert turn.status is TurnStatus.FAILED
    with pytest.raises(Aborted, match="this turn failed"):
        engine.commit(turn)
    engine.close_turn(turn)
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert_same(snapshot(a.stored_cache()), committed, "the committed state")
    turn = a.open()
    out = engine.step(turn, torch.randn(1, HIDDEN, dtype=torch.float16), a.length)
    assert out.hidden.dtype == torch.float16 and torch.isfinite(out.hidden).all()  # answered in its own dtype
    engine.close_turn(turn)
    assert engine.pool.free_pages == engine.pool.num_pages


def test_keys_or_values_that_overflowed_fail_their_step_even_with_finite_outputs(engine):
    """The runner screens what a batch wrote through one float32 sum per layer, and only when the screen
    fails reads each step's new keys and values back: the step that holds an inf is refused, its neighbour
    in the batch is not."""
    a, b = Client(engine, 1), Client(engine, 2)
    ta, tb = a.open(), b.open()
    a.step(ta, 3)
    b.step(tb, 3)
    batch = SimpleNamespace(sequences=[ta.cache, tb.cache], new_tokens=[3, 3],
                            kv_sums=[torch.tensor(1.0), torch.tensor(2.0)])
    outputs, bounds = torch.zeros(6, HIDDEN), [0, 3, 6]
    assert engine.runner._finite_steps(batch, outputs, bounds) == [True, True]
    last = engine.kv.num_layers - 1
    page, offset = tb.cache.pages[0], 2
    engine.kv.k[last][page, offset, 0, 0] = float("-inf")  # attention may well ignore a key like this one
    assert engine.runner._finite_steps(batch, outputs, bounds) == [True, True]  # the screen passed: no read-back
    batch.kv_sums.append(torch.tensor(float("-inf")))
    assert engine.runner._finite_steps(batch, outputs, bounds) == [True, False]
    outputs[1, 5] = float("nan")
    assert engine.runner._finite_steps(batch, outputs, bounds) == [False, False]
    engine.close_turn(ta)
    engine.close_turn(tb)
    assert engine.pool.free_pages == engine.pool.num_pages
