"""How many CPU threads torch's work runs on: a count held for a block of work, or the faster of one thread and
all of them, measured on the work itself.

Work made of many small operations (a draft head's few small products per draft token, GPTQ's column loop, a
decode step of a small model) waits for every thread at each parallel region. On a CPU that other processes
keep busy that wait is most of its cost and one thread is several times faster; on a quiet machine, or for
large products, all of them are. Which one wins changes with the load, so it is measured where it matters
(figures: docs/benchmarks/cpu_threads.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

T = TypeVar("T")


@contextmanager
def using_threads(count: int | None) -> Iterator[None]:
    """torch on `count` threads inside the block (None or 0: as it is); the caller's count is back after it."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def one_thread(active: bool = True):
    """The block on one thread (when `active`): for loops of operations too small to gain from threads."""
    return using_threads(1 if active else None)


class FasterThreads:
    """The faster of one thread and all of them for a repeated piece of work, measured on its runs: the first
    `trials` run on one thread, the next `trials` on all, and the count with the lower median time (the faster of
    each, for two trials) runs the rest. It measures again every `recheck` runs (0: only on `restart()`), as the
    machine's load changes. With `fixed` (a count), on a device other than the CPU or on a one-thread machine it
    measures nothing: the work runs on `fixed` threads, or as it is.

    Each run sets the count for the work alone and puts the caller's back, so users (sessions drafting, a batch
    of answers) may share one."""

    def __init__(self, device: str | torch.device = "cpu", *, trials: int = 3, recheck: int = 0, fixed: int = 0):
        self.most = torch.get_num_threads()
        self.trials, self.recheck, self.fixed = trials, recheck, fixed
        self.is_measured = torch.device(device).type == "cpu" and not fixed and self.most > 1
        self.chosen: int | None = None if self.is_measured else (fixed or self.most)
        self._previous: int | None = None  # the choice before a restart: what unmeasured work runs on meanwhile
        self._runs = 0
        self._timings: dict[int, list[float]] = {1: [], self.most: []}

    def restart(self) -> None:
        """Measure again from the next run on."""
        if self.is_measured:
            self._previous = self.chosen or self._previous
            self.chosen, self._timings = None, {1: [], self.most: []}

    def run(self, work: Callable[[], T], *, units: Callable[[T], int] | None = None, measured: bool = True) -> T:
        """`work()` on the chosen count, or on the one being tried, timed per `units(result)` (e.g. per draft
        token; default per run). `measured=False`: never a trial, on the current choice (the one before a
        restart while measuring again; all threads before the first)."""
        if not self.is_measured:
            with using_threads(self.fixed):
                return work()
        if not measured:
            with using_threads(self.chosen or self._previous or self.most):
                return work()
        self._runs += 1
        if self.recheck and self._runs % self.recheck == 0:
            self.restart()
        trying = None
        if self.chosen is None:
            trying = 1 if len(self._timings[1]) < self.trials else self.most
        started = time.perf_counter()
        with using_threads(trying or self.chosen):
            result = work()
        if trying is not None:
            seconds = time.perf_counter() - started
            self._timings[trying].append(seconds / max(units(result), 1) if units else seconds)
            if all(len(t) >= self.trials for t in self._timings.values()):
                self.chosen = min(self._timings, key=lambda n: sorted(self._timings[n])[(self.trials - 1) // 2])
        return result

    def choose(self, work: Callable[[], object]) -> int:
        """Run `work` until a count is chosen (2 × `trials` runs when measuring), and return the count."""
        while self.chosen is None:
            self.run(work)
        return self.chosen
