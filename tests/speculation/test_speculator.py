"""Choosing the draft source step by step (`--speculate auto`), on a simulated link with a simulated clock.

Sources guess a known sequence right with a set probability; a costly source advances the clock by
its cost per draft token; a step costs a round trip plus a cost per position. `auto` must come within
a few percent of the best single source in every regime, and never fall behind prompt lookup alone.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from infemeral.speculation import speculator as speculator_module
from infemeral.speculation.source import FirstOf, session_sources
from infemeral.speculation.speculator import Speculator
from infemeral.speculation.step_cost import StepCost


class Clock:
    def __init__(self):
        self.t = 0.0

    def perf_counter(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(speculator_module, "time", SimpleNamespace(perf_counter=c.perf_counter))
    return c


class Guesser:
    """Drafts the sequence 0, 1, 2, …: after a context of length n the truth is n, n+1, …; each draft is right
    with probability `right` (given the one before), proposes only at a share `proposes` of positions, and
    costs `seconds` per draft token."""

    def __init__(self, name: str, clock: Clock, *, right: float, proposes: float = 1.0, seconds: float = 0.0,
                 seed: int = 0):
        self.name, self.clock = name, clock
        self.right, self.proposes, self.seconds, self.seed = right, proposes, seconds, seed
        self.is_free = seconds == 0

    def propose(self, context, max_draft):
        n = len(context)
        rng = random.Random(self.seed * 1_000_003 + n)
        if rng.random() >= self.proposes:
            return []
        self.clock.t += self.seconds * max_draft
        drafts = []
        for j in range(max_draft):
            drafts.append(n + j if rng.random() < self.right else -1)
        return drafts


def verify(spec: Speculator, proposal, context: list[int]) -> list[int]:
    """The model's answer to a step carrying `proposal` after `context` (the truth after n tokens is n, n+1, …):
    the drafts up to the first wrong one and the model's own token, reported to `spec` and added to `context`."""
    n = len(context)
    accepted = next((j for j, d in enumerate(proposal.drafts) if d != n + j), len(proposal.drafts))
    new = list(range(n, n + accepted + 1))
    spec.verified(proposal, new)
    context += new
    return new


def tokens_per_second(clock: Clock, sources: list, *, rtt: float, per_position: float, tokens: int = 600) -> float:
    spec = Speculator(sources, {}, 8, StepCost())
    start, done = clock.t, 0
    context = [0]
    while done < tokens:
        proposal = spec.propose(context, 8)
        clock.t += rtt + per_position * (1 + len(proposal.drafts))
        done += len(verify(spec, proposal, context))
    return done / (clock.t - start)


REGIMES = {
    # open chat over a WAN: lookup rarely proposes, a cheap head is often right
    "chat-wan": dict(rtt=0.080, per_position=0.002, lookup=dict(right=0.8, proposes=0.1),
                     head=dict(right=0.7, seconds=0.002)),
    # a local server on a slow laptop: a draft token of the head costs as much as a whole step
    "costly-head": dict(rtt=0.060, per_position=0.006, lookup=dict(right=0.8, proposes=0.1),
                        head=dict(right=0.6, seconds=0.066)),
    # copying the prompt: lookup proposes everywhere and is nearly always right
    "copy": dict(rtt=0.080, per_position=0.002, lookup=dict(right=0.95, proposes=1.0),
                 head=dict(right=0.6, seconds=0.002)),
    # a head that is always wrong
    "useless-head": dict(rtt=0.020, per_position=0.010, lookup=dict(right=0.7, proposes=0.3),
                         head=dict(right=0.0, seconds=0.001)),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_auto_matches_the_best_source_and_never_falls_behind_lookup(clock, regime):
    r = REGIMES[regime]
    make = lambda: (Guesser("ngram", clock, seed=1, **r["lookup"]),  # noqa: E731
                    Guesser("head", clock, seed=2, **r["head"]))
    link = dict(rtt=r["rtt"], per_position=r["per_position"])
    lookup, head = make()
    lookup_only = tokens_per_second(clock, [lookup], **link)
    head_only = tokens_per_second(clock, [make()[1]], **link)
    auto = tokens_per_second(clock, list(make()), **link)
    assert auto >= 0.95 * max(lookup_only, head_only), (auto, lookup_only, head_only)
    assert auto >= 0.97 * lookup_only


def test_auto_over_the_wan_gains_from_the_head(clock):
    r = REGIMES["chat-wan"]
    link = dict(rtt=r["rtt"], per_position=r["per_position"])
    lookup_only = tokens_per_second(clock, [Guesser("ngram", clock, seed=1, **r["lookup"])], **link)
    auto = tokens_per_second(clock, [Guesser("ngram", clock, seed=1, **r["lookup"]),
                                     Guesser("head", clock, seed=2, **r["head"])], **link)
    assert auto > 1.5 * lookup_only


def test_a_session_learns_per_source_and_the_link_is_shared(clock):
    lengths: dict = {}
    cost = StepCost()
    sources = [Guesser("ngram", clock, right=0.9, proposes=0.5), Guesser("head", clock, right=0.5, seconds=0.001)]
    spec = Speculator(sources, lengths, 8, cost)
    for n in range(1, 40):
        proposal = spec.propose(list(range(n)), 8)
        clock.t += 0.05
        spec.verified(proposal, [n])
    assert set(lengths) == {"ngram", "head"} and lengths["ngram"].cost is lengths["head"].cost is cost
    assert lengths["head"].draft_seconds > 0 and lengths["ngram"].draft_seconds == 0


def test_auto_without_a_head_or_draft_model_is_prompt_lookup():
    assert [s.name for s in session_sources("auto")] == [s.name for s in session_sources("ngram")] == ["ngram"]
    answers = SimpleNamespace(name="answers", is_free=True, propose=lambda c, k: [])
    head = SimpleNamespace(name="head", is_free=False, propose=lambda c, k: [])
    auto = session_sources("auto", answers, None, head)
    assert isinstance(auto[0], FirstOf) and [s.name for s in auto] == ["ngram+answers", "head"]
    assert session_sources("head", answers, None, head) == [head]
    assert session_sources("off", answers, None, head) == []


def test_a_new_session_starts_from_what_earlier_sessions_learnt(clock):
    """A costly source drafts one token until its cost is known; what a client learnt of a source (acceptance,
    cost per draft token) is where its next session starts, so a useless head is not tried again blind."""
    def sources():
        return [Guesser("ngram", clock, right=0.8, proposes=0.0), Guesser("head", clock, right=0.0, seconds=0.05)]

    cost, history = StepCost(), {}
    cost.add(1, 0.02)  # a plain step was timed: drafts are weighed against it
    first = Speculator(sources(), {}, 8, cost, history).propose([0, 1, 2], 8)
    assert first.source == "head" and len(first.drafts) == 1  # unmeasured: one draft, which measures it
    spec = Speculator(sources(), {}, 8, cost, history)
    for n in range(1, 30):
        proposal = spec.propose(list(range(n)), 8)
        clock.t += 0.02
        spec.verified(proposal, [n])
    assert history["head"].acceptance < 0.4 and history["head"].draft_seconds == pytest.approx(0.05), history
    again = Speculator(sources(), {}, 8, cost, history).propose([0, 1, 2], 8)
    assert again.drafts == []
    blind = Speculator(sources(), {}, 8, cost).propose([0, 1, 2], 8)
    assert blind.source == "head" and blind.drafts  # without the history it tries the head again


def test_a_plain_step_is_timed_before_any_step_carries_drafts(clock):
    """What drafts save is weighed against a one-token step, so one is timed first — and again once the last
    has faded — even where a source would draft at every step: steps of 2 to 9 positions alone show nothing
    of what a plain step costs (on a CPU the second position alone costs a quarter of a step)."""
    cost = StepCost(decay=0.9)
    spec = Speculator([Guesser("ngram", clock, right=0.9)], {}, 8, cost)
    sizes, context = [], [0]
    while len(sizes) < 80:
        proposal = spec.propose(context, 8)
        clock.t += 0.172 if not proposal.drafts else 0.215 + 0.005 * (len(proposal.drafts) - 1)
        verify(spec, proposal, context)
        sizes.append(len(proposal.drafts) + 1)
    assert sizes[0] == 1 and all(n > 1 for n in sizes[1:25])
    plain = [i for i, n in enumerate(sizes) if n == 1]
    assert len(plain) > 1 and all(b - a < 40 for a, b in zip(plain, plain[1:]))  # timed again, now and then
    assert sizes.count(1) < 0.1 * len(sizes)


class CatchingUp(Guesser):
    """A draft model: before drafting it reads every token verified since it last drafted, at `catch_up` seconds
    a token, and reports what its proposal would have cost with its state current (`last_seconds`), as
    DraftModel does."""

    def __init__(self, *args, catch_up: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.catch_up, self.read, self.last_seconds = catch_up, 0, None

    def propose(self, context, max_draft):
        self.clock.t += self.catch_up * max(len(context) - 1 - self.read, 0)
        drafts = super().propose(context, max_draft)
        self.read = len(context) + len(drafts) - 1
        self.last_seconds = self.seconds * max_draft
        return drafts


@pytest.mark.parametrize("rtt", [0.0, 0.080])
def test_auto_keeps_up_with_a_draft_model_that_catches_up_after_idling(clock, rtt):
    """The packaged model drafting for itself on the server's CPU: nearly always right, but a draft token costs
    half a step and, chosen after other sources' steps, it first reads every token verified meanwhile (not
    charged to its drafts, nor weighed by auto). On a local link it gains nothing over prompt lookup, over a WAN
    it is the best source there is: auto keeps up with the better of the two on both."""
    step = dict(rtt=rtt + 0.09, per_position=0.01)  # a step: its round trip, the served model, each position
    make = lambda: (Guesser("ngram", clock, seed=1, right=0.8, proposes=0.1),  # noqa: E731
                    CatchingUp("draft", clock, seed=2, right=0.95, seconds=0.05, catch_up=0.02))
    lookup_only = tokens_per_second(clock, [make()[0]], **step)
    draft_only = tokens_per_second(clock, [make()[1]], **step)
    auto = tokens_per_second(clock, list(make()), **step)
    assert auto >= 0.97 * lookup_only
    assert auto >= 0.95 * max(lookup_only, draft_only), (auto, lookup_only, draft_only)


def short_sessions_tokens_per_second(clock: Clock, make_sources, *, step: float, sessions: int = 10,
                                     prompt: int = 60, tokens: int = 48) -> float:
    """Tokens/s over `sessions` sessions of one client (one link, one history), each a new conversation: a prompt
    of `prompt` tokens, then `tokens` generated ones, each step costing `step` plus a tenth of it per draft."""
    cost, history = StepCost(), {}
    start, done = clock.t, 0
    for _ in range(sessions):
        spec = Speculator(make_sources(), {}, 8, cost, history)
        context = list(range(prompt))
        for _ in range(tokens):
            proposal = spec.propose(context, 8)
            clock.t += step * (1 + 0.1 * len(proposal.drafts))
            done += len(verify(spec, proposal, context))
    return done / (clock.t - start)


def test_a_draft_model_dear_to_wake_is_not_probed_in_short_sessions(clock):
    """A draft model's first probe in a session reads the whole prompt first: on a local link that costs several
    steps, and a session of 48 tokens never repays it. Probes take at most a small share of the session's time,
    catch-up included, so auto with such a draft model stays level with prompt lookup alone; without the budget
    (every session probing after 8 steps) it fell 12% behind."""
    make = lambda: [Guesser("ngram", clock, seed=1, right=0.8, proposes=0.1),  # noqa: E731
                    CatchingUp("draft", clock, seed=2, right=0.95, seconds=0.05, catch_up=0.005)]
    lookup_only = short_sessions_tokens_per_second(clock, lambda: make()[:1], step=0.07)
    auto = short_sessions_tokens_per_second(clock, make, step=0.07)
    assert auto >= 0.97 * lookup_only, (auto, lookup_only)
