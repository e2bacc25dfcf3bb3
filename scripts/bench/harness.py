"""What every section shares: a clock, summary statistics, interleaving, machine load, and targets.

Speed is only ever reported as a ratio against a baseline measured in the same run, with baseline and
subject interleaved (`interleave`) so that a burst of load from other processes hits both alike.
`MachineLoad` records how much of the machine other processes took while a section ran, so a report
says how disturbed its timings were. `Target` is the one way a section states a pass/fail goal; it
prints as `TARGET <section> <name>: PASS|MISS (<figure>)`.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

T0 = time.perf_counter()


def now() -> float:
    return time.perf_counter()


def log(msg: str) -> None:
    s = int(now() - T0)
    print(f"[{s // 60:02d}:{s % 60:02d}] {msg}", flush=True)


def finite(xs) -> list[float]:
    return [x for x in xs if x is not None and not math.isnan(x)]


def median(xs) -> float:
    xs = finite(xs)
    return statistics.median(xs) if xs else float("nan")


def mean(xs) -> float:
    xs = finite(xs)
    return statistics.fmean(xs) if xs else float("nan")


def ratio(a: float | None, b: float | None) -> float:
    a = float("nan") if a is None else a
    b = float("nan") if b is None else b
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def fmt(x, spec: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec)


def interleave(reps: int, baseline: Callable[[], object], subject: Callable[[], object]) -> tuple[list, list]:
    """Run baseline and subject `reps` times each, alternating which goes first (AB BA AB ...)."""
    base, subj = [], []
    for rep in range(reps):
        order = ((baseline, base), (subject, subj)) if rep % 2 == 0 else ((subject, subj), (baseline, base))
        for fn, out in order:
            out.append(fn())
    return base, subj


# -- machine load -------------------------------------------------------------------------------
@dataclass
class CpuSnapshot:
    busy: float    # machine-wide busy CPU seconds (/proc/stat)
    steal: float   # seconds the hypervisor took
    total: float   # machine-wide CPU seconds, busy or not
    own: float     # this process's CPU seconds, its waited-for children included
    wall: float

    @classmethod
    def take(cls) -> "CpuSnapshot":
        hz = os.sysconf("SC_CLK_TCK")
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        except (OSError, ValueError, IndexError):
            fields = [0] * 8
        user, nice, system, idle, iowait, irq, softirq, steal = fields
        own = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                  for f in ("ru_utime", "ru_stime"))
        return cls((user + nice + system + irq + softirq) / hz, steal / hz, sum(fields) / hz, own, now())


@dataclass
class MachineLoad:
    """Shares of the machine's CPU time between two snapshots: ours, other processes', the hypervisor's."""

    own_share: float
    other_share: float
    steal_share: float
    seconds: float
    loadavg: float

    @classmethod
    def between(cls, a: CpuSnapshot, b: CpuSnapshot, extra_own: float = 0.0) -> "MachineLoad":
        """`extra_own`: CPU seconds of our own processes that rusage cannot see (e.g. clients still running)."""
        total = b.total - a.total
        own = (b.own - a.own) + extra_own
        if total <= 0:
            nan = float("nan")
            return cls(nan, nan, nan, b.wall - a.wall, os.getloadavg()[0])
        other = max(0.0, (b.busy - a.busy) - own)
        return cls(own / total, other / total, (b.steal - a.steal) / total, b.wall - a.wall, os.getloadavg()[0])

    def describe(self) -> str:
        return (f"other processes {fmt(self.other_share * 100, '.0f')}% of the CPU, this benchmark "
                f"{fmt(self.own_share * 100, '.0f')}%, steal {fmt(self.steal_share * 100, '.0f')}%, "
                f"load average {self.loadavg:.2f}")


# -- targets ----------------------------------------------------------------------------------
@dataclass
class Target:
    """One goal of a section: `TARGET <section> <name>: PASS|MISS (<figure>)`."""

    section: str
    name: str
    goal: str      # what is demanded, in words (for the report)
    passed: bool
    figure: str    # what was measured, short (goes in the parentheses)
    note: str = ""  # why, when it is a MISS and the reason is known

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "MISS"

    def line(self) -> str:
        return f"TARGET {self.section} {self.name}: {self.verdict} ({self.figure})"


def at_least(section: str, name: str, goal: str, value: float, threshold: float, figure: str,
             note: str = "") -> Target:
    """A target met when `value` >= `threshold` (a NaN value is a MISS)."""
    ok = value is not None and not math.isnan(value) and value >= threshold
    return Target(section, name, goal, ok, figure, note)


def at_most(section: str, name: str, goal: str, value: float, threshold: float, figure: str,
            note: str = "") -> Target:
    ok = value is not None and not math.isnan(value) and value <= threshold
    return Target(section, name, goal, ok, figure, note)
