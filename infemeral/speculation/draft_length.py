"""How many drafts the next step should carry (docs/design.md §9).

The draft length k adapts: it weighs the measured acceptance of recent drafts
against the measured cost of extra positions in a step (`StepCost`), and drops
to 0 — a plain one-token step — when drafts do not pay for themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infemeral.speculation.step_cost import StepCost
from infemeral.speculation.tree import TreeSize


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a step yields with k drafts if each is accepted with probability a (given the ones before):
    1 + a + a² + … + a^k."""
    return sum(acceptance ** i for i in range(num_drafts + 1))


@dataclass
class DraftLength:
    """Adaptive k: how many drafts the next step should carry.

    Two running estimates, both decaying so the choice follows the text:
    - acceptance a: accepted drafts / (accepted + rejections) — the chance a draft is right
      given the previous one was (the geometric model);
    - the time of a step of k + 1 positions relative to a one-token step, s(k + 1), from the
      measured step times per size (`StepCost`: a round trip of 80 ms makes extra positions
      cheap, a local server on a CPU dear). It is a property of the link and the machines, not
      of the text, so a `Client` shares one `StepCost` among its sessions.
    k maximises tokens per unit of time, (1 + a + … + a^k) / (s(k + 1) + c·k), so it grows while
    drafts are accepted and falls to 0 when they keep failing; c is what drafting one token costs
    the laptop relative to a one-token step (`drafted`: 0 for a free source, the measured time of
    a draft head or draft model otherwise). A free source (n-grams) is
    still asked at k = 0 and its first draft checked against the token actually sampled
    (`shadow`), so k comes back as soon as drafts would pay again; a costly source is probed
    with one draft now and then, less often after every probe that shows it still does not pay
    (a wrong draft, or a right one whose cost outweighs it), and never beyond a budget: all its
    probes together may take at most `probe_budget` of the session's time. A probe's real cost
    includes what the source first reads to catch up with the conversation (a draft model reads
    the whole prompt at a session's first probe), which is not a cost per draft token and so
    appears nowhere else; measured, it keeps a source that is dear to wake from being probed in
    sessions too short to repay it."""

    max_draft: int = 8
    cost: StepCost = field(default_factory=lambda: StepCost())
    acceptance: float = 0.5      # prior
    decay: float = 0.9           # weight of history per update
    prior_weight: float = 2.0    # pseudo-events behind the prior acceptance
    probe_every: int = 8         # costly sources: steps at k = 0 between probes (doubles per failure)
    min_gain: float = 0.02       # drafts must promise this much more speed than a plain step
    probe_budget: float = 0.02   # costly sources: the share of the session's time its probes may take

    def __post_init__(self):
        if self.max_draft < 0:
            raise ValueError("max_draft must be >= 0")
        self._accepted = self.acceptance * self.prior_weight
        self._rejected = (1 - self.acceptance) * self.prior_weight
        self._idle = 0
        self._probe_gap = self.probe_every
        self._probing = False
        self.draft_seconds = 0.0  # measured seconds per drafted token, a running mean (0 until measured)
        self.probe_seconds = 0.0  # what the last probe took, catch-up included (0 until measured)
        self._elapsed = 0.0       # the session's time in steps and drafting, as `spent` reports it
        self._probes_took = 0.0   # what this session's probes took together
        self.tree = TreeSize(self.cost)  # a source that drafts trees: how many nodes a step carries

    # -- estimates ------------------------------------------------------------------------------------
    @property
    def estimated_acceptance(self) -> float:
        return self._accepted / max(self._accepted + self._rejected, 1e-9)

    @property
    def estimated_draft_cost(self) -> float:
        """Drafting one token, relative to a one-token step (0 for a free source or before any measurement)."""
        if not self.draft_seconds:
            return 0.0
        one = self.cost.one_step()
        return self.draft_seconds / one if one else 0.0

    def rate(self, k: int) -> float:
        """Tokens per unit of time with k drafts, relative to a plain one-token step."""
        a, c = self.estimated_acceptance, self.estimated_draft_cost
        return expected_tokens(a, k) / (self.cost.relative(k + 1) + c * k)

    def best_k(self, limit: int | None = None) -> int:
        """The k (at most `limit`, if given) that maximises `rate`, or 0 if no k beats a plain step."""
        top = self.max_draft if limit is None else max(min(self.max_draft, limit), 0)
        rates = [self.rate(k) for k in range(top + 1)]
        k = max(range(len(rates)), key=rates.__getitem__)
        return k if rates[k] > rates[0] * (1 + self.min_gain) else 0

    # -- the loop's calls -----------------------------------------------------------------------------
    def choose(self, is_free: bool = True) -> int:
        """How many drafts to ask the source for in this step."""
        k = self.best_k()
        if k > 0 or is_free:
            self._idle = 0
            return k
        return 1 if self.probe() else 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """A verified step: `num_accepted` of its `num_drafted` drafts were kept."""
        if num_drafted == 0:
            return
        self._decay()
        self._accepted += num_accepted
        self._rejected += num_accepted < num_drafted
        pays = self.best_k() > 0
        if self._probing and (num_accepted == 0 or not pays):
            # a failed probe, or a right draft that still does not pay for what drafting costs here: wait
            # longer for the next (each probe pays the source's cost, and a catch-up after idling besides)
            self._probe_gap = min(self._probe_gap * 2, 256)
        elif pays:
            self._probe_gap = self.probe_every
        self._probing = False

    def shadow(self, was_right: bool) -> None:
        """A draft that was proposed but not sent turned out right or wrong."""
        self._decay()
        self._accepted += was_right
        self._rejected += not was_right

    def probe(self) -> bool:
        """For a costly source that is not drafting: whether this step should carry one draft of it, to learn
        whether it would pay again (a probe every `probe_every` steps, rarer after every failed probe, and
        only while the session's probes, this one counted at what the last one took, stay within the budget)."""
        self._idle += 1
        affordable = self._probes_took + self.probe_seconds <= self.probe_budget * self._elapsed
        if self._idle >= self._probe_gap and affordable:
            self._idle, self._probing = 0, True
            return True
        return False

    @property
    def is_probing(self) -> bool:
        """Whether the step being drafted is a probe (until its verdict comes back)."""
        return self._probing

    def probed(self, seconds: float) -> None:
        """The probe took `seconds` on the laptop, everything included."""
        self.probe_seconds = seconds
        self._probes_took += seconds

    def spent(self, seconds: float) -> None:
        """The session spent `seconds` in a step and its drafting: the time the probe budget is a share of."""
        self._elapsed += seconds

    def drafted(self, num_tokens: int, seconds: float) -> None:
        """Drafting `num_tokens` tokens took `seconds` on the laptop."""
        if num_tokens > 0:
            per = seconds / num_tokens
            self.draft_seconds = per if not self.draft_seconds else 0.7 * self.draft_seconds + 0.3 * per

    def step_time(self, num_tokens: int, seconds: float) -> None:
        """The measured time of one step of `num_tokens` positions (round trip and client work)."""
        self.cost.add(num_tokens, seconds)

    def _decay(self) -> None:
        self._accepted *= self.decay
        self._rejected *= self.decay

    @classmethod
    def after(cls, history: "SourceHistory", cost: StepCost) -> "DraftLength":
        """A new session's length for a source: its prior acceptance and cost per draft token are what the
        client learnt of that source in its earlier sessions."""
        length = cls(cost=cost, acceptance=history.acceptance)
        length.draft_seconds, length.probe_seconds = history.draft_seconds, history.probe_seconds
        return length


@dataclass
class SourceHistory:
    """What a client learnt of one draft source over its sessions: the acceptance its drafts had lately,
    what one draft token costs the laptop and what a probe of it took. A new session starts from it
    instead of a blind prior — which matters where sessions are short (an endpoint answering one request
    per session) — and then follows its own text."""

    acceptance: float = 0.5
    draft_seconds: float = 0.0
    probe_seconds: float = 0.0  # what its last probe took, catch-up included

    def learn(self, length: DraftLength) -> None:
        self.acceptance = length.estimated_acceptance
        if length.draft_seconds:
            self.draft_seconds = length.draft_seconds
        if length.probe_seconds:
            self.probe_seconds = length.probe_seconds
