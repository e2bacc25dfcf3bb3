"""The engine's stored cache stays true: after every commit the cache reloaded from the store equals the live
cache bit for bit, over random step sizes, truncations and window slides, on both store backends (a property
test, seeded), and after the window slid over a short stored history."""

from __future__ import annotations

import random

import pytest

from tests.server.tiny_engine import Client, assert_same, make_engine, snapshot


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reloaded_cache_equals_the_live_cache_after_every_commit(bundle, store, seed):
    """Random turns (prompt chunks, decode steps, truncations, window slides inside turns and across turn
    boundaries): after every commit the store decrypts to exactly the live cache, and the next turn opens
    on exactly it."""
    engine = make_engine(bundle, store)
    rng = random.Random(seed)
    c = Client(engine, seed)
    counts = {"evictions": 0, "truncations": 0}
    live = None
    try:
        for _ in range(10):
            turn = c.open(reserve_tokens=rng.choice([0, 40, 200]))
            if live is not None:
                assert_same(snapshot(turn.cache), live, "the reopened cache")
            try:
                for _ in range(rng.randint(1, 6)):
                    if c.length and rng.random() < 0.25:
                        c.truncate(turn, rng.randint(1, min(c.length, 12)))
                        counts["truncations"] += 1
                    else:
                        n = rng.choice([1, 1, 1, 2, 3, 7, 13, 21])
                        counts["evictions"] += bool(c.step(turn, n, rng.randint(1, n)).num_evicted)
                c.commit(turn)
                live = snapshot(turn.cache)
                assert_same(snapshot(c.stored_cache()), live, f"the stored cache at version {c.version}")
            finally:
                engine.close_turn(turn)
        assert counts["evictions"] >= 2 and counts["truncations"] >= 1, counts  # the run exercised both
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def test_window_slide_after_a_short_stored_history(engine):
    """The case the issue reproduced: a few stored tokens, then enough one-token steps in one turn that the
    window slides while the cache stays at least as long as what was stored."""
    c = Client(engine)
    c.turn(10)
    turn = c.open(reserve_tokens=60)
    evicted = sum(c.step(turn, 1).num_evicted for _ in range(60))
    assert evicted and c.length >= 10
    c.commit(turn)
    live = snapshot(turn.cache)
    engine.close_turn(turn)
    assert_same(snapshot(c.stored_cache()), live, "the stored cache after a slide")
