"""When to hold a batch back for a moment: for turns that are about to send their next step.

Sessions decoding together fall into cohorts. While one cohort's forward pass runs, the other's steps
arrive; the worker runs whatever waits, so it alternates between two half batches for ever (measured
on the default model: 8 sessions ran 4 steps per forward pass). One pass over all of them costs much
less than two halves — the weights are read once — so the pacer holds a batch back while turns that the
last pass answered are predicted to come back soon. Each turn's answer-to-next-step gap (its client's
own compute plus the network round trip) is tracked; a batch waits for the turns predicted within a
short limit (at most `max_hold`, and at most half a forward pass) of the moment the worker became free
(or of the oldest waiting step's arrival, if that was later). Turns
whose gap is longer than that (a slow network) are never waited for, and a lone session never waits.
It only decides when a batch starts, never what is in it or what it computes. Off unless the server's
`max_batch_hold` is set; off, it records nothing. On, it knows only the turns that are open: the engine
forgets each turn as it closes (on the worker, after the turn's last step), and a turn not heard from in
`FORGET_SECONDS` is dropped too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

SMOOTHING = 0.3        # weight of the newest sample in the running averages
HOLD_SHARE = 0.5       # a batch waits at most this share of a forward pass
FORGET_SECONDS = 10.0  # an answered turn that has not come back by then is forgotten (it ended)


class Pacer:
    def __init__(self, max_hold: float, clock: Callable[[], float] = time.monotonic):
        self.max_hold = max_hold
        self.clock = clock
        self.forward_seconds: float | None = None     # running average of a forward pass
        self.free_since = 0.0                          # when the last forward pass ended
        self._answered_at: dict[int, float] = {}      # id(turn) -> when its last step was answered
        self._gap: dict[int, float] = {}              # id(turn) -> running average answer -> next step

    @property
    def is_on(self) -> bool:
        return self.max_hold > 0

    @property
    def num_known(self) -> int:
        """Turns it keeps anything about (bounded by the open turns)."""
        return len(self._answered_at.keys() | self._gap.keys())

    def answered(self, turns: Iterable, forward_seconds: float) -> None:
        """A forward pass of `forward_seconds` answered a step of each of `turns`."""
        if not self.is_on:
            return
        now = self.free_since = self.clock()
        for turn in turns:
            self._answered_at[id(turn)] = now
        self.forward_seconds = _average(self.forward_seconds, forward_seconds)

    def arrived(self, turn) -> None:
        """A step of `turn` arrived: learn how long its client took since the last answer."""
        if not self.is_on:
            return
        answered = self._answered_at.pop(id(turn), None)
        if answered is not None:
            self._gap[id(turn)] = _average(self._gap.get(id(turn)), self.clock() - answered)

    def hold_until(self, waiting_turns: Iterable, oldest_arrival: float) -> float | None:
        """The time to start the next batch if it should wait for turns about to return, else None."""
        if not self.is_on or self.forward_seconds is None:
            return None
        now = self.clock()
        for key in [k for k, t in self._answered_at.items() if now - t > FORGET_SECONDS]:
            del self._answered_at[key]
            self._gap.pop(key, None)
        limit = min(self.max_hold, HOLD_SHARE * self.forward_seconds)
        deadline = max(self.free_since, oldest_arrival) + limit
        waiting = {id(t) for t in waiting_turns}
        due = [answered + self._gap[key] for key, answered in self._answered_at.items()
               if key in self._gap and key not in waiting]
        due = [t for t in due if t <= deadline]
        if not due:
            return None
        until = min(deadline, max(due) + 0.1 * limit)  # a little slack for a client running late
        return until if until > now else None

    def forget(self, turn) -> None:
        """The turn closed: nothing about it is needed any more."""
        self._answered_at.pop(id(turn), None)
        self._gap.pop(id(turn), None)


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
