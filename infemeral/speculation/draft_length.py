"""Speculative decoding on the client: how many drafts to send, and which of them to keep.

A step sends the last sampled token plus k drafted tokens and gets the model's
output at all k+1 positions back in one round trip. Position i's output is the
target distribution p_i of the token after draft i, so the drafts can be
checked in order:

    keep draft d_i while the token the sampler draws from p_i equals d_i;
    the first draw that differs (or the draw after the last draft) is the next token.

With greedy decoding the draw is the argmax, so this keeps exactly the tokens
that decoding one at a time would produce. With sampling it is the
speculative-sampling rule for a point-mass draft: the draw x ~ p_i equals d_i
with probability p_i(d_i) (accept), and given x != d_i it is distributed as p_i
with d_i removed and renormalised (the residual) — so every emitted token has
the target distribution. Because each position consumes exactly one draw from
the sampler's generator, in order, a fixed seed reproduces the same output
whatever was drafted (the logits of a k+1-position step can differ from
one-at-a-time ones in the last bits, like any change of matmul shape).

The draft length k adapts (`DraftLength`): it weighs the measured acceptance
of recent drafts against the measured cost of extra positions in a step, and
drops to 0 — a plain one-token step — when drafts do not pay for themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Draw = Callable[[torch.Tensor, list[int]], int]  # (logits [vocab], context ids) -> token, e.g. a Sampler


def accept_drafts(draw: Draw, logits: torch.Tensor, context_ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The accepted drafts followed by one token of the model's own.

    `logits` [len(drafts) + 1, vocab]: row i is the model's output after the step's first token
    and drafts[:i]; `context_ids` ends with the step's first token. The sampler sees the context
    including every accepted draft (repetition penalty)."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} rows of logits, got {logits.shape[0]}")
    context = list(context_ids)
    out: list[int] = []
    for i, row in enumerate(logits):
        token = draw(row, context)
        out.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
        context.append(token)
    return out


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
    - cost r: the extra time of one more position in a step, relative to a one-token step,
      fitted from the measured step times (a round trip of 80 ms makes r tiny, a local
      server on a CPU makes it larger). It is a property of the link and the machines, not of
      the text, so a `Client` shares one `StepCost` among its sessions.
    k maximises tokens per unit of time, (1 + a + … + a^k) / (1 + r·k), so it grows while
    drafts are accepted and falls to 0 when they keep failing. A free source (n-grams) is
    still asked at k = 0 and its first draft checked against the token actually sampled
    (`shadow`), so k comes back as soon as drafts would pay again; a costly source is probed
    with one draft now and then, less often after every failed probe."""

    max_draft: int = 8
    cost: StepCost = field(default_factory=lambda: StepCost())
    acceptance: float = 0.5      # prior
    decay: float = 0.9           # weight of history per update
    prior_weight: float = 2.0    # pseudo-events behind the prior acceptance
    probe_every: int = 8         # costly sources: steps at k = 0 between probes (doubles per failure)
    min_gain: float = 0.02       # drafts must promise this much more speed than a plain step

    def __post_init__(self):
        if self.max_draft < 0:
            raise ValueError("max_draft must be >= 0")
        self._accepted = self.acceptance * self.prior_weight
        self._rejected = (1 - self.acceptance) * self.prior_weight
        self._idle = 0
        self._probe_gap = self.probe_every
        self._probing = False

    # -- estimates ------------------------------------------------------------------------------------
    @property
    def estimated_acceptance(self) -> float:
        return self._accepted / max(self._accepted + self._rejected, 1e-9)

    @property
    def estimated_cost_ratio(self) -> float:
        return self.cost.ratio()

    def best_k(self) -> int:
        a, r = self.estimated_acceptance, self.estimated_cost_ratio
        rates = [expected_tokens(a, k) / (1 + r * k) for k in range(self.max_draft + 1)]
        k = max(range(len(rates)), key=rates.__getitem__)
        return k if rates[k] > rates[0] * (1 + self.min_gain) else 0

    # -- the loop's calls -----------------------------------------------------------------------------
    def choose(self, is_free: bool = True) -> int:
        """How many drafts to ask the source for in this step."""
        k = self.best_k()
        if k > 0 or is_free:
            self._idle = 0
            return k
        self._idle += 1
        if self._idle >= self._probe_gap:
            self._idle, self._probing = 0, True
            return 1
        return 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """A verified step: `num_accepted` of its `num_drafted` drafts were kept."""
        if num_drafted == 0:
            return
        self._decay()
        self._accepted += num_accepted
        self._rejected += num_accepted < num_drafted
        if self._probing and num_accepted == 0:
            self._probe_gap = min(self._probe_gap * 2, 256)  # a failed probe: wait longer for the next
        elif self.best_k() > 0:
            self._probe_gap = self.probe_every
        self._probing = False

    def shadow(self, was_right: bool) -> None:
        """A draft that was proposed but not sent turned out right or wrong."""
        self._decay()
        self._accepted += was_right
        self._rejected += not was_right

    def step_time(self, num_tokens: int, seconds: float) -> None:
        """The measured time of one step of `num_tokens` positions (round trip and client work)."""
        self.cost.add(num_tokens, seconds)

    def _decay(self) -> None:
        self._accepted *= self.decay
        self._rejected *= self.decay


class StepCost:
    """What one more position in a step costs, relative to a one-token step: r = b / (a + b) from a
    running weighted least-squares fit of step time t ≈ a + b·n over recent steps (older ones fade).

    Until the steps seen vary enough in size to fit a slope, the prior holds: on a 2-core CPU
    serving the default model locally a step of 9 positions took about twice one of 1 (r ≈ 0.1);
    over a WAN the round trip makes r much smaller. Safe to share between threads."""

    def __init__(self, prior: float = 0.1, decay: float = 0.98, min_spread: float = 0.5):
        self.prior, self.decay, self.min_spread = prior, decay, min_spread
        self.w = self.n = self.t = self.nn = self.nt = 0.0
        self._lock = threading.Lock()

    def add(self, n: int, t: float) -> None:
        d = self.decay
        with self._lock:
            self.w, self.n, self.t = self.w * d + 1, self.n * d + n, self.t * d + t
            self.nn, self.nt = self.nn * d + n * n, self.nt * d + n * t

    def ratio(self) -> float:
        with self._lock:
            w, n, t, nn, nt = self.w, self.n, self.t, self.nn, self.nt
        if w < 4:
            return self.prior
        mean_n, mean_t = n / w, t / w
        var = nn / w - mean_n ** 2
        if var < self.min_spread ** 2 or mean_t <= 0:
            return self.prior  # all steps about the same size: the slope is unknown
        slope = (nt / w - mean_n * mean_t) / var
        one = mean_t + slope * (1 - mean_n)  # predicted time of a 1-token step
        if one <= 0:
            return self.prior
        return min(max(slope / one, 0.0), 1.0)
