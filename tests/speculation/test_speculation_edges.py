"""Edges of the adaptive speculation the simulated sessions pass over: a step cost shared by sessions on
several threads, probes that become frequent again once drafts pay, and a chosen source scored once a step."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import pytest

from infemeral.speculation.draft_length import DraftLength
from infemeral.speculation.speculator import Speculator
from infemeral.speculation.step_cost import StepCost


@pytest.fixture
def frequent_thread_switches():
    """Threads switch every microsecond instead of every 5 ms: a race shows within a few thousand calls."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_a_step_cost_shared_by_sessions_on_several_threads(frequent_thread_switches):
    """A client's sessions run on the endpoint's threads and all time their steps into one StepCost: sizes are
    added and faded out (deleted) while others read the means."""
    cost = StepCost(decay=0.9, min_weight=0.05)  # a size fades out ~28 steps after its last: entries come and go
    errors: list[BaseException] = []

    def session(seed: int) -> None:
        try:
            for i in range(2000):
                cost.add(1 + (7 * i + seed) % 100, 0.1)
                cost.relative(1 + i % 50)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=session, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def steps_until_probe(length: DraftLength, limit: int = 1000) -> int:
    """Steps a costly source that does not pay sits out until it is probed (the probe's step counted)."""
    for n in range(1, limit + 1):
        if length.choose(is_free=False):
            assert length.is_probing
            return n
    raise AssertionError(f"not probed in {limit} steps")


def test_probes_come_often_again_once_drafts_pay():
    """Failed probes double the gap to the next; a probe whose drafts pay again brings it back to `probe_every`,
    so when drafts stop paying later the source is probed soon, not after the gap its old failures grew."""
    length = DraftLength(max_draft=4, probe_every=4)
    length.step_time(1, 0.1)
    length.drafted(1, 0.025)  # a draft token costs a quarter of a step: drafts pay above ~28 % acceptance
    for _ in range(5):
        length.update(4, 0)
    assert length.best_k() == 0
    gaps = []
    for _ in range(3):
        gaps.append(steps_until_probe(length))
        length.update(1, 0)
    assert gaps == [4, 8, 16]
    for _ in range(10):  # probes come right until drafting pays again
        steps_until_probe(length)
        length.update(1, 1)
        if length.best_k() > 0:
            break
    assert length.best_k() > 0
    length.update(4, 0)  # drafting, then a step whose drafts all fail: they stop paying
    assert length.best_k() == 0
    assert steps_until_probe(length) == 4


def test_the_chosen_source_is_scored_once_a_step():
    """Both sources are free: each one's guesses are had first. The chosen one learns from its verified drafts
    (`update`), the other from its first guess (`shadow`); the chosen one's guesses are not checked again as
    a shadow."""
    cost = StepCost()
    cost.add(1, 0.1)  # a plain step was timed: drafts may be sent
    sources = [SimpleNamespace(name="ngram", is_free=True, propose=lambda context, k: [5, 6, 7][:k]),
               SimpleNamespace(name="answers", is_free=True, propose=lambda context, k: [5, 9][:k])]
    lengths: dict[str, DraftLength] = {}
    spec = Speculator(sources, lengths, 8, cost)
    proposal = spec.propose([1, 2, 3, 4], 8)
    assert proposal.source == "ngram" and proposal.drafts == [5, 6, 7]
    spec.verified(proposal, [5, 6, 8])  # two drafts accepted, then the model's own token
    chosen, other = DraftLength(cost=StepCost()), DraftLength(cost=StepCost())
    chosen.update(3, 2)
    other.shadow(True)
    assert lengths["ngram"].estimated_acceptance == pytest.approx(chosen.estimated_acceptance)
    assert lengths["answers"].estimated_acceptance == pytest.approx(other.estimated_acceptance)
