"""One prepared run of every CUDA path of the pod, for a borrowed GPU: each stage on a deadline, results as it goes.

On a lent GPU machine (one H100 or H200, about 15 minutes of device time in all, no network), from the
repository root, with the wheel kit (scripts/gpu_kit.py, in .gpukit/, ignored by git) carried along with the
working tree, and FlashInfer modules compiled by an earlier run in .gpukit/kernels/ if there are any:

    sh .gpukit/install.sh /tmp/site &&
    PYTHONPATH=/tmp/site:$PWD timeout 500 python3 scripts/gpu_lease.py --out "$OUT" --kernel-cache .gpukit/kernels

and here, on a CPU (what CI runs: every stage with tiny shapes, FlashInfer's parts skipped):

    .venv/bin/python scripts/gpu_lease.py --dry-run --out /tmp/gpu-lease

Stages, in order (`--stages` picks some): env (the preflight, scripts/gpu_env.py), kernels (int4/int8 served
linears against bf16 F.linear), attention (FlashInfer against the PyTorch backend, first-call compile times,
batch invariance), self_check (the server's start-up self-checks), exactness (the engine in bf16 on CUDA against
float32 on the CPU, default and 8B shapes), throughput (decode at 1/8/32 sessions against plain transformers),
memory (weights + KV against the README's what-fits table), e2e (a real infemeral-server and client over
loopback), speculation (the default model served on the GPU, a client with the CPU-trained draft head on this
machine's CPU through scripts/delay_proxy.py at 80 ms RTT: chat with speculation against without, greedy
identical; the head is .bundles/draft-head-default, carried along, the model the packaged GGUF). Elsewhere
random weights of the real shapes are drawn on the GPU: nothing big travels. docs/gpu_lease.md says
what comes back and what to carry next time.

Every stage has a deadline, its share of `--budget`; a stage that raises or overruns is recorded as such and the
next one runs. gpu-lease.json and gpu-lease.md are rewritten under --out after every stage (a killed run keeps
what finished), FlashInfer's compiled modules are copied to <out>/kernel-cache, and the run ends with
`TARGET gpu <name>: PASS|MISS (<figure>)` lines. Exit status: 0 every stage ran (or was skipped), 1 a stage
failed or overran, 2 not a CUDA machine (without --dry-run), 3 a stage hung and the run gave up.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import lzma
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402
from bench.harness import Target, at_least, at_most  # noqa: E402
from gpu_workloads import (decode_rate, linear_shapes, llama_config, random_batch, random_layers,  # noqa: E402
                           steps_per_second, synchronize, write_bundle)

from infemeral.layers.stack import head_dim  # noqa: E402

STAGES = ("env", "kernels", "attention", "self_check", "exactness", "throughput", "memory", "e2e", "speculation")
SHARES = {"env": 1, "kernels": 3, "attention": 12, "self_check": 3, "exactness": 7, "throughput": 6, "memory": 3,
          "e2e": 3, "speculation": 8}  # of the budget left, among the stages still to run (time a stage leaves passes on)
MAX_STAGE_SECONDS = {"speculation": 90.0}  # whatever the others leave
SPEC_RTT_MS = 80
GPU_BUDGET, DRY_BUDGET = 420.0, 300.0
MIN_STAGE_SECONDS = 0.5  # a stage given less is skipped
STALL_SECONDS = 30.0     # how long `--inject stall:STAGE` hangs without looking at its deadline
OVERRUN_SIGNAL = signal.SIGUSR1
KERNEL_FILES, KERNEL_FILE_BYTES = 8, 16 << 20  # what comes back of FlashInfer's compiled modules
SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")
PAGE = 16
SELF_CHECK_WINDOW = 64  # every attention self-check case, the windowed ones (both FlashInfer wrappers) included


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- what runs: the GPU plan and its tiny CPU stand-in ----------------------------------------------------
@dataclass(frozen=True)
class Plan:
    dry_run: bool
    device: torch.device
    dtype: torch.dtype                  # what the pod serves in
    default: object                     # the default model's shape (LlamaConfig)
    big: object                         # Llama-3-8B's
    kernel_rows: tuple[int, ...]        # M of the linears timed
    reps: int                           # timed repetitions (median)
    attention_cases: dict               # name -> (kv lengths, new tokens, window)
    tree_cases: dict                    # name -> (kv lengths, new tokens, each sequence's draft tree or None)
    invariance_sizes: tuple[int, ...]   # batch sizes one sequence is put into
    exact_prompts: tuple[int, ...]      # prompt length of each session
    exact_decode_steps: int
    exact_big_layers: int               # served layers of the 8B-shaped exactness model
    sessions: tuple[int, ...]
    context: int
    decode_steps: int
    memory_context: int
    e2e_tokens: int
    spec_prompts: int                   # held-out chat prompts of the speculation stage
    spec_tokens: int                    # new tokens per answer there
    grace: float                        # watchdog: seconds past a deadline before it interrupts
    give_up: float                      # ... and before it gives the run up
    reserve: float                      # seconds of the budget kept for the last report and the kernel cache


def gpu_plan() -> Plan:
    window = 256
    return Plan(
        dry_run=False, device=torch.device("cuda"), dtype=torch.bfloat16,
        default=llama_config("smollm2-135m"), big=llama_config("llama-3-8b"), kernel_rows=(1, 2, 4, 8, 32, 512),
        reps=20,
        attention_cases={"decode": ((7, 100, 1000, 4000), (1, 1, 1, 1), None),
                         "prefill with a causal offset": ((700,), (300,), None),
                         "ragged batch": ((5, 130, 1000, 260, 33), (5, 1, 64, 1, 33), None),
                         f"window {window}, decode only": ((100, 700, 3000), (1, 1, 1), window),
                         f"window {window}, mixed": ((300, 90, 2000), (16, 1, 100), window)},
        tree_cases={"draft tree of 64 beside a chain and a decode": ((1000, 300, 4000), (64, 16, 1),
                                                                     (bushy_tree(64), None, None)),
                    "two draft trees": ((100, 2000), (21, 48), (bushy_tree(21), bushy_tree(48, fanout=2)))},
        invariance_sizes=(1, 2, 8, 32), exact_prompts=(40, 97, 150, 203), exact_decode_steps=16, exact_big_layers=4,
        sessions=(1, 8, 32), context=1024, decode_steps=32, memory_context=8192, e2e_tokens=64,
        spec_prompts=4, spec_tokens=48,
        grace=15, give_up=60, reserve=5)


def dry_plan() -> Plan:
    """The GPU plan's stand-in on a CPU: the same stages and code paths on tiny shapes, in seconds."""
    from transformers import LlamaConfig

    common = dict(rms_norm_eps=1e-5, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    default = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, rope_theta=100000.0,
                          **common)
    big = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=512, tie_word_embeddings=False, rope_theta=500000.0,
                      **common)
    return Plan(
        dry_run=True, device=torch.device("cpu"), dtype=torch.bfloat16, default=default, big=big,
        kernel_rows=(1, 8), reps=3,
        attention_cases={"decode": ((7, 40), (1, 1), None), "prefill with a causal offset": ((50,), (20,), None),
                         "ragged batch": ((5, 40, 33), (5, 1, 8), None),
                         "window 32, decode only": ((20, 70), (1, 1), 32), "window 32, mixed": ((70, 9), (8, 1), 32)},
        tree_cases={"draft tree beside a chain": ((30, 20), (7, 3), (bushy_tree(7), None))},
        invariance_sizes=(1, 2, 4), exact_prompts=(5, 9, 12, 17), exact_decode_steps=4, exact_big_layers=2,
        sessions=(1, 4), context=32, decode_steps=4, memory_context=64, e2e_tokens=8, spec_prompts=1, spec_tokens=6,
        grace=0.5, give_up=5, reserve=1)


def bushy_tree(rows: int, fanout: int = 4) -> tuple[int, ...]:
    """A draft tree's parents as a head sends them: each row's parent an earlier row, `fanout` children each."""
    return tuple([-1] + [(i - 1) // fanout for i in range(1, rows)])


# -- targets --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Goal:
    stage: str
    goal: str
    check: Callable
    threshold: float


def goals(plan: Plan) -> dict[str, Goal]:
    most = plan.sessions[-1]
    return {
        "top1_default_shape": Goal("exactness", "bf16 CUDA top-1 agreement with fp32 CPU >= 99 % (default shape)",
                                   at_least, 0.99),
        "top1_8b_shape": Goal("exactness", "bf16 CUDA top-1 agreement with fp32 CPU >= 98 % (8B shape)",
                              at_least, 0.98),
        "flashinfer_vs_torch_bf16": Goal("attention", "max |FlashInfer - torch backend| <= 2e-2 in bf16",
                                         at_most, 2e-2),
        "flashinfer_tree_vs_torch_bf16": Goal("attention", "draft trees (custom mask): max |FlashInfer - torch "
                                              "backend| <= 2e-2 in bf16", at_most, 2e-2),
        "int4_decode_step_8b": Goal("kernels", "a layer's int4 linears at M = 1 take <= 0.5x bf16's (8B shape)",
                                    at_most, 0.5),
        "decode_1_session_vs_transformers": Goal("throughput", "decode at 1 session >= 0.9x plain transformers",
                                                 at_least, 0.9),
        f"decode_{most}_sessions_vs_one": Goal("throughput", f"{most} sessions >= {12 * most / 32:g}x one "
                                               "session's throughput", at_least, 12 * most / 32),
        "self_checks": Goal("self_check", "every start-up self-check passes here", at_least, 1.0),
        f"chat_speedup_{SPEC_RTT_MS}ms": Goal("speculation", f"chat with the draft head (trees where the server "
                                              f"verifies them) >= 1.5x speculation off, at {SPEC_RTT_MS} ms RTT "
                                              "end to end", at_least, 1.5),
        "chat_greedy_identical": Goal("speculation", "greedy chat with speculation identical to speculation off",
                                      at_least, 1.0),
    }


# -- deadlines --------------------------------------------------------------------------------------------
class StageOverrun(Exception):
    """A stage went past its deadline: raised by its own checks between steps, or by the watchdog's signal."""


class Watchdog:
    """Interrupts a stage still running `grace` seconds past its deadline (a signal to the main thread, which
    raises StageOverrun there at the next Python line or interrupted system call), after recording the overrun;
    if the stage has still not returned `give_up` seconds later (stuck in a kernel), writes the report and exits."""

    def __init__(self, lease: "Lease"):
        self.lease = lease
        self._lock = threading.Lock()
        self._stage: str | None = None
        self._pending = False
        self._timers: list[threading.Timer] = []

    def on_signal(self, signum, frame) -> None:
        if self._pending:
            self._pending = False
            raise StageOverrun("interrupted by the watchdog: still running past its deadline")

    @contextlib.contextmanager
    def watching(self, stage: str, seconds: float):
        plan = self.lease.plan
        with self._lock:
            self._stage = stage
            self._timers = [threading.Timer(seconds + plan.grace, self._interrupt, (stage,)),
                            threading.Timer(seconds + plan.grace + plan.give_up, self._give_up, (stage,))]
            for timer in self._timers:
                timer.daemon = True
                timer.start()
        try:
            yield
        finally:
            with self._lock:
                self._stage = None
                for timer in self._timers:
                    timer.cancel()
                was_pending, self._pending = self._pending, False
            if was_pending:  # the signal is on its way: raise here rather than after the stage
                raise StageOverrun("interrupted by the watchdog: still running past its deadline")

    def _interrupt(self, stage: str) -> None:
        with self._lock:
            if self._stage != stage:
                return
            self._pending = True
        self.lease.note_overrun(stage)
        signal.pthread_kill(threading.main_thread().ident, OVERRUN_SIGNAL)

    def _give_up(self, stage: str) -> None:
        with self._lock:
            if self._stage != stage:
                return
        self.lease.give_up(stage)


# -- results ----------------------------------------------------------------------------------------------
@dataclass
class StageResult:
    name: str
    status: str = "pending"        # running, ok, failed, overran, skipped
    deadline_s: float = 0.0
    seconds: float = 0.0
    cpu_seconds: float = 0.0       # this process's CPU time (a busy host shows as seconds well above it)
    reason: str = ""               # why it failed, overran or was skipped
    figures: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  # parts not run here, with the reason
    peak_gpu_bytes: int | None = None
    error: str = ""                # the last lines of the traceback of a failure


class Stage:
    """What a stage function is handed: the plan, its own result to fill as it goes, and its deadline."""

    def __init__(self, lease: "Lease", result: StageResult, deadline: float):
        self.lease, self.result, self.deadline = lease, result, deadline
        self.plan, self.work = lease.plan, lease.work
        self.device, self.dtype = lease.plan.device, lease.plan.dtype

    def check(self, before: str) -> None:
        """Between steps: raise StageOverrun once the deadline has passed."""
        if time.monotonic() > self.deadline:
            raise StageOverrun(f"past its {self.result.deadline_s:.0f} s deadline, before {before}")

    def record(self, key: str, value) -> None:
        self.result.figures[key] = value
        self.lease.save()

    def skip(self, part: str, reason: str) -> None:
        self.result.skipped[part] = reason
        say(f"  {self.result.name}: {part} skipped ({reason})")

    def target(self, name: str, value: float, figure: str) -> None:
        goal = self.lease.goals[name]
        self.lease.targets[name] = goal.check("gpu", name, goal.goal, value, goal.threshold, figure)

    def flashinfer(self):
        """The flashinfer module, or None (the reason recorded as a skipped part)."""
        module, reason = self.lease.flashinfer()
        if module is None:
            self.skip("flashinfer", reason)
        return module


class Lease:
    def __init__(self, plan: Plan, stages: list[str], budget: float, out: Path, work: Path,
                 injected: dict[str, str], argv: list[str]):
        self.plan, self.stages, self.budget, self.out, self.work = plan, stages, budget, out, work
        self.injected = injected
        self.goals = goals(plan)
        self.targets: dict[str, Target] = {}
        self.results = {name: StageResult(name) for name in stages}
        self.kernel_cache: dict = {}
        self.watchdog = Watchdog(self)
        self.speculation_model, self.speculation_head = "default", None  # the speculation stage's (--speculation-*)
        self._lock = threading.RLock()
        self._flashinfer = None
        self.started = self.stage_started = time.monotonic()
        self.run_info = {"dry_run": plan.dry_run, "device": device_name(plan.device), "argv": argv,
                         "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "budget_s": budget,
                         "stages": stages, "finished": False}

    # -- running ----------------------------------------------------------------------------------------
    def run(self) -> int:
        end = self.started + self.budget - self.plan.reserve
        previous = signal.signal(OVERRUN_SIGNAL, self.watchdog.on_signal)
        try:
            for i, name in enumerate(self.stages):
                seconds = (end - time.monotonic()) * SHARES[name] / sum(SHARES[s] for s in self.stages[i:])
                seconds = min(seconds, MAX_STAGE_SECONDS.get(name, seconds))
                if name != "env" and not self.plan.dry_run and not torch.cuda.is_available():
                    self.skipped(name, "torch sees no CUDA device (see the env stage)")
                elif seconds < MIN_STAGE_SECONDS:
                    self.skipped(name, f"no time left in the {self.budget:.0f} s budget")
                else:
                    self.run_stage(name, seconds)
        finally:
            signal.signal(OVERRUN_SIGNAL, previous)
        return self.finish()

    def run_stage(self, name: str, seconds: float) -> None:
        result = self.results[name]
        result.status, result.deadline_s = "running", round(seconds, 1)
        say(f"== {name} (deadline {seconds:.0f} s) ==")
        self.save()
        cuda = self.plan.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = self.stage_started = time.monotonic()
        cpu = time.process_time()
        try:
            with self.watchdog.watching(name, seconds):
                self.inject(name)
                STAGE_FUNCTIONS[name](Stage(self, result, start + seconds))
            result.status = "ok"
        except StageOverrun as e:
            result.status, result.reason = "overran", str(e)
        except Exception as e:  # noqa: BLE001 - a stage that raises is a finding; the next stage runs
            result.status, result.reason = "failed", f"{type(e).__name__}: {e}"
            result.error = "".join(traceback.format_exception(e)[-6:])
        finally:
            result.seconds = round(time.monotonic() - start, 2)
            result.cpu_seconds = round(time.process_time() - cpu, 2)
            if cuda:
                result.peak_gpu_bytes = torch.cuda.max_memory_allocated()
            if cuda:  # give the stage's memory back (on a CPU, collecting costs more than it frees)
                gc.collect()
                torch.cuda.empty_cache()
        say(f"   {name}: {result.status} in {result.seconds:.1f} s" + (f" ({result.reason})" if result.reason else ""))
        if name == "attention":
            self.collect_kernels()
        self.save()

    def inject(self, name: str) -> None:
        """`--inject raise:STAGE` / `stall:STAGE`: a failure or a hang where the stage would start (tests)."""
        what = self.injected.get(name)
        if what == "raise":
            raise RuntimeError("failure injected by --inject")
        if what == "stall":
            time.sleep(STALL_SECONDS)  # never checks its deadline: only the watchdog ends it in time

    def skipped(self, name: str, reason: str) -> None:
        result = self.results[name]
        result.status, result.reason = "skipped", reason
        say(f"== {name}: skipped ({reason}) ==")
        self.save()

    def flashinfer(self):
        if self._flashinfer is None:
            if self.plan.device.type != "cuda":
                self._flashinfer = (None, "FlashInfer needs CUDA (dry run on the CPU)")
            else:
                try:
                    import flashinfer
                    self._flashinfer = (flashinfer, "")
                except Exception as e:  # noqa: BLE001 - a broken CUDA install raises OSError or RuntimeError too
                    self._flashinfer = (None, f"FlashInfer is not importable ({type(e).__name__}: {e})")
        return self._flashinfer

    # -- the report -------------------------------------------------------------------------------------
    def note_overrun(self, stage: str) -> None:
        """From the watchdog thread: the report says so even if nothing after this gets written."""
        with self._lock:
            result = self.results[stage]
            result.status = "overran"
            result.reason = "still running past its deadline; interrupted by the watchdog"
            result.seconds = round(time.monotonic() - self.stage_started, 2)
        self.save()

    def give_up(self, stage: str) -> None:
        """The stage ignored the watchdog (stuck in a kernel): the report as it stands, then exit. A dry run only
        records it: on a CPU nothing hangs where a signal cannot reach, and its process may be a test's."""
        with self._lock:
            self.results[stage].reason = "hung past its deadline (not interrupted); the run gave up here"
            if not self.plan.dry_run:
                for result in self.results.values():
                    if result.status == "pending":
                        result.status, result.reason = "skipped", f"the run gave up at {stage}"
        if self.plan.dry_run:
            self.save()
            return
        self.finish(exit_status=3)
        os._exit(3)

    def finish(self, exit_status: int | None = None) -> int:
        self.collect_kernels()
        if exit_status is None:
            exit_status = 1 if any(r.status in ("failed", "overran") for r in self.results.values()) else 0
        self.run_info.update(finished=True, exit_status=exit_status,
                             seconds=round(time.monotonic() - self.started, 1))
        self.save()
        print("\n".join(line for line in self.target_lines()), flush=True)
        return exit_status

    def final_targets(self) -> list[tuple[Goal, Target]]:
        out = []
        for name, goal in self.goals.items():
            if name in self.targets:
                out.append((goal, self.targets[name]))
                continue
            result = self.results.get(goal.stage)
            if result is None:
                why = "not run: not among --stages"
            elif result.status == "ok" and result.skipped:
                why = "not measured: " + "; ".join(f"{part} skipped, {r}" for part, r in result.skipped.items())
            else:
                why = f"not measured: stage {goal.stage} {result.status}{', ' if result.reason else ''}{result.reason}"
            out.append((goal, Target("gpu", name, goal.goal, False, why[:200])))
        return out

    def target_lines(self) -> list[str]:
        return [target.line() for _, target in self.final_targets()]

    def save(self) -> None:
        with self._lock:
            report = {"run": self.run_info, "stages": {n: dataclasses.asdict(r) for n, r in self.results.items()},
                      "targets": [{"name": t.name, "stage": g.stage, "goal": t.goal, "verdict": t.verdict,
                                   "figure": t.figure} for g, t in self.final_targets()],
                      "kernel_cache": self.kernel_cache}
            self.out.mkdir(parents=True, exist_ok=True)
            write_atomic(self.out / "gpu-lease.json", json.dumps(report, indent=2, default=str) + "\n")
            write_atomic(self.out / "gpu-lease.md", markdown(report))

    # -- FlashInfer's compiled modules ---------------------------------------------------------------------
    def collect_kernels(self) -> None:
        module, _ = self.flashinfer()
        if module is None:
            return
        try:
            self.kernel_cache.update(collect_kernels(self.out / "kernel-cache"))
        except Exception as e:  # noqa: BLE001 - the results matter more than the cache
            self.kernel_cache["collect_error"] = f"{type(e).__name__}: {e}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def markdown(report: dict) -> str:
    run = report["run"]
    lines = ["# GPU lease run", "", f"{'Dry run on the CPU' if run['dry_run'] else 'GPU run'}: {run['device']}; "
             f"started {run['started']}, budget {run['budget_s']:.0f} s"
             + (f", finished in {run['seconds']} s (exit {run['exit_status']})" if run.get("finished") else
                " (still running, or killed)") + ".", "",
             "| stage | status | seconds | CPU seconds | deadline | peak GPU memory | reason |",
             "|---|---|---:|---:|---:|---:|---|"]
    for name, r in report["stages"].items():
        peak = f"{r['peak_gpu_bytes'] / 2**30:.2f} GiB" if r["peak_gpu_bytes"] is not None else "–"
        lines.append(f"| {name} | {r['status']} | {r['seconds']} | {r['cpu_seconds']} | {r['deadline_s']} | {peak} | "
                     f"{cell(r['reason'])} |")
    lines += ["", "## Targets", "", "```"] + [f"TARGET gpu {t['name']}: {t['verdict']} ({t['figure']})"
                                              for t in report["targets"]] + ["```"]
    for name, r in report["stages"].items():
        if not (r["figures"] or r["skipped"] or r["error"]):
            continue
        lines += ["", f"## {name}", ""]
        lines += [f"- skipped {part}: {why}" for part, why in r["skipped"].items()]
        for key, value in r["figures"].items():
            lines += render(key, value)
        if r["error"]:
            lines += ["", "```", r["error"].rstrip(), "```"]
    if report["kernel_cache"]:
        lines += ["", "## FlashInfer kernel cache", ""] + render("kernel cache", report["kernel_cache"])
    return "\n".join(lines) + "\n"


def render(key: str, value, depth: int = 0) -> list[str]:
    """A figure as markdown: a list of like rows as a table, a dict as nested items, anything else in one line."""
    pad = "  " * depth
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        columns = list(dict.fromkeys(k for row in value for k in row))
        return ([f"{pad}- {key}:", ""] + [f"{pad}  | " + " | ".join(columns) + " |",
                                          f"{pad}  |" + "---|" * len(columns)]
                + [f"{pad}  | " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in value] + [""])
    if isinstance(value, dict):
        out = [f"{pad}- {key}:"]
        for k, v in value.items():
            out += render(k, v, depth + 1)
        return out
    return [f"{pad}- {key}: {cell(value)}"]


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/").replace("\n", " ")


# -- timing -------------------------------------------------------------------------------------------------
def median_seconds(fn: Callable[[], object], device: torch.device, reps: int, calls: int = 1) -> float:
    """Seconds per call of `fn`: the median over `reps` timings of `calls` calls back to back (CUDA events on a
    GPU), after one warm-up. Calls back to back let the host run ahead of the device, as it does in a step of
    many layers, so a kernel shorter than its launch shows as the launch's cost."""
    fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t) / calls)
    return statistics.median(times)


def first_call_seconds(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    t = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t


# -- env ------------------------------------------------------------------------------------------------------
def stage_env(stage: Stage) -> None:
    """The preflight (scripts/gpu_env.py): versions, import times, what is missing."""
    import gpu_env

    env = gpu_env.report()
    stage.record("status", env.status)
    stage.record("summary", env.summary())
    stage.record("report", dataclasses.asdict(env))
    for line in env.lines():
        say("  " + line)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        stage.record("gpu", {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                             "capability": f"{props.major}.{props.minor}",
                             "multiprocessors": props.multi_processor_count})
    stage.record("flashinfer_workspace_base", os.environ.get("FLASHINFER_WORKSPACE_BASE"))


# -- kernels ------------------------------------------------------------------------------------------------
def served_linear(module: torch.nn.Module, tensors: dict, device: torch.device, dtype: torch.dtype):
    """Load stored tensors into a (meta-device) quantised linear as LayerStack loads a layer's."""
    module.load_state_dict({k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in tensors.items()},
                           strict=True, assign=True)
    return module.eval()


@torch.inference_mode()
def stage_kernels(stage: Stage) -> None:
    """int8 and int4 served linears against their dequantised weights, and their time against bf16 F.linear."""
    from torch.nn import functional as F

    from infemeral.quant import int4, int8, served

    plan, device, dtype = stage.plan, stage.device, stage.dtype
    group = served.DEFAULT_GROUP_SIZE
    g = torch.Generator(device=device).manual_seed(0)
    rows, layer_times = [], {}
    for label, config in (("default", plan.default), ("8b", plan.big)):
        by_shape: dict[tuple[int, int], list[str]] = {}
        for name, shape in linear_shapes(config).items():
            by_shape.setdefault(shape, []).append(name)
        layer = {(label, m): {"bfloat16": 0.0, "int8": 0.0, "int4 (k, v in int8)": 0.0} for m in plan.kernel_rows}
        for (n, k), names in by_shape.items():
            stage.check(f"the {label} [{n}, {k}] linears")
            w = torch.randn(n, k, generator=g, device=device) * 0.02
            codes, scales = int8.quantize_rows(w)
            with torch.device("meta"):
                lin8 = int8.Int8Linear(k, n, bias=False)
                lin4 = int4.Int4Linear(k, n, group, bias=False)
            lin8 = served_linear(lin8, {"weight": codes, "scale": scales}, device, dtype)
            stored4 = int4.quantize_rtn(w, group)
            lin4 = served_linear(lin4, stored4, device, dtype)
            dequantised = {"int8": int8.dequantize_rows(codes, scales, torch.float32).to(device),
                           "int4": int4.dequantize(stored4["qweight"], stored4["scales"], stored4["zeros"]).to(device)}
            dense = w.to(dtype)
            kernels = ", ".join(f"{kind} {count}" for kind, count in
                                served.kernels_in_use(torch.nn.ModuleList([lin8, lin4])).items())
            for m in plan.kernel_rows:
                x = torch.randn(m, k, generator=g, device=device).to(dtype)
                row = {"shape": label, "linears": ", ".join(name.rsplit(".", 1)[1] for name in names),
                       "out x in": f"{n} x {k}", "M": m}
                for scheme, module in (("int8", lin8), ("int4", lin4)):
                    want = x.float() @ dequantised[scheme].T
                    got = module(x).float()
                    row[f"{scheme} max err"] = float((got - want).abs().max())
                    row[f"{scheme} rel err"] = row[f"{scheme} max err"] / max(float(want.abs().max()), 1e-30)
                times = {"bfloat16": median_seconds(lambda: F.linear(x, dense), device, plan.reps, 10),
                         "int8": median_seconds(lambda: lin8(x), device, plan.reps, 10),
                         "int4": median_seconds(lambda: lin4(x), device, plan.reps, 10)}
                row.update({f"{s} us": round(t * 1e6, 1) for s, t in times.items()})
                # the two ways an int8 linear can run, whichever the served one picks at this M: where they cost
                # the same is where it should switch
                row["int8 kernel us"] = round(1e6 * median_seconds(
                    lambda: torch.ops.aten._weight_int8pack_mm(x, lin8.weight, lin8.scale), device, plan.reps, 10), 1)
                row["int8 dequantised us"] = round(1e6 * median_seconds(
                    lambda: F.linear(x, int8.dequantize_rows(lin8.weight, lin8.scale, x.dtype)), device, plan.reps,
                    10), 1)
                row.update({f"{s} / bf16": times[s] / times["bfloat16"] for s in ("int8", "int4")})
                row["kernels"] = kernels
                rows.append(row)
                sums = layer[(label, m)]
                for name in names:  # a layer's time, every linear counted
                    sums["bfloat16"] += times["bfloat16"]
                    sums["int8"] += times["int8"]
                    sums["int4 (k, v in int8)"] += times["int8" if name in served.DEFAULT_INT8_LINEARS else "int4"]
            stage.record("linears", rows)
            del lin8, lin4, dequantised, dense, w
        layer_times.update(layer)
    stage.record("layer", [{"shape": label, "M": m, **{f"{s} us": round(t * 1e6, 1) for s, t in sums.items()},
                            "int4 / bf16": sums["int4 (k, v in int8)"] / sums["bfloat16"],
                            "int8 / bf16": sums["int8"] / sums["bfloat16"]}
                           for (label, m), sums in layer_times.items()])
    one = layer_times[("8b", plan.kernel_rows[0])]
    ratio = one["int4 (k, v in int8)"] / one["bfloat16"]
    stage.target("int4_decode_step_8b", ratio, f"{ratio:.2f}x bf16 at M = {plan.kernel_rows[0]}: "
                 f"{one['int4 (k, v in int8)'] * 1e6:.0f} us against {one['bfloat16'] * 1e6:.0f} us per layer")


# -- attention ------------------------------------------------------------------------------------------------
def host_batch(csr, trees=None) -> types.SimpleNamespace:
    """What a backend reads of a PagedBatch: the CSR arrays, int32 on the host, and each sequence's draft tree."""
    qo, kv_indptr, kv_indices, last = csr
    trees = [list(t) if t is not None else None for t in trees] if trees is not None else None
    return types.SimpleNamespace(qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last,
                                 trees=trees)


def attention_backends(stage: Stage, heads: tuple[int, int, int], dtype: torch.dtype) -> dict:
    from infemeral.layers.attention_backends.flashinfer_backend import FlashInferBackend
    from infemeral.layers.attention_backends.torch_backend import TorchBackend

    backends = {"torch": TorchBackend()}
    if stage.flashinfer() is not None:
        backends["flashinfer"] = FlashInferBackend(stage.device, *heads, PAGE, dtype)
    return backends


def head_sets(plan: Plan) -> dict[str, tuple[int, int, int]]:
    """(query heads, KV heads, head dim) of the two shapes."""
    return {name: (c.num_attention_heads, c.num_key_value_heads, head_dim(c))
            for name, c in (("default", plan.default), ("8b", plan.big))}


def compile_flashinfer(stage: Stage) -> None:
    """The FlashInfer modules the run serves with (its dtype; both shapes, both wrappers, with and without a
    window) compiled at once, one thread each, each timing its first call: nvcc runs at first use, and the
    threads overlap the compiles. ninja's jobs per module are cut so that all of them share the cores (each nvcc
    of these templates takes GBs of memory)."""
    from infemeral.layers.attention_backends.flashinfer_backend import FlashInferBackend

    jobs = [(label, heads, kind, window) for label, heads in head_sets(stage.plan).items()
            for kind in ("decode", "prefill") for window in (None, 32)]
    jobs += [(label, heads, "tree", None) for label, heads in head_sets(stage.plan).items()]  # the custom mask
    timings: list[dict] = []

    def compile_one(label, heads, kind, window):
        row = {"shape": label, "dtype": str(stage.dtype)[6:], "wrapper": kind, "window": window or "none"}
        try:
            q, k, v, csr = random_batch((40,), (1 if kind == "decode" else 8,), *heads, PAGE, stage.dtype,
                                        device=stage.device)
            backend = FlashInferBackend(stage.device, *heads, PAGE, stage.dtype)
            batch = host_batch(csr, [bushy_tree(8)] if kind == "tree" else None)
            _, row["first call s"] = first_call_seconds(
                lambda: (backend.plan(batch), backend.run(q, k, v, batch, heads[2] ** -0.5, window)), stage.device)
        except Exception as e:  # noqa: BLE001 - one module that fails to build is a finding, the rest go on
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        timings.append(row)

    threads = [threading.Thread(target=compile_one, args=job, daemon=True) for job in jobs]
    jobs_before = os.environ.get("MAX_JOBS")
    os.environ["MAX_JOBS"] = str(max(1, (os.cpu_count() or 1) * 3 // 2 // len(threads)))
    start = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # the main thread stays in Python, where the watchdog's signal can reach it
                t.join(timeout=0.5)
                stage.check("every FlashInfer module was compiled")
    finally:
        stage.record("compile", {"wall seconds": round(time.perf_counter() - start, 1), "modules": timings,
                                 "ninja jobs per module": os.environ["MAX_JOBS"]})
        if jobs_before is None:
            os.environ.pop("MAX_JOBS")
        else:
            os.environ["MAX_JOBS"] = jobs_before


def place(q, k, v, csr, seq_q, seq_k, seq_v) -> None:
    """Write one sequence's queries and keys/values as the batch's first sequence (its pages, its rows)."""
    qo, kv_indptr, kv_indices, _ = (t.tolist() for t in csr)
    q[qo[0]:qo[1]] = seq_q
    for i, p in enumerate(kv_indices[kv_indptr[0]:kv_indptr[1]]):
        fill = min(PAGE, seq_k.shape[0] - i * PAGE)
        k[p, :fill], v[p, :fill] = seq_k[i * PAGE:i * PAGE + fill], seq_v[i * PAGE:i * PAGE + fill]


@torch.inference_mode()
def stage_attention(stage: Stage) -> None:
    """FlashInfer against the PyTorch backend (float32 reference on the same pages, NaN in every unused slot),
    first-call (compile) times, and whether one sequence's output depends on the batch it shares."""
    from infemeral.layers.attention_backends.torch_backend import torch_paged_attention

    plan, device, dtype = stage.plan, stage.device, stage.dtype
    if stage.flashinfer() is not None:
        compile_flashinfer(stage)
    rows, worst, worst_tree = [], {}, {}
    cases = {case: (lengths, queries, window, None) for case, (lengths, queries, window) in plan.attention_cases.items()}
    cases.update({case: (lengths, queries, None, trees) for case, (lengths, queries, trees) in plan.tree_cases.items()})
    for label, heads in head_sets(plan).items():
        backends = attention_backends(stage, heads, dtype)
        scale = heads[2] ** -0.5
        for case, (lengths, queries, window, trees) in cases.items():
            stage.check(f"{label} {case}")
            q, k, v, csr = random_batch(lengths, queries, *heads, PAGE, dtype, device=device)
            want = torch_paged_attention(q.float(), k.float(), v.float(), *csr, scale, window,
                                         host_batch(csr, trees).trees)
            for name, backend in backends.items():
                batch = host_batch(csr, trees)
                row = {"shape": label, "heads": "/".join(map(str, heads)), "case": case, "backend": name}

                def attend():
                    backend.plan(batch)
                    return backend.run(q, k, v, batch, scale, window)

                try:
                    got, first = first_call_seconds(attend, device)
                    err = float((got.float() - want).abs().max()) if bool(torch.isfinite(got).all()) else math.inf
                    row.update({"wrapper": backend.kind() if name == "flashinfer" else "torch", "max err vs fp32": err,
                                "first call s": round(first, 3),
                                "us": round(median_seconds(attend, device, plan.reps) * 1e6, 1)})
                except Exception as e:  # noqa: BLE001 - a kernel that fails is a finding; the other cases go on
                    err, row["error"] = math.inf, f"{type(e).__name__}: {e}"[:300]
                within = worst_tree if trees is not None else worst
                within[name] = max(within.get(name, 0.0), err)
                rows.append(row)
            stage.record("cases", rows)
    stage.record("worst", worst)
    stage.record("worst with draft trees", worst_tree)
    if "flashinfer" in worst:
        stage.target("flashinfer_vs_torch_bf16", worst["flashinfer"],
                     f"max |FlashInfer - fp32 torch| {worst['flashinfer']:.2e} over {len(plan.attention_cases) * 2} "
                     f"cases (torch backend in bf16: {worst['torch']:.2e})")
    if "flashinfer" in worst_tree:
        stage.target("flashinfer_tree_vs_torch_bf16", worst_tree["flashinfer"],
                     f"max |FlashInfer - fp32 torch| {worst_tree['flashinfer']:.2e} over {len(plan.tree_cases) * 2} "
                     f"draft-tree cases (torch backend in bf16: {worst_tree['torch']:.2e})")
    stage.record("batch_invariance", batch_invariance(stage))


def batch_invariance(stage: Stage) -> list[dict]:
    """One decode sequence alone and as the first of batches of other sizes: its largest output difference."""
    plan, device, dtype = stage.plan, stage.device, stage.dtype
    out = []
    for label, heads in head_sets(plan).items():
        lengths = plan.attention_cases["decode"][0]
        length = lengths[len(lengths) // 2]
        g = torch.Generator().manual_seed(1)
        seq_q = torch.randn(1, heads[0], heads[2], generator=g).to(device, dtype)
        seq_k = torch.randn(length, heads[1], heads[2], generator=g).to(device, dtype)
        seq_v = torch.randn(length, heads[1], heads[2], generator=g).to(device, dtype)
        for name, backend in attention_backends(stage, heads, dtype).items():
            stage.check(f"batch invariance of {name}, {label}")
            alone, diffs = None, {}
            for size in plan.invariance_sizes:
                others = [lengths[i % len(lengths)] + 3 * i for i in range(size - 1)]
                q, k, v, csr = random_batch([length] + others, [1] * size, *heads, PAGE, dtype, seed=size,
                                            device=device)
                place(q, k, v, csr, seq_q, seq_k, seq_v)
                batch = host_batch(csr)
                backend.plan(batch)
                row = backend.run(q, k, v, batch, heads[2] ** -0.5)[0].float()
                if alone is None:
                    alone = row
                else:
                    diffs[f"batch of {size}"] = float((row - alone).abs().max())
            out.append({"shape": label, "backend": name, "length": length, **diffs})
    return out


# -- self-checks ------------------------------------------------------------------------------------------------
def stage_self_check(stage: Stage) -> None:
    """The server's start-up self-checks, run here: attention for each backend and dtype, and one served layer
    of a plain, an int8 and an int4 bundle (round-to-nearest) of each shape."""
    from infemeral.cloak.bundle import ServerBundle
    from infemeral.layers.attention_backends.flashinfer_backend import FlashInferBackend
    from infemeral.layers.attention_backends.torch_backend import TorchBackend
    from infemeral.quant import served
    from infemeral.server import self_check

    plan, device = stage.plan, stage.device
    names = ["torch"] + (["flashinfer"] if stage.flashinfer() is not None else [])
    if "flashinfer" in names:
        stage.skip("flashinfer in float32", "FlashInfer has no float32 kernels")
    checks = []
    for label, heads in head_sets(plan).items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for name in names:
                if name == "flashinfer" and dtype == torch.float32:
                    continue
                stage.check(f"the {name} attention self-check")
                backend = TorchBackend() if name == "torch" else FlashInferBackend(device, *heads, PAGE, dtype)
                failure = self_check.attention_failure(backend, device, *heads, PAGE, dtype,
                                                       sliding_window=SELF_CHECK_WINDOW)
                checks.append({"check": "attention", "shape": label, "backend": name, "dtype": str(dtype)[6:],
                               "failure": failure or "none"})
                failure = self_check.attention_failure(backend, device, *heads, PAGE, dtype,
                                                       cases=list(self_check.TREE_CASES))
                checks.append({"check": "attention, draft tree (decides ServerInfo.draft_trees)", "shape": label,
                               "backend": name, "dtype": str(dtype)[6:], "failure": failure or "none"})
                stage.record("checks", checks)
    layer_dtypes = (stage.dtype,) if plan.dry_run else (torch.bfloat16, torch.float16)
    for label, config in (("default", plan.default), ("8b", plan.big)):
        weights = random_layers(config, 1, torch.float32, device, std=None)[0]
        for scheme in ("none", "int8", "int4"):
            stage.check(f"the {scheme} layer self-check, {label}")
            quant = served.ServerQuant(scheme, "rtn" if scheme != "none" else None)
            layer = weights if scheme == "none" else served.quantize_layer(weights, quant)
            directory = stage.work / f"self-check-{label}-{scheme}"
            write_bundle(directory, config, [layer], "float32", quant)
            bundle = ServerBundle.open(directory)
            for dtype in layer_dtypes:
                failure = self_check.layer_failure(bundle, dtype, device)
                checks.append({"check": "served layer", "shape": label, "backend": scheme, "dtype": str(dtype)[6:],
                               "failure": failure or "none"})
                stage.record("checks", checks)
            shutil.rmtree(directory, ignore_errors=True)
        del weights
    passed = sum(c["failure"] == "none" for c in checks)
    failed = [f"{c['check']} {c['shape']} {c['backend']} {c['dtype']}" for c in checks if c["failure"] != "none"]
    stage.target("self_checks", passed / len(checks), f"{passed}/{len(checks)} pass"
                 + (f"; failed: {', '.join(failed)}" if failed else ""))


# -- exactness ---------------------------------------------------------------------------------------------------
def random_split(stage: Stage, config, served_layers: int, directory: Path):
    """A random model of `config`'s shape cut as the pod serves it: a float32 client half (embedding, layer 0 with
    real norm gains, final norm, LM head, a secret basis; on this device, where the 8B shape's LM head is cheap)
    and a bf16 server bundle of `served_layers` random served layers."""
    from infemeral.client_half.half import ClientModel
    from infemeral.cloak.basis import random_orthogonal
    from infemeral.cloak.bundle import ServerBundle
    from infemeral.eval.client_precision import random_client_tensors

    config = copy.deepcopy(config)
    config.num_hidden_layers = served_layers + 1
    basis = random_orthogonal(config.hidden_size, bytes(32)).float()
    client = ClientModel.from_tensors(config, 1, random_client_tensors(config), basis, dtype="float32",
                                      device=stage.device.type)
    write_bundle(directory, config, random_layers(config, served_layers, torch.bfloat16, stage.device, std=None),
                 "bfloat16")
    return config, client, ServerBundle.open(directory)


def reference_residuals(bundle, hidden: list[torch.Tensor], prompts: tuple[int, ...]) -> list[torch.Tensor]:
    """The served layers in float32 on the CPU, each session alone: its prompt at once, then one token a step."""
    from infemeral.quant import served

    stack = served.load_stack(bundle, torch.float32, "cpu")
    out = []
    for h, p in zip(hidden, prompts):
        cache = stack.new_cache(h.shape[0])
        out.append(torch.cat([stack(h[:p], cache)] + [stack(h[i:i + 1], cache) for i in range(p, h.shape[0])]))
    return out


def engine_residuals(engine, hidden: list[torch.Tensor], prompts: tuple[int, ...], together: bool) -> list:
    """The engine's outputs for every position of each session: alone (one turn after another) or together
    (every session's prompt, then every session's next token, submitted before any is awaited)."""
    def open_turn(h):
        return engine.open_turn(os.urandom(16), os.urandom(32), 0, engine.bundle.fingerprint,
                                reserve_tokens=h.shape[0])

    def steps(h, p):
        return [(h[:p], 0, p)] + [(h[i:i + 1], i, 1) for i in range(p, h.shape[0])]

    groups = [list(zip(hidden, prompts))] if together else [[(h, p)] for h, p in zip(hidden, prompts)]
    out = []
    for group in groups:
        turns = [open_turn(h) for h, _ in group]
        try:
            rows = [[] for _ in group]
            plans = [steps(h, p) for h, p in group]
            for j in range(len(plans[0])):
                futures = [engine.submit_step(turn, *plan[j]) for turn, plan in zip(turns, plans)]
                for r, f in zip(rows, futures):
                    r.append(f.result().hidden)
            out += [torch.cat(r) for r in rows]
        finally:
            for turn in turns:
                engine.close_turn(turn)
    return out


def stage_exactness(stage: Stage) -> None:
    """The engine in bf16 on this device against the float32 CPU path, through the client half (logits): the
    default shape with all its layers and an 8B shape with a few, four sessions, prefill + decode steps, each
    session alone and all of them batched, with each attention backend."""
    from infemeral.eval.client_precision import compare
    from infemeral.kvcache.window import WindowPolicy
    from infemeral.server.config import EngineConfig
    from infemeral.server.engine import Engine
    from infemeral.storage.directory import DirectoryStore

    plan = stage.plan
    backends = ["torch"] + (["flashinfer"] if stage.flashinfer() is not None else [])
    prompts = plan.exact_prompts
    longest = max(prompts) + plan.exact_decode_steps
    cases = (("default", plan.default, plan.default.num_hidden_layers - 1, "top1_default_shape"),
             ("8b", plan.big, plan.exact_big_layers, "top1_8b_shape"))
    for label, shape, served_layers, target in cases:
        stage.check(f"the {label} model")
        config, client, bundle = random_split(stage, shape, served_layers, stage.work / f"exact-{label}")
        g = torch.Generator().manual_seed(7)
        ids = [torch.randint(0, config.vocab_size, (p + plan.exact_decode_steps,), generator=g).tolist()
               for p in prompts]  # random tokens, teacher-forced: a random model's greedy text cycles at once
        hidden = [client.cloak(x, client.new_cache()).cpu() for x in ids]  # as the wire carries them
        reference = [client.logits(r) for r in reference_residuals(bundle, hidden, prompts)]
        results, top1 = {}, []
        for backend in backends:
            stage.check(f"the {label} model on {backend}")
            try:
                engine = Engine(bundle, DirectoryStore(stage.work / f"store-{label}-{backend}"), EngineConfig(
                    device=str(stage.device), dtype=str(stage.dtype)[6:], attention_backend=backend,
                    window=WindowPolicy(max(64, 2 * longest)), kv_pool_tokens=8 * max(64, 2 * longest),
                    max_step_tokens=max(prompts), max_batch_hold=0.05))
                try:
                    solo = [client.logits(r) for r in engine_residuals(engine, hidden, prompts, together=False)]
                    batched = [client.logits(r) for r in engine_residuals(engine, hidden, prompts, together=True)]
                    largest_batch = engine.stats["largest_batch"]
                finally:
                    engine.stop()
            except Exception as e:  # noqa: BLE001 - one backend failing (its self-check, say) leaves the other
                results[backend] = {"error": f"{type(e).__name__}: {e}"[:500]}
                stage.record(label, results)
                continue
            row = {}
            for mode, logits in (("solo", solo), ("batched", batched)):
                a = compare(f"{backend} {mode}", reference, logits)
                row[mode] = {"top-1": a.agreement.top1_rate, "positions": a.agreement.positions,
                             "first divergence": a.agreement.first_divergence,
                             "max logit error": a.max_logit_error, "mean logit error": a.mean_logit_error,
                             "median top-2 gap (fp32)": a.median_top2_gap}
                top1.append((a.agreement.top1_rate, f"{backend} {mode}", a.max_logit_error))
            row["batched vs solo max logit diff"] = max(float((b - s).abs().max()) for b, s in zip(batched, solo))
            row["largest batch the engine ran"] = largest_batch
            results[backend] = row
            stage.record(label, {"served layers": served_layers, "sessions": len(prompts),
                                 "decode steps": plan.exact_decode_steps, **results})
        if not top1:
            continue
        worst = min(top1)
        stage.target(target, worst[0], f"{worst[0]:.2%} at worst ({worst[1]}; max logit error {worst[2]:.3g}); "
                     + ", ".join(f"{name} {rate:.2%}" for rate, name, _ in top1))
        del client, hidden, reference
        shutil.rmtree(stage.work / f"exact-{label}", ignore_errors=True)


# -- throughput ---------------------------------------------------------------------------------------------------
def plain_model(config, layers: list[dict], device: torch.device, dtype: torch.dtype):
    """transformers' LlamaModel over the same layer tensors (shared, not copied), fed embeddings directly: the
    same layers decoded by plain transformers, with its own KV cache (its embedding table is never read)."""
    from transformers import LlamaModel
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with torch.device("meta"):
        model = LlamaModel(config)
    state = {f"layers.{i}.{k}": v for i, w in enumerate(layers) for k, v in w.items()}
    state["norm.weight"] = torch.ones(config.hidden_size, device=device, dtype=dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.rotary_emb = LlamaRotaryEmbedding(config=config).to(device)
    return model.eval()


@torch.inference_mode()
def plain_decode_rate(model, sessions: int, context: int, steps: int, device, dtype) -> float:
    from infemeral.layers.architecture import cache_keyword

    d, keyword = model.config.hidden_size, cache_keyword(model)

    def forward(tokens: int, cache=None):
        kwargs = {} if cache is None else {keyword: cache}
        out = model(inputs_embeds=torch.randn(sessions, tokens, d, device=device, dtype=dtype) * 0.1, use_cache=True,
                    **kwargs)
        return out.cache if getattr(out, "cache", None) is not None else out.past_key_values  # renamed in 5.x

    cache = forward(context)

    def step():
        nonlocal cache
        cache = forward(1, cache)

    return sessions * steps_per_second(step, steps, device)


def stage_throughput(stage: Stage) -> None:
    """Decode tokens/s of an 8B-shaped model's layers through the engine's layer path (each attention backend)
    and through plain transformers, at each session count, every session with `context` tokens cached."""
    from infemeral.kvcache.paged import KVPages
    from infemeral.layers.stack import LayerStack

    plan, device, dtype = stage.plan, stage.device, stage.dtype
    config = plan.big
    layers = random_layers(config, config.num_hidden_layers, dtype, device)
    stack = LayerStack(config, 0, layers, dtype=dtype, device=device)  # the same tensors: nothing copied
    heads = head_sets(plan)["8b"]
    kv = KVPages(max(plan.sessions) * -(-(plan.context + plan.decode_steps + 8) // PAGE) + 8, PAGE, 0,
                 config.num_hidden_layers, heads[1], heads[2], dtype, device)
    rates: dict[str, dict[int, float]] = {}
    for name, backend in attention_backends(stage, heads, dtype).items():
        for n in plan.sessions:
            stage.check(f"{name} at {n} sessions")
            try:
                rates.setdefault(name, {})[n] = decode_rate(stack, kv, backend, n, plan.context, plan.decode_steps)
            except Exception as e:  # noqa: BLE001 - a backend that fails is recorded; the others are measured
                stage.record(f"{name} error", f"{type(e).__name__}: {e}"[:500])
                kv = KVPages(kv.num_pages, PAGE, 0, config.num_hidden_layers, heads[1], heads[2], dtype, device)
                break
            stage.record("tokens_per_second", rates)
    del kv
    model = plain_model(config, layers, device, dtype)
    for n in plan.sessions:
        stage.check(f"transformers at {n} sessions")
        rates.setdefault("transformers", {})[n] = plain_decode_rate(model, n, plan.context, plan.decode_steps,
                                                                    device, dtype)
        stage.record("tokens_per_second", rates)
    stage.record("setting", f"{config.num_hidden_layers} layers of the {config.hidden_size}-wide shape, "
                 f"{str(dtype)[6:]}, {plan.context} tokens cached per session, {plan.decode_steps} timed steps")
    served = "flashinfer" if len(rates.get("flashinfer", ())) == len(plan.sessions) else "torch"
    one, most = plan.sessions[0], plan.sessions[-1]
    ratio = rates[served][one] / rates["transformers"][one]
    stage.target("decode_1_session_vs_transformers", ratio, f"{ratio:.2f}x: {served} {rates[served][one]:.1f} "
                 f"tok/s, transformers {rates['transformers'][one]:.1f} tok/s")
    scaling = rates[served][most] / rates[served][one]
    stage.target(f"decode_{most}_sessions_vs_one", scaling, f"{scaling:.1f}x with {served}: "
                 f"{rates[served][most]:.0f} tok/s at {most}, {rates[served][one]:.1f} at {one}")


# -- memory -------------------------------------------------------------------------------------------------------
def readme_fits_row(model: str, mode: str) -> dict:
    """A row of the README's what-fits table: weights GB, KV per session GB and sessions per GPU size."""
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- server-quant-fits:start -->")[1].split("<!-- server-quant-fits:end -->")[0]
    lines = [line.strip().strip("|").split("|") for line in table.strip().splitlines()]
    header = [h.strip() for h in lines[0]]
    for cells in lines[2:]:
        cells = [c.strip() for c in cells]
        if cells[0] == model and cells[1] == mode:
            return dict(zip(header, cells))
    raise ValueError(f"README's what-fits table has no row for {model} {mode}")


def stage_memory(stage: Stage) -> None:
    """The 8B shape's served layers and KV pages measured in memory against what the README's what-fits table
    assumes; on a GPU, the pool of as many 8,192-token sessions as the table says fit beside the weights, and
    one decode step of all of them."""
    from studies.server_quant import kv_bytes_per_token, served_bytes
    from infemeral.kvcache.paged import KVPages, PagedBatch, PagedSequence, PagePool
    from infemeral.layers.stack import LayerStack
    from infemeral.layers.attention_backends.selector import select_backend
    from infemeral.quant.served import weight_bytes

    plan, device, dtype = stage.plan, stage.device, stage.dtype
    config = plan.big
    served_layers = config.num_hidden_layers - 1
    heads = head_sets(plan)["8b"]
    shape = {"hidden": config.hidden_size, "ffn": config.intermediate_size, "layers": config.num_hidden_layers,
             "heads": heads[0], "kv_heads": heads[1], "head_dim": heads[2]}
    row = readme_fits_row("Llama-3-8B", "bfloat16")
    stage.record("readme row", row)
    cuda = device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    stack = LayerStack(config, 1, random_layers(config, served_layers, dtype, device), dtype=dtype, device=device)
    weights = weight_bytes(stack)
    figures = {"served layers": served_layers, "weights GB (measured)": weights / 1e9,
               "weights GB (formula)": served_bytes(shape, "bfloat16") / 1e9}
    if cuda:
        figures["weights GB (allocated)"] = (torch.cuda.memory_allocated() - before) / 1e9
    kv_token = kv_bytes_per_token(shape)
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else None
    column = next((c for c in reversed(list(row)) if c.startswith("sessions on ") and gpu_gb is not None
                   and float(c.split()[2]) <= gpu_gb), None)
    sessions = int(row[column]) if column and row[column].isdigit() else 2
    pages = sessions * -(-plan.memory_context // PAGE)
    stage.check(f"the pool of {sessions} sessions")
    before_pool = torch.cuda.memory_allocated() if cuda else 0
    kv = KVPages(pages, PAGE, 1, served_layers, heads[1], heads[2], dtype, device)
    figures.update({"sessions (README's column for this GPU)" if column else "sessions": sessions,
                    "README column": column or "none (not a GPU)", "context per session": plan.memory_context,
                    "KV GB per session (measured)": kv.nbytes / sessions / 1e9,
                    "KV GB per session (formula)": kv_token * plan.memory_context / 1e9})
    if cuda:
        figures["pool GB (allocated)"] = (torch.cuda.memory_allocated() - before_pool) / 1e9
    stage.record("memory", figures)
    backend = select_backend("auto", device, *heads, PAGE, dtype)
    pool = PagePool(pages, PAGE)
    seqs = [PagedSequence(pool, kv) for _ in range(sessions)]
    for s in seqs:
        s.reserve(PAGE + 1)
    stack.forward_batch(torch.randn(sessions * PAGE, config.hidden_size, device=device, dtype=dtype) * 0.1,
                        PagedBatch(kv, seqs, [PAGE] * sessions, backend))
    stack.forward_batch(torch.randn(sessions, config.hidden_size, device=device, dtype=dtype) * 0.1,
                        PagedBatch(kv, seqs, [1] * sessions, backend))
    synchronize(device)
    figures["decode step of every session"] = f"ran ({backend.name} backend)"
    if cuda:
        figures["peak GB"] = torch.cuda.max_memory_allocated() / 1e9
        figures["GPU GB"] = gpu_gb
    if not plan.dry_run:
        figures["weights vs README"] = figures["weights GB (measured)"] / float(row["weights GB"])
        figures["KV per session vs README"] = (figures["KV GB per session (measured)"]
                                               / float(row["KV per session GB"]))
    stage.record("memory", figures)
    for s in seqs:
        s.wipe()


# -- end to end ---------------------------------------------------------------------------------------------------
def random_chat_model(config):
    """A float32 LlamaForCausalLM of the shape (transformers' initialisation, norm gains drawn around 1) and a
    word-level tokenizer with a chat template: enough for prepare and a client's turn, nothing downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, config.vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>",
                                        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    return model, tokenizer


@contextlib.contextmanager
def serving(stage: Stage, server_dir: Path, name: str, in_process: bool = False):
    """A real infemeral-server serving `server_dir` (a subprocess on this device, plaintext on 127.0.0.1): its
    address, once it serves (its start-up self-checks passed); its log is <work>/<name>-server.log. `in_process`:
    the same server in this process instead (a new interpreter takes ~20 s to start on a busy CPU)."""
    from infemeral.client.health import wait_until_serving

    stage.check("starting the server")
    if in_process:
        from infemeral.server.app import Server
        from infemeral.server.settings import ServerSettings

        start = time.perf_counter()
        server = Server(ServerSettings(bundle=server_dir, listen="127.0.0.1:0", store=str(stage.work / f"{name}-store"),
                                       device=stage.device.type, dtype=str(stage.dtype)[6:], metrics_port=0)).start()
        stage.record("server start s", round(time.perf_counter() - start, 2))
        try:
            yield f"127.0.0.1:{server.port}"
        finally:
            server.stop(0)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = stage.work / f"{name}-server.log"
    env = dict(os.environ, INFEMERAL_BUNDLE=str(server_dir), INFEMERAL_STORE=str(stage.work / f"{name}-store"),
               INFEMERAL_LISTEN=f"127.0.0.1:{port}", INFEMERAL_DEVICE=stage.device.type,
               INFEMERAL_DTYPE=str(stage.dtype)[6:], INFEMERAL_METRICS_PORT="0",
               INFEMERAL_GRACE_SECONDS="0")
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "infemeral.server.main"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        try:
            wait_until_serving(f"127.0.0.1:{port}", proc, timeout=max(5.0, stage.deadline - time.monotonic()))
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}; the server's log ends: {log.read_text()[-1500:]}") from None
        stage.record("server start s", round(time.perf_counter() - start, 2))
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stage_e2e(stage: Stage) -> None:
    """A real infemeral-server serving a random-weight bundle of the default shape, and a client in this process:
    one short generation."""
    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams
    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource

    plan = stage.plan
    model, tokenizer = random_chat_model(plan.default)
    bundles = prepare(output=stage.work / "e2e-bundles", source=ModelSource(model, tokenizer, "random weights"),
                      progress=False)
    del model
    with serving(stage, bundles.server_dir, "e2e") as address:
        client = Client(address, bundles.client_dir, timeout=120, client_device="cpu")
        client.eos_ids = set()  # random weights: generate the tokens asked for
        try:
            ids = tokenizer(" ".join(f"w{3 + i * 7}" for i in range(24)))["input_ids"]
            result = client.new_session().complete(ids, SamplingParams(max_new_tokens=plan.e2e_tokens,
                                                                       speculate="off"))
        finally:
            client.close()
        stage.record("generation", {"prompt tokens": result.prompt_tokens, "generated": result.generated_tokens,
                                    "time to first token s": round(result.time_to_first_token, 3),
                                    "tokens per second": round(result.tokens_per_second, 1)})


def speculation_split(stage: Stage):
    """(bundles, draft head, what they are) of the speculation stage: the default model (--speculation-model: the
    packaged GGUF, 98 MB, brought in two calls where it is not installed) and the head the speculation benchmark
    trained on a CPU (--speculation-head, default .bundles/draft-head-default, carried along); in a dry run a
    random model of the default shape and a random head (the same code path, no figure that means anything)."""
    from bench.sections.speculation import HEAD_DIR

    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource

    if stage.plan.dry_run:
        from infemeral.speculation.head.model import HeadModel, layer_config

        model, tokenizer = random_chat_model(stage.plan.default)
        source, head, what = ModelSource(model, tokenizer, "random weights"), HeadModel(layer_config(model.config)), \
            "random weights, random head (dry run)"
    else:
        from infemeral.cloak.sources import load_model

        head = stage.lease.speculation_head or HEAD_DIR
        if not (head / "config.json").exists():
            raise FileNotFoundError(f"no draft head at {head}: carry the one the speculation benchmark trained "
                                    "(.bundles/draft-head-default, from scripts/bench.py --only speculation)")
        name = stage.lease.speculation_model
        model, tokenizer = load_model(name, torch.float32)  # FileNotFoundError names what is missing
        source = ModelSource(model, tokenizer, "packaged SmolLM2" if name == "default" else str(name),
                             packaged=name == "default")
        what = f"{'the packaged SmolLM2' if name == 'default' else name}, the draft head {head}"
    bundles = prepare(output=stage.work / "speculation-bundles", source=source, progress=False)
    return bundles, head, what


def stage_speculation(stage: Stage) -> None:
    """Chat where verification is cheap: the server on this GPU, a client on this machine's CPU with a draft head
    through scripts/delay_proxy.py at SPEC_RTT_MS; each held-out chat prompt with speculation off and with the
    head (trees where the server verifies them), greedy, in fresh sessions, alternating which goes first. The
    speedup is the mean over the prompts of tokens/s with / without; the figure is kept after every prompt."""
    from bench.workloads import CHAT_PROMPTS
    from delay_proxy import DelayProxy

    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams
    from infemeral.speculation.head.drafter import DraftHead

    plan = stage.plan
    bundles, head, what = speculation_split(stage)
    stage.record("model", what)
    with serving(stage, bundles.server_dir, "speculation", in_process=plan.dry_run) as address, \
            DelayProxy(address, rtt_ms=SPEC_RTT_MS) as proxy:
        client = Client(proxy.address, bundles.client_dir, timeout=120, client_device="cpu",
                        draft_head=head if isinstance(head, Path) else None)
        try:
            if not isinstance(head, Path):
                client.draft_head = DraftHead(head, client.model)
            if plan.dry_run:
                client.eos_ids = set()  # random weights: generate the tokens asked for
            stage.record("server verifies draft trees", client.server_info().draft_trees)

            def turn(prompt: str, speculate: str, n: int):
                session = client.new_session()
                try:
                    return session.chat(prompt, SamplingParams(max_new_tokens=n, speculate=speculate))
                finally:
                    session.delete()

            for speculate in ("off", "head"):
                turn("Hello!", speculate, 4)  # warm-up
            rows = []
            for i, prompt in enumerate(CHAT_PROMPTS[:plan.spec_prompts]):
                stage.check(f"chat prompt {i}")
                modes = ("off", "head") if i % 2 == 0 else ("head", "off")
                results = {mode: turn(prompt, mode, plan.spec_tokens) for mode in modes}
                off, on = results["off"], results["head"]
                rows.append({"prompt": i, "tokens": on.generated_tokens, "tokens/s off": round(off.tokens_per_second, 2),
                             "tokens/s head": round(on.tokens_per_second, 2),
                             "speedup": round(on.tokens_per_second / off.tokens_per_second, 3),
                             "tokens per round trip": round(1 + on.accepted_drafts / max(on.round_trips - 1, 1), 2),
                             "identical": on.token_ids == off.token_ids})
                stage.record("chat", rows)
                speedup = statistics.mean(r["speedup"] for r in rows)
                identical = sum(r["identical"] for r in rows)
                stage.target(f"chat_speedup_{SPEC_RTT_MS}ms", speedup,
                             f"{speedup:.2f}× ≥ 1.5× over {len(rows)} prompts, "
                             f"{statistics.mean(r['tokens per round trip'] for r in rows):.2f} tokens per round trip")
                stage.target("chat_greedy_identical", identical / len(rows), f"{identical} of {len(rows)} identical")
        finally:
            client.close()


STAGE_FUNCTIONS: dict[str, Callable[[Stage], None]] = {
    "env": stage_env, "kernels": stage_kernels, "attention": stage_attention, "self_check": stage_self_check,
    "exactness": stage_exactness, "throughput": stage_throughput, "memory": stage_memory, "e2e": stage_e2e,
    "speculation": stage_speculation}


# -- FlashInfer's kernel cache ----------------------------------------------------------------------------------
def flashinfer_dirs() -> tuple[Path, Path]:
    """Where FlashInfer builds modules at first use (JIT) and where it loads prebuilt ones from (AOT)."""
    from flashinfer.jit import env as jit_env

    missing = [name for name in ("FLASHINFER_JIT_DIR", "FLASHINFER_AOT_DIR") if not hasattr(jit_env, name)]
    if missing:
        raise RuntimeError(f"this FlashInfer's jit.env has no {', '.join(missing)}: its kernel cache is not where "
                           "gpu_lease.py looks (written against 0.7.2)")
    return Path(jit_env.FLASHINFER_JIT_DIR), Path(jit_env.FLASHINFER_AOT_DIR)


def install_kernels(source: Path) -> dict:
    """Modules of an earlier run (`<name>.so` or `<name>.so.xz`) put where FlashInfer loads prebuilt ones, so it
    does not compile them again (they must come from the same FlashInfer, torch and GPU architecture)."""
    _, aot = flashinfer_dirs()
    installed = []
    for path in sorted(source.iterdir()):
        if not path.name.endswith((".so", ".so.xz")):
            continue
        name = path.name.removesuffix(".xz").removesuffix(".so")
        target = aot / name / f"{name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        data = path.read_bytes()
        target.write_bytes(lzma.decompress(data) if path.name.endswith(".xz") else data)
        installed.append(name)
    return {"installed": installed, "into": str(aot)}


def collect_kernels(dest: Path) -> dict:
    """This run's compiled modules, xz-compressed under `dest`: bfloat16 ones first, at most KERNEL_FILES files
    of at most KERNEL_FILE_BYTES each, names of letters, digits and ._- only."""
    jit, _ = flashinfer_dirs()
    modules = sorted(jit.glob("*/*.so"), key=lambda p: ("bf16" not in p.name, p.stat().st_mtime))
    dest.mkdir(parents=True, exist_ok=True)
    kept, left = [], []
    for path in modules:
        packed = dest / f"{path.name}.xz"
        if not SAFE_NAME.fullmatch(packed.name) or len(kept) >= KERNEL_FILES:
            left.append(f"{path.name} ({'name' if not SAFE_NAME.fullmatch(packed.name) else 'more than the limit'})")
            continue
        if not packed.exists() or packed.stat().st_mtime < path.stat().st_mtime:
            data = lzma.compress(path.read_bytes(), preset=1)  # fast: 6 saves a tenth at seven times the time
            if len(data) > KERNEL_FILE_BYTES:
                left.append(f"{path.name} ({len(data) >> 20} MiB compressed)")
                continue
            packed.write_bytes(data)
        kept.append({"file": packed.name, "MiB": round(packed.stat().st_size / 2**20, 2)})
    return {"built here": len(modules), "kept": kept, "left out": left}


# -- command line ----------------------------------------------------------------------------------------------------
def parse_injections(items: list[str]) -> dict[str, str]:
    injected = {}
    for item in items:
        what, _, stage = item.partition(":")
        if what not in ("raise", "stall") or stage not in STAGES:
            raise SystemExit(f"--inject takes raise:STAGE or stall:STAGE (stages: {', '.join(STAGES)}), not {item!r}")
        injected[stage] = what
    return injected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="every stage on this CPU with tiny shapes "
                        "(FlashInfer parts skipped): what CI runs")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, from {', '.join(STAGES)}")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run; each stage's "
                        f"deadline is its share of what is left (default {GPU_BUDGET:.0f}; dry run {DRY_BUDGET:.0f})")
    parser.add_argument("--out", type=Path, default=None, help="where the report goes (default $OUT, else "
                        "./gpu-lease-out)")
    parser.add_argument("--kernel-cache", type=Path, default=None, help="FlashInfer modules (.so or .so.xz) "
                        "of an earlier run to install before anything compiles")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder for bundles, stores and "
                        "FlashInfer's builds (default: a new temporary folder)")
    parser.add_argument("--speculation-model", default="default", help="the speculation stage's model: 'default' "
                        "(the packaged SmolLM2, if installed) or its .gguf file brought along")
    parser.add_argument("--speculation-head", type=Path, default=None, help="the speculation stage's draft head "
                        "for that model (default .bundles/draft-head-default, what the speculation benchmark trains)")
    parser.add_argument("--inject", action="append", default=[], metavar="raise:STAGE|stall:STAGE",
                        help="make a stage fail or hang where it starts (to test this script)")
    args = parser.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    plan = dry_plan() if args.dry_run else gpu_plan()
    out = args.out or Path(os.environ.get("OUT") or "gpu-lease-out")
    work = args.work or Path(tempfile.mkdtemp(prefix="infemeral-lease-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(work / "flashinfer"))
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))  # ninja's parallel compiles
    budget = args.budget or (DRY_BUDGET if args.dry_run else GPU_BUDGET)
    lease = Lease(plan, [s for s in STAGES if s in stages], budget, out, work, parse_injections(args.inject),
                  list(argv if argv is not None else sys.argv[1:]))
    lease.speculation_model, lease.speculation_head = args.speculation_model, args.speculation_head
    if args.kernel_cache is not None and not args.kernel_cache.is_dir():
        lease.kernel_cache["carried in"] = f"none ({args.kernel_cache} is not a folder)"
    elif args.kernel_cache is not None and lease.flashinfer()[0] is not None:
        try:
            lease.kernel_cache["carried in"] = install_kernels(args.kernel_cache)
        except Exception as e:  # noqa: BLE001 - compiling again costs time, not results
            lease.kernel_cache["carried in"] = f"not installed: {type(e).__name__}: {e}"
    say(f"gpu_lease: {'dry run on the CPU' if plan.dry_run else 'GPU run'}, stages {', '.join(lease.stages)}, "
        f"budget {lease.budget:.0f} s, report in {out}")
    status = lease.run()
    if not plan.dry_run and not torch.cuda.is_available():
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
