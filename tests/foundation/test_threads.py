"""CPU threads: a count held for a block of work, and the faster of one thread and all (`FasterThreads`), chosen
from the work's own timings. torch's thread count and the clock are stand-ins here, so a choice follows from the
timings given and nothing depends on this machine's load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from infemeral import threads as threads_module
from infemeral.threads import FasterThreads, one_thread, using_threads


@pytest.fixture
def machine(monkeypatch):
    """torch's thread count (2 to start) and a clock that a piece of work advances by what it says it took."""
    state = SimpleNamespace(threads=2, now=0.0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: state.threads)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: setattr(state, "threads", n))
    monkeypatch.setattr(threads_module, "time", SimpleNamespace(perf_counter=lambda: state.now))
    return state


def work_taking(machine, seconds_on: dict[int, list[float]], seen: list[int], result=None):
    """Work that takes the next of `seconds_on[threads]` on the count it runs on, and records that count."""
    def work():
        seen.append(machine.threads)
        machine.now += seconds_on[machine.threads].pop(0)
        return result
    return work


@pytest.mark.parametrize("faster", [1, 2])
def test_the_faster_count_runs_the_rest_and_the_callers_count_comes_back(machine, faster):
    seen = []
    took = {n: [0.001 if n == faster else 0.01] * 10 for n in (1, 2)}
    picker = FasterThreads("cpu")
    work = work_taking(machine, took, seen, result="drafts")
    for _ in range(10):
        assert picker.run(work) == "drafts" and machine.threads == 2
    assert seen[:6] == [1, 1, 1, 2, 2, 2] and set(seen[6:]) == {faster} and picker.chosen == faster


def test_timings_count_per_unit_of_the_result(machine):
    """Drafting times per draft token: all threads drafted 4 tokens in the time one thread drafted 1 in twice over."""
    seen, tokens = [], {1: [1], 2: [1, 2, 3, 4]}
    took = {1: [2.0] * 4, 2: [4.0] * 4}

    def work():
        seen.append(machine.threads)
        machine.now += took[machine.threads].pop(0)
        return tokens[machine.threads]

    picker = FasterThreads("cpu")
    while picker.chosen is None:
        picker.run(work, units=len)
    assert seen == [1, 1, 1, 2, 2, 2] and picker.chosen == 2  # per token: 2 s against 1 s
    assert FasterThreads("cpu").choose(work_taking(machine, {1: [2.0] * 3, 2: [4.0] * 3}, [])) == 1  # per run


@pytest.mark.parametrize("trials, one, all_, chosen", [
    (2, [5.0, 1.0], [2.0, 2.0], 1),            # two trials: the faster of each
    (3, [1.0, 5.0, 5.0], [2.0, 2.0, 2.0], 2),  # three: the median, one lucky run does not decide
])
def test_the_lower_median_of_the_trials_decides(machine, trials, one, all_, chosen):
    assert FasterThreads("cpu", trials=trials).choose(work_taking(machine, {1: one, 2: all_}, [])) == chosen


def test_it_measures_again_after_a_restart_or_every_recheck_runs(machine):
    seen = []
    took = {1: [0.1] * 20, 2: [1.0] * 20}
    picker = FasterThreads("cpu", trials=1, recheck=5)
    work = work_taking(machine, took, seen)
    assert picker.choose(work) == 1  # runs 1 and 2
    picker.restart()
    picker.run(work, measured=False)  # while measuring again, unmeasured work keeps the last choice
    assert seen == [1, 2, 1] and picker.chosen is None
    picker.run(work)  # run 3: a trial again
    picker.run(work)  # run 4: the other trial
    assert seen[3:] == [1, 2] and picker.chosen == 1
    picker.run(work)  # run 5: recheck, a trial on one thread
    picker.run(work)  # and one on all
    assert seen[5:] == [1, 2] and picker.chosen == 1


def test_a_fixed_count_a_gpu_or_one_core_measures_nothing(machine):
    seen = []
    fixed = FasterThreads("cpu", fixed=3)
    assert fixed.choose(lambda: pytest.fail("nothing to measure")) == 3
    fixed.run(lambda: seen.append(machine.threads))
    assert seen == [3] and machine.threads == 2
    gpu = FasterThreads("cuda")
    gpu.run(lambda: seen.append(machine.threads))
    assert seen == [3, 2] and gpu.chosen == 2
    machine.threads = 1
    assert FasterThreads("cpu").choose(lambda: pytest.fail("nothing to measure")) == 1


def test_a_held_count_comes_back_after_an_error(machine):
    with pytest.raises(RuntimeError):
        with using_threads(1):
            assert machine.threads == 1
            raise RuntimeError("the work failed")
    assert machine.threads == 2
    with one_thread(False):
        assert machine.threads == 2
    with one_thread():
        assert machine.threads == 1
    assert machine.threads == 2
