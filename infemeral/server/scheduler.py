"""Which waiting steps run in the next forward pass, and what each turn may hold in the page pool.

The scheduler decides; it never runs the model. Steps wait in arrival order
and are taken first come, first served until the batch's token budget is
spent (a step that waits for pages keeps its place in line, so nothing
starves). Before a step joins a batch its turn's window slides — an explicit
step: the oldest pages after the sinks are evicted and the survivors
re-keyed — and pages are reserved for its new positions. A turn was granted a
page quota when it opened, so within it admission always succeeds; past it a
step waits (bounded) for spare pages, then fails. A turn that declares nothing
(reserve_tokens 0) is granted room for `default_reserve_tokens` more, not a
whole window: past that it grows only into spare pages, so a few undeclared
turns cannot take the pool from everyone else.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from infemeral.errors import Aborted, StatusError
from infemeral.kvcache.paged import PoolExhausted
from infemeral.kvcache.window import WindowPolicy, apply_window
from infemeral.server.config import DEFAULT_RESERVE_TOKENS
from infemeral.server.pacing import Pacer
from infemeral.server.turn import Turn


class Admission(enum.Enum):
    ADMIT = "admit"  # pages are reserved: the step joins this batch
    WAIT = "wait"    # no pages yet: try again next round
    FAIL = "fail"    # refused: the step's error says why


@dataclass(eq=False)
class StepRequest:
    """One step of one turn, from its arrival to its answer."""

    turn: Turn
    hidden: Any                 # [num_tokens, hidden_size]; only the model runner looks inside
    num_tokens: int
    num_outputs: int
    num_evicted: int            # validated against the window when the step arrived
    answer_dtype: Any = None    # the dtype the answer goes back in (the step's own); None: the server's
    parents: list[int] | None = None  # a draft tree's parent rows (checked on arrival); None: a chain
    future: Future = field(default_factory=Future)
    is_started: bool = False    # its window has slid; it cannot be undone
    waiting_since: float | None = None
    error: StatusError | None = None
    arrived_at: float = 0.0


@dataclass
class Schedule:
    batch: list[StepRequest]   # run these together now
    failed: list[StepRequest]  # answer these with their error


class Scheduler:
    def __init__(self, window: WindowPolicy, inv_freq, max_batch_tokens: int, admission_wait: float,
                 clock: Callable[[], float] = time.monotonic, max_batch_hold: float = 0.0,
                 default_reserve_tokens: int = DEFAULT_RESERVE_TOKENS):
        self.window = window
        self.default_reserve_tokens = default_reserve_tokens
        self.inv_freq = inv_freq  # pure RoPE angles for re-keying after an eviction (None without a window)
        self.max_batch_tokens = max_batch_tokens
        self.admission_wait = admission_wait
        self.clock = clock
        self.waiting: deque[StepRequest] = deque()
        self.pacer = Pacer(max_batch_hold, clock)

    # -- turns -------------------------------------------------------------------------------------
    def quota_tokens(self, length: int, reserve_tokens: int) -> int:
        """Most positions a turn that opens at `length` may hold: what its client declared it may add, or,
        declaring nothing, `default_reserve_tokens`. Never more than a window."""
        if reserve_tokens <= 0:
            reserve_tokens = self.default_reserve_tokens
        return min(self.window.max_context, length + max(1, reserve_tokens))

    @property
    def is_pacing(self) -> bool:
        """Whether the pacer keeps anything about turns (only when batch holding is on)."""
        return self.pacer.is_on

    def forget(self, turn: Turn) -> None:
        """The turn closed (called on the worker, after its last step)."""
        self.pacer.forget(turn)

    # -- steps -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, step: StepRequest) -> None:
        step.arrived_at = self.clock()
        self.pacer.arrived(step.turn)
        self.waiting.append(step)

    def hold_until(self) -> float | None:
        """When to run the waiting steps, if they should wait for turns about to send theirs (see pacing.py)."""
        if not self.waiting:
            return None
        return self.pacer.hold_until([s.turn for s in self.waiting], min(s.arrived_at for s in self.waiting))

    def ran(self, batch: list[StepRequest], seconds: float) -> None:
        """A forward pass of `seconds` answered `batch`."""
        self.pacer.answered([s.turn for s in batch], seconds)

    def schedule(self) -> Schedule:
        """First come, first served under the token budget (a batch always takes at least one step)."""
        batch, failed, still_waiting, tokens = [], [], [], 0
        while self.waiting and (not batch or tokens + self.waiting[0].num_tokens <= self.max_batch_tokens):
            step = self.waiting.popleft()
            admission = self.admit(step)
            if admission is Admission.ADMIT:
                batch.append(step)
                tokens += step.num_tokens
            elif admission is Admission.WAIT:
                still_waiting.append(step)
            else:
                failed.append(step)
        self.waiting.extendleft(reversed(still_waiting))  # steps waiting for pages keep their place in line
        return Schedule(batch, failed)

    def admit(self, step: StepRequest) -> Admission:
        cache = step.turn.cache
        if step.turn.is_close_requested:  # the stream ended: nobody waits for this step's answer
            step.error = Aborted("the turn was closed before this step ran")
            return Admission.FAIL
        if not step.is_started:
            step.is_started = True
            try:
                self.slide_window(step)
            except StatusError as e:
                step.error = e
                return Admission.FAIL
        try:
            cache.reserve(cache.length + step.num_tokens)
        except PoolExhausted as e:
            now = self.clock()
            step.waiting_since = step.waiting_since if step.waiting_since is not None else now
            if now - step.waiting_since < self.admission_wait:
                return Admission.WAIT
            step.error = PoolExhausted(
                f"this turn grew past the {cache.quota_tokens} tokens it reserved when it opened, and the "
                "server's KV pool has no spare pages; retry the turn in a few seconds (declaring a larger "
                f"reserve_tokens), or wait for other turns to end ({e.message})")
            return Admission.FAIL
        return Admission.ADMIT

    def slide_window(self, step: StepRequest) -> int:
        """Evict what the window drops before this step (agreed with the client when the step arrived)."""
        if not step.num_evicted:
            return 0
        evicted = apply_window(step.turn.cache, self.window, step.num_tokens, self.inv_freq)
        if evicted != step.num_evicted:  # the cache changed since the step was checked: a bug, not bad input
            raise Aborted(f"the window evicted {evicted} tokens, not the {step.num_evicted} agreed with the client")
        return evicted
