"""What a step of n positions costs, relative to a one-token step, learnt from measured step times.

A property of the link and the machines, not of the text: a `Client` shares
one `StepCost` among its sessions.
"""

from __future__ import annotations

import threading


class StepCost:
    """The time of a step of n positions relative to a one-token step, from running means per step size.

    Step time is not a line in n. On a CPU the second position moves every product from a matrix-vector to
    a matrix-matrix kernel, and further positions then cost little (the default model served in float32 on
    the loaded 2-core machine, 80 ms RTT: 172 ms for 1 position, 215 for 2, 238 for 5, 261 for 9). A line
    fitted through steps of mostly 1 and 2 positions charges that jump to every position (0.27 of a step
    each, where 0.04 is right past the second), so a draft source was never given more than one draft and
    paid the jump for a single token; fitted through steps of 2 to 5 positions it misses the jump and keeps
    drafting where drafts do not pay. So each size keeps its own mean (older steps fade). A size without a
    recent measurement costs what lies between its measured neighbours, and past the largest measured size
    as much as that size — optimistic: a longer step is tried when it would pay at that price, and then it
    is measured. Everything is relative to a timed one-token step; until there is one (`is_timed(1)`), each
    extra position costs `prior` of a step. Safe to share between threads."""

    def __init__(self, prior: float = 0.1, decay: float = 0.98, min_weight: float = 0.05):
        self.prior, self.decay, self.min_weight = prior, decay, min_weight
        self._sizes: dict[int, list[float]] = {}  # positions -> [faded count of steps, faded sum of seconds]
        self._lock = threading.Lock()

    def add(self, n: int, t: float) -> None:
        with self._lock:
            for size in list(self._sizes):
                held = self._sizes[size]
                held[0] *= self.decay
                held[1] *= self.decay
                if held[0] < self.min_weight:
                    del self._sizes[size]
            held = self._sizes.setdefault(n, [0.0, 0.0])
            held[0] += 1
            held[1] += t

    def is_timed(self, n: int) -> bool:
        """Whether steps of `n` positions were timed lately (each step fades by `decay` at every later one)."""
        with self._lock:
            return n in self._sizes

    def seconds(self, n: int) -> float | None:
        """The expected seconds of a step of `n` positions; None until a one-token step was timed lately."""
        with self._lock:
            measured = sorted((m, t / w) for m, (w, t) in self._sizes.items())
        if not measured or measured[0][0] != 1:
            return None
        below = [(m, t) for m, t in measured if m <= n]
        above = [(m, t) for m, t in measured if m > n]
        (m0, t0) = below[-1]
        if m0 == n or not above:  # past the largest measured size: as costly as it, until measured
            return t0
        m1, t1 = above[0]
        return t0 + (t1 - t0) * (n - m0) / (m1 - m0)

    def relative(self, n: int) -> float:
        """A step of `n` positions over a one-token step (1 + prior·(n − 1) until a one-token step is timed)."""
        one, many = self.seconds(1), self.seconds(n)
        if not one or many is None:
            return 1 + self.prior * (n - 1)
        return max(many / one, 1.0)

    def one_step(self) -> float | None:
        """The expected seconds of a one-token step (round trip and both halves' work), None until one is timed."""
        return self.seconds(1)
