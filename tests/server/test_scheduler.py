"""The scheduler on its own: no threads, no model, a fake clock and a tiny page pool."""

from __future__ import annotations

import os

import pytest
import torch

from infemeral.errors import Aborted
from infemeral.kvcache.paged import KVPages, PagedSequence, PagePool
from infemeral.kvcache.stored import SessionKeys
from infemeral.kvcache.window import WindowPolicy
from infemeral.server.scheduler import Admission, Scheduler, StepRequest
from infemeral.server.turn import Turn

PAGE = 4
WINDOW = WindowPolicy(max_context=24, sink_tokens=2, page_size=PAGE)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_pages: int = 16, budget: int = 8, wait: float = 1.0):
    pool = PagePool(num_pages, PAGE)
    kv = KVPages(num_pages, PAGE, first_layer=0, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)
    clock = Clock()
    return pool, kv, clock, Scheduler(WINDOW, torch.ones(1, dtype=torch.float64), budget, wait, clock)


def new_turn(pool: PagePool, kv: KVPages, quota_tokens: int = 0, length: int = 0) -> Turn:
    sid = os.urandom(16)
    turn = Turn(sid, SessionKeys.derive(sid, os.urandom(32)), PagedSequence(pool, kv))
    if quota_tokens:
        turn.cache.grant(quota_tokens)
    if length:
        turn.cache.reserve(length)
        positions = torch.arange(length, dtype=torch.float32)
        turn.cache.write(0, 0, positions.view(1, -1, 1).expand(1, length, 2), positions.view(1, -1, 1).expand(1, length, 2))
        turn.cache.set_length(length)
    return turn


def step(turn: Turn, num_tokens: int, num_evicted: int = 0) -> StepRequest:
    return StepRequest(turn, None, num_tokens, 1, num_evicted)


def test_first_come_first_served_under_the_token_budget():
    pool, kv, _, scheduler = make(num_pages=64, budget=8)
    steps = [step(new_turn(pool, kv, 32), n) for n in (5, 4, 3, 1)]
    for s in steps:
        scheduler.add(s)
    assert scheduler.schedule().batch == steps[:1]  # 5 + 4 > 8: the 4 waits its turn (no skipping ahead)
    assert scheduler.schedule().batch == steps[1:]  # 4 + 3 + 1 = 8
    big = step(new_turn(pool, kv, 32), 20)  # over the budget on its own: it still runs, alone
    scheduler.add(big)
    scheduler.add(small := step(new_turn(pool, kv, 32), 1))
    assert scheduler.schedule().batch == [big]
    assert scheduler.schedule().batch == [small]
    assert scheduler.num_waiting == 0


def test_within_its_quota_a_step_is_admitted_even_with_no_spare_pages():
    pool, kv, _, scheduler = make(num_pages=4)
    granted = new_turn(pool, kv, quota_tokens=12)  # 3 pages promised
    other = new_turn(pool, kv)
    other.cache.reserve(PAGE)  # takes the only spare page
    assert pool.spare_pages == 0
    s = step(granted, 12)
    assert scheduler.admit(s) is Admission.ADMIT and len(granted.cache.pages) == 3
    assert scheduler.admit(step(other, PAGE + 1)) is Admission.WAIT  # past its (empty) quota: waits


def test_past_its_quota_a_step_waits_then_fails_and_keeps_its_place_meanwhile():
    pool, kv, clock, scheduler = make(num_pages=4, wait=1.0)
    full = new_turn(pool, kv, quota_tokens=12)
    greedy = new_turn(pool, kv, quota_tokens=4)
    scheduler.add(over := step(greedy, 8))  # needs a second page: none spare
    scheduler.add(fine := step(full, 4))
    schedule = scheduler.schedule()
    assert schedule.batch == [fine] and not schedule.failed
    assert list(scheduler.waiting) == [over]
    clock.now = 0.9
    assert scheduler.schedule().batch == [] and list(scheduler.waiting) == [over]
    clock.now = 1.1
    schedule = scheduler.schedule()
    assert schedule.failed == [over] and scheduler.num_waiting == 0
    assert "grew past the 4 tokens it reserved" in over.error.message and over.error.retry_after > 0
    assert len(greedy.cache.pages) == 0  # a refused step takes nothing


def test_the_window_slides_once_as_an_explicit_step():
    pool, kv, clock, scheduler = make(num_pages=7, wait=1.0)
    turn = new_turn(pool, kv, quota_tokens=24, length=22)
    pool.take(pool.spare_pages)  # nothing spare: growth is only possible within the quota
    evict = WINDOW.tokens_to_evict(22, 5)
    assert evict == 4
    s = step(turn, 5, evict)
    assert scheduler.admit(s) is Admission.ADMIT
    assert turn.cache.length == 18 and turn.cache.committed_length == WINDOW.sink_tokens
    _, v = turn.cache.layer_tensors(0)  # values are the old positions: the sinks, then 6.. 21 moved down
    assert v[0, :, 0].tolist() == [0.0, 1.0] + [float(p) for p in range(6, 22)]
    again = step(turn, 1)
    assert scheduler.admit(again) is Admission.ADMIT and turn.cache.length == 18  # no second slide
    pool, kv, _, scheduler = make()
    with pytest.raises(Aborted, match="evicted 0 tokens, not the 4 agreed"):
        scheduler.slide_window(step(new_turn(pool, kv, 24, length=4), 5, 4))


def test_a_step_of_a_turn_being_closed_does_not_start():
    pool, kv, _, scheduler = make()
    turn = new_turn(pool, kv, quota_tokens=8)
    turn.is_close_requested = True
    s = step(turn, 2)
    assert scheduler.admit(s) is Admission.FAIL and "closed" in s.error.message
    assert turn.cache.pages == []


def test_page_quota_of_a_turn():
    _, _, clock, _ = make()
    scheduler = Scheduler(WINDOW, torch.ones(1, dtype=torch.float64), 8, 1.0, clock, default_reserve_tokens=6)
    assert scheduler.quota_tokens(length=10, reserve_tokens=5) == 15
    assert scheduler.quota_tokens(length=10, reserve_tokens=0) == 16  # undeclared: a modest default, not a window
    assert scheduler.quota_tokens(length=0, reserve_tokens=0) == 6
    assert scheduler.quota_tokens(length=20, reserve_tokens=0) == WINDOW.max_context  # never past a window
    assert scheduler.quota_tokens(length=20, reserve_tokens=100) == WINDOW.max_context
    assert scheduler.quota_tokens(length=0, reserve_tokens=1) == 1


def two_cohorts(hold: float = 0.05):
    pool, kv, clock, _ = make(num_pages=64)
    scheduler = Scheduler(WINDOW, torch.ones(1, dtype=torch.float64), 64, 1.0, clock, max_batch_hold=hold)
    return clock, scheduler, [new_turn(pool, kv, 8) for _ in range(4)], [new_turn(pool, kv, 8) for _ in range(4)]


def test_cohorts_merge_when_the_others_are_about_to_send_their_next_step():
    clock, scheduler, a, b = two_cohorts()
    for t in a:
        scheduler.add(step(t, 1))
    first = scheduler.schedule().batch
    clock.now = 0.020
    for t in b:  # B arrives while A's pass runs
        scheduler.add(step(t, 1))
    clock.now = 0.040
    scheduler.ran(first, 0.040)
    assert scheduler.hold_until() is None  # nothing learnt yet about A's clients: B runs at once
    second = scheduler.schedule().batch
    clock.now = 0.050
    for t in a:  # A's clients took 10 ms
        scheduler.add(step(t, 1))
    clock.now = 0.080
    scheduler.ran(second, 0.040)
    assert scheduler.hold_until() is None  # nothing learnt about B's clients yet either
    third = scheduler.schedule().batch
    assert third == [s for s in third if s.turn in a] and len(third) == 4  # the half batches alternate
    clock.now = 0.090
    for t in b:  # B's clients took 10 ms too
        scheduler.add(step(t, 1))
    clock.now = 0.120
    scheduler.ran(third, 0.040)
    # Now B waits, and A (answered just now, 10 ms per client) is due within half a pass: hold for A.
    until = scheduler.hold_until()
    assert until is not None and 0.130 <= until <= 0.120 + 0.020
    clock.now = 0.130
    for t in a:
        scheduler.add(step(t, 1))
    assert scheduler.hold_until() is None  # everyone is here
    assert len(scheduler.schedule().batch) == 8  # one pass for all eight


def test_no_holding_for_far_away_turns_for_a_lone_session_or_when_turned_off():
    for hold, client in ((0.05, 0.200), (0.0, 0.010)):  # a slow network; holding turned off
        clock, scheduler, a, b = two_cohorts(hold)
        for t in a + b:
            scheduler.add(step(t, 1))
        for _ in range(3):
            batch = scheduler.schedule().batch
            assert batch and scheduler.hold_until() is None
            clock.now += 0.040
            scheduler.ran(batch, 0.040)
            clock.now += client
            for s in batch:
                scheduler.add(step(s.turn, 1))
        wait_for = [s.turn for s in scheduler.waiting][:4]
        scheduler.waiting = type(scheduler.waiting)(s for s in scheduler.waiting if s.turn in wait_for)
        assert scheduler.hold_until() is None
    pool, kv, clock, _ = make()
    lone = Scheduler(WINDOW, torch.ones(1, dtype=torch.float64), 64, 1.0, clock, max_batch_hold=0.05)
    turn = new_turn(pool, kv, 8)
    for _ in range(3):
        lone.add(step(turn, 1))
        assert lone.hold_until() is None  # nobody else to wait for
        clock.now += 0.040
        lone.ran(lone.schedule().batch, 0.040)
        clock.now += 0.010


@pytest.mark.parametrize("late, is_held", [(0.0, True), (1 / 1024, False)], ids=["due-at-half-a-pass", "just-after"])
def test_a_held_batch_never_waits_past_half_a_forward_pass(late, is_held):
    """A generous max_batch_hold (1 s) leaves half the measured forward pass as the limit: a turn whose client
    is due exactly half a pass after the worker became free is waited for, until then and no longer; one due
    a moment later is not waited for. (Binary fractions of a second: the boundary is exact.)"""
    forward = 0.0625
    pool, kv, clock, _ = make(num_pages=64)
    scheduler = Scheduler(WINDOW, torch.ones(1, dtype=torch.float64), 64, 1.0, clock, max_batch_hold=1.0)
    near, far = new_turn(pool, kv, 8), new_turn(pool, kv, 8)
    for t in (near, far):
        scheduler.add(step(t, 1))
    clock.now = forward
    scheduler.ran(scheduler.schedule().batch, forward)
    scheduler.add(step(near, 1))  # near's client answers at once
    clock.now += forward / 2 + late  # far's takes half a pass (or a moment more)
    scheduler.add(step(far, 1))
    assert scheduler.hold_until() is None  # both are here
    batch = scheduler.schedule().batch
    clock.now += forward
    scheduler.ran(batch, forward)
    free = clock.now
    scheduler.add(step(near, 1))
    assert scheduler.hold_until() == (free + forward / 2 if is_held else None)


def serve_turns(scheduler: Scheduler, clock: Clock, pool: PagePool, kv: KVPages, num_turns: int) -> None:
    """Turns that open, step a few times, and close (the engine tells the scheduler as each one closes)."""
    for _ in range(num_turns):
        turns = [new_turn(pool, kv, 8) for _ in range(2)]
        for _ in range(3):
            for t in turns:
                scheduler.add(step(t, 1))
            batch = scheduler.schedule().batch
            clock.now += 0.040
            scheduler.ran(batch, 0.040)
            clock.now += 0.005
        for t in turns:
            t.cache.wipe()
            scheduler.forget(t)


def test_the_pacer_keeps_nothing_about_closed_turns():
    """(Old code: with holding off, the default, one entry per turn ever served, never forgotten.)"""
    pool, kv, clock, scheduler = make(num_pages=64)  # holding off
    for t in (new_turn(pool, kv, 8), new_turn(pool, kv, 8)):  # turns still open: nothing recorded either
        scheduler.add(step(t, 1))
        scheduler.ran(scheduler.schedule().batch, 0.040)
    assert not scheduler.is_pacing and scheduler.pacer.num_known == 0
    serve_turns(scheduler, clock, pool, kv, 50)
    assert scheduler.pacer.num_known == 0
    held = Scheduler(WINDOW, torch.ones(1, dtype=torch.float64), 64, 1.0, clock, max_batch_hold=0.05)
    assert held.is_pacing
    open_turn = new_turn(pool, kv, 8)
    held.add(step(open_turn, 1))
    held.ran(held.schedule().batch, 0.040)
    serve_turns(held, clock, pool, kv, 50)
    assert held.pacer.num_known == 1  # only the turn still open
    held.forget(open_turn)
    assert held.pacer.num_known == 0
