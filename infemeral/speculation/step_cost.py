"""What one more position in a step costs, learnt from measured step times.

A property of the link and the machines, not of the text: a `Client` shares
one `StepCost` among its sessions.
"""

from __future__ import annotations

import threading


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

    def one_step(self) -> float | None:
        """The predicted seconds of a one-token step (round trip and both halves' work), None before any step."""
        with self._lock:
            w, n, t = self.w, self.n, self.t
        if w <= 0:
            return None
        r = self.ratio()
        return (t / w) / (1 + r * (n / w - 1))  # t ≈ one · (1 + r·(n − 1))
