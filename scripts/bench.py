"""Benchmarks of the split system against its baselines, each pair measured side by side in one run.

    .venv/bin/python scripts/bench.py                 # full run, rewrites docs/benchmarks/ (~5-8 min, 2-core CPU)
    .venv/bin/python scripts/bench.py --quick         # smoke run with fewer lengths/tokens (~3 min)
    .venv/bin/python scripts/bench.py --device cuda --model random-8b   # GPU: random-weight Llama of 8B shape

Sections (all run by default; `--only a,b` picks some):

  prepare      `infemeral-client prepare` in a subprocess (time, peak RSS) vs loading the same GGUF with transformers
  decode       decode tokens/s and time to first token: split over localhost gRPC vs plain transformers `generate`
  context      per-token decode latency at growing context lengths: split vs a plain DynamicCache forward loop
  wire         serialized request/response bytes per decode step and per prompt token (client interceptor)
  store        bytes written and time per commit over a many-turn session; cache load time vs cache size
  concurrency  aggregate throughput of 1..16 concurrent sessions vs one; plain batched `generate` for reference

Outputs: results.json (every number), REPORT.md (tables, targets PASS/MISS, analysis) and PNG plots, in --out
(default docs/benchmarks). Everything runs in this process against a real in-process gRPC server on
127.0.0.1; nothing is downloaded. Nothing here asserts absolute times: timings are reported, targets are ratios.

`--model random-8b` builds a random-weight Llama with a real 8B shape (hidden 4096, 32 layers, 32 heads,
8 KV heads, intermediate 14336, vocab 128256) in memory — meant for a GPU machine (~16 GB in bf16, plus
the bundles on disk); `random-tiny` is the same code path at toy size, for checking it on a CPU.
The split client always runs on the CPU (it is the user's laptop in the design); `--device` places the
server's layers and the plain baseline model.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import grpc  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "benchmarks"
SECTIONS = ("prepare", "decode", "context", "wire", "store", "concurrency")

# Targets (ratios and sizes only; no absolute times).
DECODE_TARGET = 0.85      # split decode tokens/s >= 0.85 x plain transformers at every context length
WIRE_SLACK = 512          # bytes per decode step <= 2 x hidden x bytes-per-element + 512
STORE_TARGET = 1.25       # late/early bytes written per new token (1.0 = independent of history)
CONCURRENCY_TARGET = 3.0  # 8 sessions >= 3 x one session's aggregate throughput

# Charles Dickens, "A Tale of Two Cities" (1859), public domain; repeated to build long prompts.
PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had "
    "everything before us, we had nothing before us, we were all going direct to Heaven, we were all going "
    "direct the other way. "
)
DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
STORE_PROMPT = "Tell me one more short fact about lighthouses (fact {i})."
CONCURRENCY_PROMPT = "Describe a busy harbour at dawn."

RANDOM_SHAPES = {
    "random-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256),
    "random-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=768, vocab_size=49152),
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Params:
    decode_tokens: int
    decode_reps: int
    contexts: list
    context_steps: int
    store_turns: int
    store_tokens: int
    concurrency: list
    concurrency_tokens: int
    concurrency_reps: int


FULL = Params(decode_tokens=64, decode_reps=3, contexts=[128, 256, 512, 1024, 2048, 4096], context_steps=32,
              store_turns=32, store_tokens=16, concurrency=[1, 4, 8, 16], concurrency_tokens=32,
              concurrency_reps=2)
QUICK = Params(decode_tokens=24, decode_reps=1, contexts=[128, 512], context_steps=16,
               store_turns=8, store_tokens=8, concurrency=[1, 4, 8], concurrency_tokens=16,
               concurrency_reps=1)

T0 = time.perf_counter()


def log(msg: str) -> None:
    s = int(time.perf_counter() - T0)
    print(f"[{s // 60:02d}:{s % 60:02d}] {msg}", flush=True)


def now() -> float:
    return time.perf_counter()


def median(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def mean(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.fmean(xs) if xs else float("nan")


def nz(x) -> float:
    """None (a NaN that went through JSON cleaning) back to NaN."""
    return float("nan") if x is None else x


def ratio(a: float, b: float) -> float:
    a, b = nz(a), nz(b)
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def clean(obj):
    """JSON-safe copy: NaN/inf -> None, floats rounded, tuples -> lists."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else round(obj, 6)
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def cpu_snapshot() -> dict:
    """Machine-wide busy/total CPU seconds (/proc/stat) and this process's own CPU seconds (incl. children)."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        fields = [0] * 8
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    own = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return {"busy": (user + nice + system + irq + softirq) / hz, "steal": steal / hz,
            "total": sum(fields) / hz, "own": own, "wall": now()}


def cpu_other(a: dict, b: dict) -> dict:
    """Share of the machine's CPU time that other processes (and the hypervisor) took between two snapshots."""
    total = b["total"] - a["total"]
    if total <= 0:
        return {"other_share": float("nan"), "steal_share": float("nan"), "own_share": float("nan")}
    other = max(0.0, (b["busy"] - a["busy"]) - (b["own"] - a["own"]))
    return {"other_share": other / total, "steal_share": (b["steal"] - a["steal"]) / total,
            "own_share": (b["own"] - a["own"]) / total}


def dir_size(path: Path, contains: str | None = None) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for f in files:
            p = os.path.join(base, f)
            if contains is None or contains in p:
                try:
                    total += os.path.getsize(p)
                except OSError:
                    pass
    return total


# -- instrumentation ---------------------------------------------------------------------------
@dataclass
class Msg:
    t: float
    kind: str
    size: int  # serialized protobuf bytes
    rows: int  # hidden-state rows carried (step messages)


def _msg(message) -> Msg:
    t = now()
    kind = message.WhichOneof("kind") or ""
    rows = 0
    if kind == "step":
        shape = list(message.step.hidden.shape)
        rows = int(shape[0]) if shape else 0
    return Msg(t, kind, message.ByteSize(), rows)


class TurnLog:
    """Every message of one Turn stream, in order, as seen by the client."""

    def __init__(self):
        self.sent: list[Msg] = []
        self.received: list[Msg] = []

    def steps(self) -> list[tuple[Msg, Msg]]:
        reqs = [m for m in self.sent if m.kind == "step"]
        resps = [m for m in self.received if m.kind == "step"]
        return list(zip(reqs, resps))

    def decode_steps(self, generated: int) -> list[tuple[Msg, Msg]]:
        """Every sampled token but the last is fed back as a one-row step: the last generated-1 steps."""
        steps = self.steps()
        k = max(0, generated - 1)
        return steps[len(steps) - k:] if k else []

    def prefill_steps(self, generated: int) -> list[tuple[Msg, Msg]]:
        steps = self.steps()
        return steps[:len(steps) - max(0, generated - 1)]

    def latency(self, sent_kind: str, received_kind: str) -> float:
        a = next((m.t for m in self.sent if m.kind == sent_kind), None)
        b = next((m.t for m in self.received if m.kind == received_kind), None)
        return b - a if a is not None and b is not None else float("nan")


class _RecordedCall:
    """The response iterator of a Turn call, recording each response; everything else is delegated."""

    def __init__(self, call, turn: TurnLog):
        self._call = call
        self._turn = turn

    def __iter__(self):
        return self

    def __next__(self):
        response = next(self._call)
        self._turn.received.append(_msg(response))
        return response

    def __getattr__(self, name):
        return getattr(self._call, name)


class WireRecorder(grpc.StreamStreamClientInterceptor):
    """Client interceptor: sizes and timestamps of every TurnRequest / TurnResponse."""

    def __init__(self):
        self.turns: list[TurnLog] = []
        self._lock = threading.Lock()

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        if not method.endswith("/Turn"):
            return continuation(client_call_details, request_iterator)
        turn = TurnLog()
        with self._lock:
            self.turns.append(turn)

        def tap():
            for request in request_iterator:
                turn.sent.append(_msg(request))
                yield request

        return _RecordedCall(continuation(client_call_details, tap()), turn)


class LayerTimer:
    """Wraps the engine's served layer stack to time each forward on the engine's worker thread: calling it,
    and any of its forward* methods (a batching engine calls e.g. `forward_batch`)."""

    def __init__(self, inner, sync):
        self._inner = inner
        self._sync = sync
        self.calls: list[tuple[int, float]] = []  # (rows, seconds)

    def _timed(self, fn, hidden, *args, **kwargs):
        t = now()
        out = fn(hidden, *args, **kwargs)
        self._sync()
        try:
            rows = int(hidden.shape[0])
        except Exception:  # noqa: BLE001 - a reworked engine may pass something else
            rows = -1
        self.calls.append((rows, now() - t))
        return out

    def __call__(self, hidden, *args, **kwargs):
        return self._timed(self._inner, hidden, *args, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name.startswith("forward") and callable(attr):
            return lambda hidden, *args, **kwargs: self._timed(attr, hidden, *args, **kwargs)
        return attr


class StoreMeter:
    """Bytes written to the session store: the store's own counters when it has them
    (`bytes_written`, `writes`), else by wrapping its write*/commit* methods on the instance."""

    def __init__(self, store, root: Path | None):
        self.store = store
        self.root = root
        self.has_counters = hasattr(store, "bytes_written") and hasattr(store, "writes")
        self.bytes = 0
        self.calls = 0
        self.seconds = 0.0
        self.wrapped: list[str] = []
        self._lock = threading.Lock()
        for name in dir(type(store)):
            if name.startswith(("write", "commit")) and callable(getattr(store, name, None)):
                setattr(store, name, self._wrap(getattr(store, name)))
                self.wrapped.append(name)

    def _wrap(self, fn):
        def wrapped(*args, **kwargs):
            t = now()
            out = fn(*args, **kwargs)
            dt = now() - t
            n = sum(len(x) for x in (*args, *kwargs.values()) if isinstance(x, (bytes, bytearray, memoryview)))
            with self._lock:
                self.bytes += n
                self.calls += 1
                self.seconds += dt
            return out
        return wrapped

    @property
    def method(self) -> str:
        if self.has_counters:
            return "store counters (bytes_written, writes)"
        if self.wrapped:
            return "bytes passed to the store's " + ", ".join(f"{n}()" for n in self.wrapped)
        return "size of the store directory on disk"

    def snapshot(self) -> dict:
        disk = dir_size(self.root) if self.root is not None else 0
        if self.has_counters:
            b, w = int(self.store.bytes_written), int(self.store.writes)
        elif self.wrapped:
            b, w = self.bytes, self.calls
        else:
            b, w = disk, 0
        return {"bytes": b, "writes": w, "seconds": self.seconds, "disk": disk}


class Stamps:
    """A stopping criterion that never stops, only timestamps every generated token."""

    def __init__(self, sync):
        self.sync = sync
        self.t: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.sync()
        self.t.append(now())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_measured(cmd: list[str]) -> dict:
    """Run a subprocess; its wall time and its own peak RSS (wait4 rusage of that one child)."""
    with tempfile.TemporaryFile() as err:
        t = now()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = now() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2000:]
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with code {proc.returncode}:\n{tail}")
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024}


LOAD_GGUF = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging
logging.disable_progress_bar()
from infemeral.cloak.sources import default_gguf_path
p = default_gguf_path()
AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
"""


# -- the benchmark --------------------------------------------------------------------------
class Bench:
    def __init__(self, args, params: Params, tmp: Path):
        self.args = args
        self.P = params
        self.tmp = tmp
        self.device = args.device
        self.dtype_name = args.dtype or ("bfloat16" if self.device == "cuda" else "float32")
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype_name]
        self.sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        self.sections = set(args.only.split(",")) if args.only else set(SECTIONS)
        self.results: dict = {"sections": {}}
        self.decode_turns: list[tuple[TurnLog, int]] = []
        self.load_sessions: list[tuple[int, object, float, float]] = []  # (length, session, split ttft, plain prefill)
        self.server = self.client = self.recorder = self.layer_timer = self.store_meter = None

    # -- setup ------------------------------------------------------------------------------
    def run(self) -> dict:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.cpu_start = cpu_snapshot()
        self.results["machine"] = machine_info(self.device)
        self.results["machine"]["loadavg_start"] = os.getloadavg()
        self.results["config"] = {"mode": "quick" if self.args.quick else "full", "model": self.args.model,
                                  "device": self.device, "dtype": self.dtype_name, "params": asdict(self.P),
                                  "command": " ".join(["scripts/bench.py"] + sys.argv[1:]),
                                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        log(f"machine: {self.results['machine']['cpu']} ({self.results['machine']['cores']} cores), "
            f"torch {torch.__version__}, device {self.device}, dtype {self.dtype_name}")
        if self.args.model == "default":
            self.setup_default()
        else:
            self.setup_random(self.args.model)
        self.start_server()
        try:
            self.warm_up()
            for name in ("decode", "context", "wire", "store", "concurrency"):
                if name in self.sections:
                    t, cpu = now(), cpu_snapshot()
                    log(f"== {name} ==")
                    getattr(self, f"section_{name}")()
                    self.results["sections"][name]["section_seconds"] = now() - t
                    self.results["sections"][name]["cpu"] = cpu_other(cpu, cpu_snapshot())
        finally:
            self.stop_server()
        self.results["total_seconds"] = now() - T0
        self.results["cpu"] = cpu_other(self.cpu_start, cpu_snapshot())
        self.results["machine"]["loadavg_end"] = os.getloadavg()
        if self.results["cpu"]["other_share"] > 0.05:
            log(f"note: other processes used {self.results['cpu']['other_share']:.0%} of this machine's CPU during "
                "the run; timings are noisier than on an idle machine")
        return self.results

    def setup_default(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from infemeral.cloak.sources import default_gguf_path

        out = self.tmp / "bundles"
        if "prepare" in self.sections:
            cpu = cpu_snapshot()
            log("== prepare ==")
            exe = Path(sys.executable).parent / "infemeral-client"
            prep_cmd = ([str(exe)] if exe.exists() else
                        [sys.executable, "-c", "import sys; from infemeral.client.cli import main; sys.exit(main())"])
            prep_cmd += ["prepare", "--output", str(out), "--quiet"]
            log("baseline: loading the packaged GGUF with transformers in a subprocess")
            base = run_measured([sys.executable, "-c", LOAD_GGUF])
            log(f"  {base['seconds']:.1f} s, peak RSS {base['peak_rss_mb']:.0f} MB")
            log("infemeral-client prepare --output <tmp> --quiet (subprocess)")
            prep = run_measured(prep_cmd)
            log(f"  {prep['seconds']:.1f} s, peak RSS {prep['peak_rss_mb']:.0f} MB")
            gguf = default_gguf_path()
            self.results["sections"]["prepare"] = {
                "source": f"{gguf.name} (packaged GGUF)", "how": "subprocess; peak RSS from wait4() of that child",
                "prepare": prep, "baseline_load": base,
                "time_ratio": ratio(prep["seconds"], base["seconds"]),
                "rss_ratio": ratio(prep["peak_rss_mb"], base["peak_rss_mb"]),
                "gguf_mb": gguf.stat().st_size / 2**20,
                "client_bundle_mb": dir_size(out / "client") / 2**20,
                "server_bundle_mb": dir_size(out / "server") / 2**20,
                "section_seconds": now() - cpu["wall"], "cpu": cpu_other(cpu, cpu_snapshot()),
            }
        log("loading the reference model (transformers, from the packaged GGUF)")
        path = default_gguf_path()
        with contextlib.redirect_stderr(io.StringIO()):  # the GGUF dequantiser draws its own progress bar
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        if "prepare" not in self.sections:
            from infemeral.cloak.prepare import prepare
            from infemeral.cloak.sources import ModelSource

            log("preparing bundles in-process (prepare section skipped)")
            prepare(output=out, source=ModelSource(model, tokenizer, "packaged SmolLM2"), progress=False)
        self.model = model.to(self.device, self.dtype)
        self.model_name = "SmolLM2-135M-Instruct (packaged GGUF, dequantised)"
        self.client_dir, self.server_dir = out / "client", out / "server"

    def setup_random(self, name: str) -> None:
        from transformers import AutoTokenizer

        from infemeral.cloak.prepare import prepare
        from infemeral.cloak.sources import ModelSource, default_gguf_path

        path = default_gguf_path()  # only for a tokenizer; the weights are random
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        bundle_dtype = "float32" if self.dtype == torch.float32 else self.dtype_name
        log(f"building a random-weight Llama ({name}: {RANDOM_SHAPES[name]}) in {bundle_dtype}")
        t = now()
        model = build_random_llama(name, getattr(torch, bundle_dtype), tokenizer)
        build = now() - t
        params = sum(p.numel() for p in model.parameters())
        log(f"  {params / 1e9:.2f} B parameters in {build:.1f} s; preparing bundles in-process")
        out = self.tmp / "bundles"
        t = now()
        prepare(output=out, source=ModelSource(model, tokenizer, f"{name} (random weights)"), dtype=bundle_dtype,
                progress=False)
        prep = now() - t
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        log(f"  prepared in {prep:.1f} s (process peak RSS so far {peak:.0f} MB)")
        if "prepare" in self.sections:
            self.results["sections"]["prepare"] = {
                "source": f"{name}: random-weight Llama, {params / 1e9:.2f} B parameters, built in memory",
                "how": "in-process; peak RSS is this process's peak so far (includes the model itself)",
                "prepare": {"seconds": prep, "peak_rss_mb": peak},
                "baseline_load": {"seconds": build, "peak_rss_mb": float("nan"), "what": "building the model"},
                "time_ratio": ratio(prep, build), "rss_ratio": float("nan"), "gguf_mb": float("nan"),
                "client_bundle_mb": dir_size(out / "client") / 2**20,
                "server_bundle_mb": dir_size(out / "server") / 2**20,
            }
        self.model = model.to(self.device, self.dtype).eval()
        self.model_name = f"{name}: random-weight Llama ({params / 1e9:.2f} B parameters)"
        self.client_dir, self.server_dir = out / "client", out / "server"

    def start_server(self) -> None:
        from infemeral.client.sdk import Client
        from infemeral.config import ServerSettings
        from infemeral.server.app import Server

        store = self.tmp / "store"
        settings = ServerSettings(bundle=self.server_dir, listen="127.0.0.1:0", store=str(store),
                                  device=self.device, dtype=self.dtype_name)
        self.server = Server(settings).start()
        engine = self.server.engine
        if callable(getattr(engine, "layers", None)):
            self.layer_timer = LayerTimer(engine.layers, self.sync)
            engine.layers = self.layer_timer
        self.store_meter = StoreMeter(engine.store, store)
        self.recorder = WireRecorder()
        self.client = Client(f"127.0.0.1:{self.server.port}", self.client_dir, timeout=600,
                             interceptors=[self.recorder])
        self.eos_ids = set(self.client.eos_ids)
        # Both sides generate exactly the requested number of tokens: plain `generate` gets min_new_tokens,
        # and the split client is told no token ends the answer (it then just keeps decoding).
        self.client.eos_ids = set()
        info = self.client.server_info()
        cfg = self.client.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = info.hidden_size
        self.wire_dtype = info.dtype
        self.kv_bytes_per_token = 2 * info.num_layers * cfg.num_key_value_heads * head_dim * ITEMSIZE[info.dtype]
        self.results["system"] = {
            "model": self.model_name, "hidden_size": info.hidden_size, "total_layers": info.total_layers,
            "vocab_size": cfg.vocab_size,
            "server_layers": info.num_layers, "first_server_layer": info.first_layer,
            "server_device": info.device, "server_dtype": info.dtype, "client": "CPU, float32",
            "max_step_tokens": info.max_step_tokens, "max_context": info.max_context,
            "kv_bytes_per_token_server": self.kv_bytes_per_token,
            "plain_baseline": f"transformers {type(self.model).__name__} on {self.device} in {self.dtype_name}, "
                              f"attention {self.model.config._attn_implementation}",
            "store": f"{type(engine.store).__name__} in a temporary directory; bytes from {self.store_meter.method}",
            "layer_timer": self.layer_timer is not None,
        }
        log(f"server on 127.0.0.1:{self.server.port}: {info.num_layers} of {info.total_layers} layers on "
            f"{info.device} in {info.dtype}; store metered by {self.store_meter.method}")

    def stop_server(self) -> None:
        for _, session, _, _ in self.load_sessions:
            try:
                session.delete()
            except Exception:  # noqa: BLE001
                pass
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop(0)

    # -- primitives -------------------------------------------------------------------------
    def template(self, text: str) -> list[int]:
        ids = self.client.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                        add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def prompt_of_length(self, length: int) -> tuple[str, list[int]]:
        """A user message whose chat-templated prompt is `length` tokens (or as close as tokenization allows)."""
        tok = self.client.tokenizer
        pool = tok(PASSAGE * (length // 40 + 4), add_special_tokens=False)["input_ids"]
        k = max(1, length - len(self.template("")))
        best = None
        for _ in range(10):
            text = tok.decode(pool[:k])
            ids = self.template(text)
            if best is None or abs(len(ids) - length) < abs(len(best[1]) - length):
                best = (text, ids)
            if len(ids) == length:
                break
            k = max(1, k + length - len(ids))
        return best

    def layer_mark(self) -> int:
        return len(self.layer_timer.calls) if self.layer_timer else 0

    def layer_calls(self, mark: int) -> list[tuple[int, float]]:
        return self.layer_timer.calls[mark:] if self.layer_timer else []

    def plain_generate(self, ids: list[int], n: int, batch: int = 1) -> dict:
        from transformers import StoppingCriteriaList

        x = torch.tensor([ids] * batch, device=self.device)
        stamps = Stamps(self.sync)
        gen = self.model.generation_config
        pad = gen.pad_token_id if gen.pad_token_id is not None else next(iter(self.eos_ids), 0)
        self.sync()
        t0 = now()
        with torch.inference_mode():
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                                      stopping_criteria=StoppingCriteriaList([stamps]))
        self.sync()
        wall = now() - t0
        tokens = out[:, len(ids):]
        decode = stamps.t[-1] - stamps.t[0]
        return {"generated_tokens": int(tokens.shape[1]), "batch": batch, "wall_seconds": wall,
                "time_to_first_token": stamps.t[0] - t0, "decode_seconds": decode,
                "tokens_per_second": (len(stamps.t) - 1) / decode if decode > 0 else float("nan"),
                "token_ids": tokens[0].tolist()}

    def plain_prefill(self, ids: list[int]) -> dict:
        """Prefill with a DynamicCache (the state for plain_steps); time to the first token's id on the host."""
        from transformers import DynamicCache

        x = torch.tensor([ids], device=self.device)
        with torch.inference_mode():
            cache = DynamicCache(config=self.model.config)
            self.sync()
            t = now()
            out = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            int(nxt[0, 0])
            prefill = now() - t
        return {"cache": cache, "next": nxt, "prefill_seconds": prefill, "step_seconds": []}

    def plain_steps(self, state: dict, steps: int) -> dict:
        """`steps` single-token forwards + argmax over the state's cache, each timed."""
        with torch.inference_mode():
            for _ in range(steps):
                t = now()
                out = self.model(input_ids=state["next"], past_key_values=state["cache"], use_cache=True)
                state["next"] = out.logits[:, -1:].argmax(-1)
                int(state["next"][0, 0])  # the token is on the host, as a sampler would need it
                state["step_seconds"].append(now() - t)
        return state

    def plain_forward_loop(self, ids: list[int], steps: int) -> dict:
        state = self.plain_steps(self.plain_prefill(ids), steps)
        state.pop("cache")
        return state

    def split_turn(self, text: str, n: int, session=None, delete: bool = True) -> dict:
        from infemeral.client.sampling import SamplingParams

        s = session or self.client.new_session()
        k0, l0 = len(self.recorder.turns), self.layer_mark()
        t = now()
        r = s.chat(text, SamplingParams(max_new_tokens=n))
        wall = now() - t
        turn = self.recorder.turns[k0]
        decode = turn.decode_steps(r.generated_tokens)
        sends = [q.t for q, _ in decode]
        calls = self.layer_calls(l0)
        decode_calls = calls[len(calls) - len(decode):] if decode and len(calls) >= len(decode) else []
        out = {"generated_tokens": r.generated_tokens, "prompt_tokens": r.prompt_tokens, "wall_seconds": wall,
               "time_to_first_token": r.time_to_first_token, "decode_seconds": r.decode_seconds,
               "tokens_per_second": r.tokens_per_second, "cache_length": r.cache_length,
               "token_ids": list(r.token_ids),
               "open_seconds": turn.latency("open", "opened"), "commit_seconds": turn.latency("commit", "committed"),
               "token_intervals": [b - a for a, b in zip(sends, sends[1:])],
               "step_round_trips": [b.t - a.t for a, b in decode],
               "server_layer_seconds": [dt for _, dt in decode_calls],
               "turn": turn}
        if delete:
            s.delete()
        return out

    def warm_up(self) -> None:
        log("warm-up (one short plain generate, one short split turn)")
        self.plain_generate(self.template("Hello!"), 4)
        self.split_turn("Hello!", 4)

    # -- 1. decode --------------------------------------------------------------------------
    def section_decode(self) -> None:
        n, ids = self.P.decode_tokens, self.template(DECODE_PROMPT)
        runs: dict[str, list] = {"split": [], "plain": []}
        for rep in range(self.P.decode_reps):
            for system in (("plain", "split") if rep % 2 == 0 else ("split", "plain")):
                r = self.plain_generate(ids, n) if system == "plain" else self.split_turn(DECODE_PROMPT, n)
                runs[system].append(r)
                log(f"  rep {rep + 1}/{self.P.decode_reps} {system:5s}: {r['tokens_per_second']:6.1f} tok/s, "
                    f"TTFT {r['time_to_first_token'] * 1000:6.1f} ms, {r['generated_tokens']} tokens")
        self.decode_turns = [(r["turn"], r["generated_tokens"]) for r in runs["split"]]
        split_ids, plain_ids = runs["split"][0]["token_ids"], runs["plain"][0]["token_ids"]
        agree = next((i for i, (a, b) in enumerate(zip(split_ids, plain_ids)) if a != b), min(len(split_ids),
                                                                                               len(plain_ids)))
        first_eos = next((i for i, t in enumerate(split_ids) if t in self.eos_ids), None)
        sec = {"prompt_tokens": len(ids), "new_tokens": n, "reps": self.P.decode_reps,
               "split": summarize_runs(runs["split"]), "plain": summarize_runs(runs["plain"]),
               "greedy_tokens_identical": agree, "split_first_eos_at": first_eos,
               "runs": {k: [strip(r) for r in v] for k, v in runs.items()}}
        sec["tps_ratio"] = ratio(sec["split"]["tokens_per_second"], sec["plain"]["tokens_per_second"])
        sec["ttft_ratio"] = ratio(sec["split"]["time_to_first_token"], sec["plain"]["time_to_first_token"])
        self.results["sections"]["decode"] = sec
        log(f"  split/plain decode tokens/s = {sec['tps_ratio']:.2f}, TTFT ratio {sec['ttft_ratio']:.2f}; "
            f"greedy tokens identical for the first {agree} of {n}")

    # -- 2. context -------------------------------------------------------------------------
    def section_context(self) -> None:
        steps = self.P.context_steps
        rows = []
        for i, length in enumerate(self.P.contexts):
            text, ids = self.prompt_of_length(length)
            # Plain, split, plain: the plain decode steps are split around the split turn (continuing the same
            # cache), so slow drift or a burst of other load on the machine hits both sides alike.
            state = self.plain_prefill(ids)
            self.plain_steps(state, steps // 2)
            session = self.client.new_session()
            split = self.split_turn(text, steps + 1, session=session, delete=False)
            self.plain_steps(state, steps - steps // 2)
            state.pop("cache")
            got = {"split": split, "plain": state, "session": session}
            sp, pl = got["split"], got["plain"]
            row = {
                "target_length": length, "context_tokens": len(ids), "split_prompt_tokens": sp["prompt_tokens"],
                "decode_steps": steps,
                "split_token_ms": median(sp["token_intervals"]) * 1000,
                "split_token_ms_mean": sp["decode_seconds"] / max(1, sp["generated_tokens"] - 1) * 1000,
                "split_round_trip_ms": median(sp["step_round_trips"]) * 1000,
                "split_server_layers_ms": median(sp["server_layer_seconds"]) * 1000,
                "split_ttft_ms": sp["time_to_first_token"] * 1000,
                "split_open_ms": sp["open_seconds"] * 1000, "split_commit_ms": sp["commit_seconds"] * 1000,
                "plain_token_ms": median(pl["step_seconds"]) * 1000,
                "plain_token_ms_mean": mean(pl["step_seconds"]) * 1000,
                "plain_prefill_ms": pl["prefill_seconds"] * 1000,
            }
            row["split_client_ms"] = row["split_token_ms"] - row["split_round_trip_ms"]
            row["split_transport_ms"] = row["split_round_trip_ms"] - row["split_server_layers_ms"]
            row["decode_ratio"] = ratio(row["plain_token_ms"], row["split_token_ms"])  # split tok/s / plain tok/s
            row["decode_ratio_mean"] = ratio(row["plain_token_ms_mean"], row["split_token_ms_mean"])
            row["prefill_ratio"] = ratio(row["plain_prefill_ms"], row["split_ttft_ms"])
            row["wire"] = wire_of(sp["turn"], sp["generated_tokens"])
            rows.append(row)
            self.load_sessions.append((sp["cache_length"], got["session"], sp["time_to_first_token"],
                                       pl["prefill_seconds"]))
            log(f"  context {len(ids):5d}: split {row['split_token_ms']:6.1f} ms/token, plain "
                f"{row['plain_token_ms']:6.1f} ms/token -> split/plain throughput {row['decode_ratio']:.2f}; "
                f"prefill split {row['split_ttft_ms']:7.0f} ms, plain {row['plain_prefill_ms']:7.0f} ms")
        probe = self.attention_probe(max(r["context_tokens"] for r in rows))
        log(f"  attention kernel at {probe['tokens']} tokens, one layer: explicit causal mask "
            f"{probe['mask_ms']:.1f} ms vs is_causal {probe['is_causal_ms']:.1f} ms")
        self.results["sections"]["context"] = {
            "rows": rows, "attention_probe": probe,
            "metric": "median per-token latency over the decode steps (split: interval between successive "
                      "decode-step sends, i.e. one full token cycle; plain: one single-token forward + argmax "
                      "with a DynamicCache, half of the steps before and half after the split turn)",
            "min_ratio": min(nz(r["decode_ratio"]) for r in rows),
        }

    def attention_probe(self, length: int, reps: int = 3) -> dict:
        """One layer's prefill attention at `length` tokens, as the split engine calls it (boolean causal mask)
        and as transformers' sdpa path calls it for a cache-less prompt (is_causal=True)."""
        import torch.nn.functional as F

        cfg = self.client.model.config
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        g = torch.Generator(device=self.device).manual_seed(0)
        q = torch.randn(1, heads, length, hd, device=self.device, dtype=self.dtype, generator=g)
        k = torch.randn(1, kv, length, hd, device=self.device, dtype=self.dtype, generator=g)
        v = torch.randn(1, kv, length, hd, device=self.device, dtype=self.dtype, generator=g)
        mask = torch.ones(length, length, dtype=torch.bool, device=self.device).tril(0)
        out = {"tokens": length, "heads": heads, "kv_heads": kv, "head_dim": hd}
        for name, kw in (("mask_ms", {"attn_mask": mask}), ("is_causal_ms", {"is_causal": True})):
            times = []
            for _ in range(reps + 1):
                self.sync()
                t = now()
                F.scaled_dot_product_attention(q, k, v, enable_gqa=kv != heads, **kw)
                self.sync()
                times.append(now() - t)
            out[name] = median(times[1:]) * 1000
        return out

    # -- 3. wire ----------------------------------------------------------------------------
    def section_wire(self) -> None:
        per_context = []
        ctx = self.results["sections"].get("context")
        if ctx:
            per_context = [{"context_tokens": r["context_tokens"], **r["wire"]} for r in ctx["rows"]]
        turns = list(self.decode_turns)
        if not per_context and not turns:
            log("  no turns recorded yet; running one 16-token turn")
            r = self.split_turn(DECODE_PROMPT, 16)
            turns = [(r["turn"], r["generated_tokens"])]
        samples = [wire_of(t, g) for t, g in turns] + per_context
        req = [x for s in samples for x in s["decode_request_sizes"]]
        resp = [x for s in samples for x in s["decode_response_sizes"]]
        total = [a + b for a, b in zip(req, resp)]
        prefill_bytes = sum(s["prefill_request_bytes"] for s in samples)
        prefill_rows = sum(s["prefill_rows"] for s in samples)
        bpe = ITEMSIZE[self.wire_dtype]
        target = 2 * self.hidden * bpe + WIRE_SLACK
        sec = {
            "hidden_size": self.hidden, "wire_dtype": self.wire_dtype, "bytes_per_element": bpe,
            "target_bytes_per_step": target, "payload_bytes_per_step": 2 * self.hidden * bpe,
            "decode_steps_measured": len(total),
            "decode_request_bytes": {"min": min(req), "median": median(req), "max": max(req)},
            "decode_response_bytes": {"min": min(resp), "median": median(resp), "max": max(resp)},
            "decode_step_bytes": {"min": min(total), "median": median(total), "max": max(total)},
            "framing_overhead_bytes": max(total) - 2 * self.hidden * bpe,
            "prefill_request_bytes_per_token": prefill_bytes / prefill_rows if prefill_rows else float("nan"),
            "prefill_payload_bytes_per_token": self.hidden * bpe,
            "per_context": [{k: v for k, v in p.items() if not k.endswith("_sizes")} for p in per_context],
            "note": "serialized protobuf sizes of TurnRequest/TurnResponse; gRPC adds a 5-byte length prefix and "
                    "HTTP/2 a 9-byte DATA frame header per message (not counted)",
        }
        self.results["sections"]["wire"] = sec
        log(f"  decode step: request {sec['decode_request_bytes']['max']} B + response "
            f"{sec['decode_response_bytes']['max']} B = {sec['decode_step_bytes']['max']} B (target <= {target} B); "
            f"prefill {sec['prefill_request_bytes_per_token']:.0f} B per prompt token")

    # -- 4. store ---------------------------------------------------------------------------
    def section_store(self) -> None:
        from infemeral.client.sampling import SamplingParams

        meter = self.store_meter
        s = self.client.new_session()
        commits = []
        for i in range(self.P.store_turns):
            before = meter.snapshot()
            history = len(s.history_ids)
            k0 = len(self.recorder.turns)
            r = s.chat(STORE_PROMPT.format(i=i + 1), SamplingParams(max_new_tokens=self.P.store_tokens))
            after = meter.snapshot()
            turn = self.recorder.turns[k0]
            new_tokens = r.cache_length - (history - r.truncated_tokens)
            c = {"turn": i + 1, "history_tokens": history, "cache_length": r.cache_length,
                 "new_tokens": new_tokens, "truncated_tokens": r.truncated_tokens,
                 "bytes_written": after["bytes"] - before["bytes"], "writes": after["writes"] - before["writes"],
                 "store_write_seconds": after["seconds"] - before["seconds"],
                 "commit_ms": turn.latency("commit", "committed") * 1000,
                 "open_ms": turn.latency("open", "opened") * 1000,
                 "store_disk_bytes": after["disk"],
                 "new_tokens_kv_bytes": new_tokens * self.kv_bytes_per_token,
                 "whole_cache_kv_bytes": r.cache_length * self.kv_bytes_per_token}
            c["bytes_per_new_token"] = c["bytes_written"] / new_tokens if new_tokens > 0 else float("nan")
            commits.append(c)
            if i % max(1, self.P.store_turns // 8) == 0 or i == self.P.store_turns - 1:
                log(f"  turn {i + 1:3d}: history {history:5d} tokens, +{new_tokens} tokens, wrote "
                    f"{c['bytes_written'] / 1024:8.1f} KiB in {c['writes']} write(s), commit {c['commit_ms']:6.1f} ms")
        s.delete()
        third = max(1, len(commits) // 3)
        early, late = commits[:third], commits[-third:]
        b_early = median([c["bytes_per_new_token"] for c in early])
        b_late = median([c["bytes_per_new_token"] for c in late])
        a_early = sum(c["bytes_written"] for c in early) / max(1, sum(c["new_tokens"] for c in early))
        a_late = sum(c["bytes_written"] for c in late) / max(1, sum(c["new_tokens"] for c in late))
        hist = [c["history_tokens"] for c in commits]
        # Bytes beyond the new tokens' own KV, against the history: 0 if a commit's cost ignores the history,
        # kv_bytes_per_token if it rewrites all of it.
        slope = linear_slope(hist, [c["bytes_written"] - c["new_tokens_kv_bytes"] for c in commits])
        sec = {"method": meter.method, "turns": len(commits), "tokens_per_turn_generated": self.P.store_tokens,
               "kv_bytes_per_token": self.kv_bytes_per_token, "commits": commits,
               "early_bytes_per_new_token": b_early, "late_bytes_per_new_token": b_late,
               "late_over_early": ratio(b_late, b_early),
               "amortized_late_over_early": ratio(a_late, a_early),
               "bytes_per_history_token_slope": slope,
               "history_share": ratio(slope, self.kv_bytes_per_token),
               "compactions": [c["turn"] for c in commits
                               if c["bytes_written"] > 2 * c["new_tokens_kv_bytes"] + (1 << 16)],
               "total_over_new_kv": ratio(sum(c["bytes_written"] for c in commits),
                                          sum(c["new_tokens_kv_bytes"] for c in commits)),
               "commit_ms_early": median([c["commit_ms"] for c in early]),
               "commit_ms_late": median([c["commit_ms"] for c in late])}
        log(f"  bytes per new token: early {b_early:,.0f}, late {b_late:,.0f} (x{sec['late_over_early']:.2f}); "
            f"slope {slope:,.0f} B per history token per commit ({sec['history_share']:.2f} of a whole-cache rewrite)")

        # Cache load time vs cache size: open a turn on sessions of growing length.
        if not self.load_sessions:
            log("  creating sessions of growing length for the load measurement")
            for length in self.P.contexts:
                text, ids = self.prompt_of_length(length)
                sess = self.client.new_session()
                r = self.split_turn(text, 1, session=sess, delete=False)
                pl = self.plain_forward_loop(ids, 0)
                self.load_sessions.append((r["cache_length"], sess, r["time_to_first_token"], pl["prefill_seconds"]))
        loads = []
        for length, sess, split_ttft, plain_prefill in self.load_sessions:
            stored = dir_size(meter.root, sess.id.hex()) if meter.root else 0
            r = self.split_turn("OK.", 1, session=sess, delete=False)
            loads.append({"cache_tokens": length, "stored_bytes": stored,
                          "plaintext_kv_bytes": length * self.kv_bytes_per_token,
                          "open_ms": r["open_seconds"] * 1000,
                          "plain_reprefill_ms": plain_prefill * 1000, "split_reprefill_ms": split_ttft * 1000})
            log(f"  load {length:5d} tokens ({stored / 2**20:6.1f} MiB stored): open {r['open_seconds'] * 1000:7.1f} ms"
                f" vs re-prefill {plain_prefill * 1000:7.0f} ms plain")
        for _, sess, _, _ in self.load_sessions:
            sess.delete()
        self.load_sessions = []
        sec["loads"] = loads
        self.results["sections"]["store"] = sec

    # -- 5. concurrency ---------------------------------------------------------------------
    def section_concurrency(self) -> None:
        n_tokens = self.P.concurrency_tokens
        ids = self.template(CONCURRENCY_PROMPT)
        rows = []
        for n in self.P.concurrency:
            splits, plains = [], []
            for rep in range(self.P.concurrency_reps):
                for system in (("split", "plain") if rep % 2 == 0 else ("plain", "split")):
                    if system == "split":
                        splits.append(self.split_concurrent(n, n_tokens))
                    else:
                        plain = self.plain_generate(ids, n_tokens, batch=n)
                        plains.append(n * plain["generated_tokens"] / plain["wall_seconds"])
            # Best of the repeats on both sides: on a shared machine the fastest run is the one least disturbed.
            split = max(splits, key=lambda r: r["aggregate_tokens_per_second"])
            plain_agg = max(plains)
            rows.append({"sessions": n, **split, "plain_batched_tokens_per_second": plain_agg,
                         "all_split_tokens_per_second": [r["aggregate_tokens_per_second"] for r in splits],
                         "all_plain_batched_tokens_per_second": plains})
            log(f"  {n:2d} sessions: split {split['aggregate_tokens_per_second']:6.1f} tok/s total "
                f"({split['mean_session_tokens_per_second']:5.1f} per session, {split['steps_per_layer_call']:.2f} "
                f"steps per engine call); plain batch of {n}: {plain_agg:6.1f} tok/s"
                + (f" (best of {self.P.concurrency_reps})" if self.P.concurrency_reps > 1 else ""))
        one = next(r for r in rows if r["sessions"] == 1)
        for r in rows:
            r["scaling"] = ratio(r["aggregate_tokens_per_second"], one["aggregate_tokens_per_second"])
            r["plain_batched_scaling"] = ratio(r["plain_batched_tokens_per_second"],
                                               one["plain_batched_tokens_per_second"])
        self.results["sections"]["concurrency"] = {
            "tokens_per_session": n_tokens, "prompt_tokens": len(ids), "rows": rows,
            "reps": self.P.concurrency_reps,
            "metric": "all sessions start together (barrier); aggregate = generated tokens of all sessions / wall "
                      "time until the last turn committed (includes open, prefill and commit)"}

    def split_concurrent(self, n: int, tokens: int) -> dict:
        from infemeral.client.sampling import SamplingParams

        sessions = [self.client.new_session() for _ in range(n)]
        barrier = threading.Barrier(n + 1)
        results: list = [None] * n
        ends = [0.0] * n
        errors: list[str] = []

        def work(i):
            barrier.wait()
            try:
                results[i] = sessions[i].chat(CONCURRENCY_PROMPT, SamplingParams(max_new_tokens=tokens))
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                errors.append(f"{type(e).__name__}: {e}")
            ends[i] = now()

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        k0, l0 = len(self.recorder.turns), self.layer_mark()
        stats0 = dict(getattr(self.server.engine, "stats", None) or {})
        barrier.wait()
        t0 = now()
        for t in threads:
            t.join()
        wall = max(ends) - t0
        if errors:
            raise RuntimeError(f"{len(errors)} of {n} concurrent sessions failed: {errors[:3]}")
        turns = self.recorder.turns[k0:]
        steps = sum(len(t.steps()) for t in turns)
        calls = len(self.layer_calls(l0))
        stats1 = dict(getattr(self.server.engine, "stats", None) or {})
        if "forwards" in stats0 and "steps" in stats0:  # the engine's own scheduler counters
            steps, calls = stats1["steps"] - stats0["steps"], stats1["forwards"] - stats0["forwards"]
        round_trips = [b.t - a.t for t, r in zip(turns, results) for a, b in t.decode_steps(r.generated_tokens)]
        for s in sessions:
            s.delete()
        total = sum(r.generated_tokens for r in results)
        return {"wall_seconds": wall, "generated_tokens": total, "aggregate_tokens_per_second": total / wall,
                "mean_session_tokens_per_second": mean([r.tokens_per_second for r in results]),
                "mean_ttft_ms": mean([r.time_to_first_token for r in results]) * 1000,
                "median_step_round_trip_ms": median(round_trips) * 1000,
                "steps_per_layer_call": ratio(steps, calls) if calls else float("nan"),
                "largest_batch": stats1.get("largest_batch")}


# -- helpers -----------------------------------------------------------------------------------
def build_random_llama(name: str, dtype: torch.dtype, tokenizer):
    """A Llama of the named shape with seeded N(0, 0.02) weights and unit norms, built without downloads."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    eos = tokenizer.eos_token_id
    config = LlamaConfig(**RANDOM_SHAPES[name], max_position_embeddings=8192, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=eos, pad_token_id=eos)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffers were left empty by to_empty
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=eos)
    return model.eval()


def summarize_runs(runs: list[dict]) -> dict:
    keys = ("tokens_per_second", "time_to_first_token", "decode_seconds", "wall_seconds")
    out = {k: median([r[k] for r in runs]) for k in keys}
    out["generated_tokens"] = runs[0]["generated_tokens"]
    for k in ("open_seconds", "commit_seconds"):
        if k in runs[0]:
            out[k] = median([r[k] for r in runs])
    if "token_intervals" in runs[0]:
        out["token_interval_ms"] = median([x for r in runs for x in r["token_intervals"]]) * 1000
        out["step_round_trip_ms"] = median([x for r in runs for x in r["step_round_trips"]]) * 1000
        out["server_layers_ms"] = median([x for r in runs for x in r["server_layer_seconds"]]) * 1000
    return out


def strip(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("turn", "token_ids", "token_intervals", "step_round_trips",
                                                      "server_layer_seconds")}


def wire_of(turn: TurnLog, generated: int) -> dict:
    decode = turn.decode_steps(generated)
    prefill = turn.prefill_steps(generated)
    req = [q.size for q, _ in decode]
    resp = [r.size for _, r in decode]
    return {"decode_request_sizes": req, "decode_response_sizes": resp,
            "decode_request_bytes": median(req), "decode_response_bytes": median(resp),
            "prefill_request_bytes": sum(q.size for q, _ in prefill), "prefill_rows": sum(q.rows for q, _ in prefill),
            "turn_bytes_sent": sum(m.size for m in turn.sent),
            "turn_bytes_received": sum(m.size for m in turn.received)}


def linear_slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return float("nan")
    mx, my = mean(xs), mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else float("nan")


def machine_info(device: str) -> dict:
    import transformers

    from infemeral import __version__

    cpu, mem = platform.processor() or "unknown", float("nan")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) / 2**20
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "memory_gib": mem,
            "os": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "grpcio": grpc.__version__, "infemeral": __version__,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["git"] = f"{rev}{' + uncommitted changes' if dirty else ''}" if rev else None
    except (OSError, subprocess.SubprocessError):
        info["git"] = None
    return info


# -- plots -----------------------------------------------------------------------------------
def make_plots(results: dict, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    S = results["sections"]
    files: dict[str, str] = {}

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files[name.split(".")[0]] = name

    if "decode" in S:
        d = S["decode"]
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        labels = ["split (gRPC)", "plain generate"]
        axes[0].bar(labels, [d["split"]["tokens_per_second"], d["plain"]["tokens_per_second"]],
                    color=["tab:blue", "tab:gray"])
        axes[0].set_ylabel("decode tokens/s")
        axes[0].set_title(f"decode, {d['new_tokens']} new tokens (split/plain {d['tps_ratio']:.2f})")
        axes[1].bar(labels, [d["split"]["time_to_first_token"] * 1000, d["plain"]["time_to_first_token"] * 1000],
                    color=["tab:blue", "tab:gray"])
        axes[1].set_ylabel("time to first token (ms)")
        axes[1].set_title(f"TTFT, {d['prompt_tokens']}-token prompt")
        save(fig, "decode.png")

    if "context" in S:
        rows = S["context"]["rows"]
        x = [r["context_tokens"] for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        axes[0].plot(x, [r["split_token_ms"] for r in rows], "o-", label="split (gRPC)", color="tab:blue")
        axes[0].plot(x, [r["plain_token_ms"] for r in rows], "s-", label="plain transformers", color="tab:gray")
        axes[0].plot(x, [r["split_server_layers_ms"] for r in rows], ":", label="split: server layers only",
                     color="tab:blue")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.minorticks_off()
        axes[0].set_xlabel("context length (tokens)")
        axes[0].set_ylabel("ms per decoded token (median)")
        axes[0].set_title("per-token decode latency")
        axes[0].legend(fontsize=8)
        axes[1].plot(x, [nz(r["decode_ratio"]) for r in rows], "o-", color="tab:blue")
        axes[1].axhline(DECODE_TARGET, color="tab:red", ls="--", label=f"target {DECODE_TARGET}")
        axes[1].axhline(1.0, color="black", lw=0.6)
        axes[1].set_xlabel("context length (tokens)")
        axes[1].set_ylabel("split / plain throughput")
        axes[1].set_ylim(0, max([1.3] + [nz(r["decode_ratio"]) * 1.1 for r in rows if r["decode_ratio"]]))
        axes[1].set_title("throughput ratio")
        axes[1].legend(fontsize=8)
        save(fig, "context.png")

        fig, ax = plt.subplots(figsize=(8, 3.8))
        idx = list(range(len(rows)))
        w = 0.38
        layers = [0.0 if r["split_server_layers_ms"] is None else r["split_server_layers_ms"] for r in rows]
        transport = [max(0.0, nz(r["split_transport_ms"])) for r in rows]
        client = [max(0.0, nz(r["split_client_ms"])) for r in rows]
        ax.bar([i - w / 2 for i in idx], layers, w, label="server: layers", color="tab:blue")
        ax.bar([i - w / 2 for i in idx], transport, w, bottom=layers, label="gRPC + server overhead",
               color="tab:orange")
        ax.bar([i - w / 2 for i in idx], client, w, bottom=[a + b for a, b in zip(layers, transport)],
               label="client (layer 0, LM head, sampling, ...)", color="tab:green")
        ax.bar([i + w / 2 for i in idx], [r["plain_token_ms"] for r in rows], w, label="plain transformers",
               color="tab:gray")
        ax.set_xticks(idx, [str(v) for v in x])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("ms per decoded token (median)")
        ax.set_title("where a decode step's time goes (left: split, right: plain)")
        ax.legend(fontsize=8)
        save(fig, "breakdown.png")

    if "wire" in S and S["wire"]["per_context"]:
        w_ = S["wire"]
        pc = w_["per_context"]
        x = [p["context_tokens"] for p in pc]
        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        ax.plot(x, [p["decode_request_bytes"] + p["decode_response_bytes"] for p in pc], "o-",
                label="request + response", color="tab:blue")
        ax.plot(x, [p["decode_request_bytes"] for p in pc], "^--", label="request", color="tab:green")
        ax.axhline(w_["target_bytes_per_step"], color="tab:red", ls="--",
                   label=f"target 2·{w_['hidden_size']}·{w_['bytes_per_element']}+{WIRE_SLACK}")
        ax.axhline(w_["payload_bytes_per_step"], color="black", lw=0.6, label="hidden-state payload")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
        ax.set_ylim(0, w_["target_bytes_per_step"] * 1.2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("bytes per decode step")
        ax.set_title("wire bytes per decode step")
        ax.legend(fontsize=8)
        save(fig, "wire.png")

    if "store" in S:
        st = S["store"]
        c = st["commits"]
        hist = [r["history_tokens"] for r in c]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        axes[0].plot(hist, [r["bytes_written"] / 2**20 for r in c], "o-", label="measured", color="tab:blue")
        axes[0].plot(hist, [r["new_tokens_kv_bytes"] / 2**20 for r in c], "--", label="KV of new tokens only",
                     color="tab:green")
        axes[0].plot(hist, [r["whole_cache_kv_bytes"] / 2**20 for r in c], ":", label="KV of whole cache",
                     color="tab:red")
        axes[0].set_xlabel("history before the turn (tokens)")
        axes[0].set_ylabel("MiB written per commit")
        axes[0].set_title("store bytes per commit")
        axes[0].legend(fontsize=8)
        axes[1].plot(hist, [r["commit_ms"] for r in c], "o-", label="commit (client-observed)", color="tab:blue")
        axes[1].plot(hist, [r["store_write_seconds"] * 1000 for r in c], "x:", label="inside store writes",
                     color="tab:orange")
        axes[1].set_xlabel("history before the turn (tokens)")
        axes[1].set_ylabel("ms per commit")
        axes[1].set_title("commit time")
        axes[1].legend(fontsize=8)
        save(fig, "store.png")
        if st.get("loads"):
            ld = st["loads"]
            x = [r["cache_tokens"] for r in ld]
            fig, ax = plt.subplots(figsize=(6.5, 3.8))
            ax.plot(x, [r["open_ms"] for r in ld], "o-", label="open turn (load + decrypt)", color="tab:blue")
            ax.plot(x, [r["plain_reprefill_ms"] for r in ld], "s--", label="baseline: plain re-prefill",
                    color="tab:gray")
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(v) for v in x])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("cache length (tokens)")
            ax.set_ylabel("ms")
            ax.set_title("cache load time vs cache size")
            ax.legend(fontsize=8)
            save(fig, "cache_load.png")

    if "concurrency" in S:
        rows = S["concurrency"]["rows"]
        x = [r["sessions"] for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        axes[0].plot(x, [r["aggregate_tokens_per_second"] for r in rows], "o-", label="split, concurrent sessions",
                     color="tab:blue")
        axes[0].plot(x, [r["plain_batched_tokens_per_second"] for r in rows], "s--",
                     label="plain generate, batch of n", color="tab:gray")
        for ax in axes:
            ax.set_xticks(x, [str(v) for v in x])
        axes[0].set_xlabel("sessions (batch size)")
        axes[0].set_ylabel("aggregate tokens/s")
        axes[0].set_title("aggregate throughput")
        axes[0].legend(fontsize=8)
        axes[1].plot(x, [r["scaling"] for r in rows], "o-", label="split", color="tab:blue")
        axes[1].plot(x, [r["plain_batched_scaling"] for r in rows], "s--", label="plain batched", color="tab:gray")
        axes[1].plot([8], [CONCURRENCY_TARGET], "r*", ms=12, label=f"target: 8 sessions >= {CONCURRENCY_TARGET}x")
        axes[1].set_xlabel("sessions (batch size)")
        axes[1].set_ylabel("x one session")
        axes[1].set_title("scaling")
        axes[1].legend(fontsize=8)
        save(fig, "concurrency.png")
    return files


# -- report ----------------------------------------------------------------------------------
def targets(results: dict) -> list[dict]:
    S = results["sections"]
    out = []
    if "context" in S:
        rows = S["context"]["rows"]
        worst = min(rows, key=lambda r: -1.0 if r["decode_ratio"] is None else r["decode_ratio"])
        out.append({"target": f"split decode >= {DECODE_TARGET}x plain transformers at every context length",
                    "measured": f"min {fmt(worst['decode_ratio'], '.2f')}x (at {worst['context_tokens']} tokens); "
                                + ", ".join(f"{r['context_tokens']}: {fmt(r['decode_ratio'], '.2f')}" for r in rows),
                    "pass": all(r["decode_ratio"] is not None and r["decode_ratio"] >= DECODE_TARGET for r in rows)})
    if "wire" in S:
        w = S["wire"]
        out.append({"target": f"wire <= 2 x hidden x bytes-per-element + {WIRE_SLACK} per decode step "
                              f"(= {w['target_bytes_per_step']} B)",
                    "measured": f"max {w['decode_step_bytes']['max']} B (request {w['decode_request_bytes']['max']} "
                                f"+ response {w['decode_response_bytes']['max']})",
                    "pass": w["decode_step_bytes"]["max"] <= w["target_bytes_per_step"]})
    if "store" in S:
        st = S["store"]
        out.append({"target": "commit bytes per turn independent of history",
                    "measured": f"bytes per new token, last vs first third of turns: {st['late_over_early']:.2f}x "
                                f"(median; amortized incl. compactions {st['amortized_late_over_early']:.2f}x, "
                                f"{len(st['compactions'])} compaction(s) in {st['turns']} turns); "
                                f"{st['history_share']:.2f} of a whole-cache rewrite per history token",
                    "pass": nz(st["late_over_early"]) <= STORE_TARGET})
    if "concurrency" in S:
        rows = {r["sessions"]: r for r in S["concurrency"]["rows"]}
        if 8 in rows:
            out.append({"target": f"8 sessions >= {CONCURRENCY_TARGET}x one session's aggregate throughput",
                        "measured": f"{rows[8]['scaling']:.2f}x ({rows[8]['aggregate_tokens_per_second']:.1f} vs "
                                    f"{rows[1]['aggregate_tokens_per_second']:.1f} tok/s)",
                        "pass": nz(rows[8]["scaling"]) >= CONCURRENCY_TARGET})
    return out


def fmt(x, spec=".1f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, spec)


def write_report(results: dict, out: Path, plots: dict[str, str]) -> None:
    S, M, C, Y = results["sections"], results["machine"], results["config"], results["system"]
    L = []
    add = L.append
    add("# infemeral benchmarks\n")
    add(f"Generated by `.venv/bin/python {C['command']}` on {C['started']} ({C['mode']} run, "
        f"{results['total_seconds'] / 60:.1f} min). Every comparison below was measured side by side in that one run "
        "on the same machine; numbers are timings of this machine, targets are ratios. Regenerate with "
        "`.venv/bin/python scripts/bench.py` (`--quick` for a smoke run).\n")
    add("## Machine and setup\n")
    add("| | |\n|---|---|")
    add(f"| CPU | {M['cpu']}, {M['cores']} cores (torch uses {M['torch_threads']} threads) |")
    add(f"| memory | {fmt(M['memory_gib'])} GiB |")
    if M.get("gpu"):
        add(f"| GPU | {M['gpu']} |")
    add(f"| software | Python {M['python']}, torch {M['torch']}, transformers {M['transformers']}, "
        f"grpcio {M['grpcio']}, infemeral {M['infemeral']} |")
    add(f"| code | git {M.get('git') or 'unknown'} |")
    add(f"| model | {Y['model']}: hidden {Y['hidden_size']}, {Y['total_layers']} layers |")
    add(f"| split | client (same process, {Y['client']}): embedding, layer 0, final norm, LM head, sampling; "
        f"server (in-process gRPC server on 127.0.0.1, {Y['server_device']}, {Y['server_dtype']}): layers "
        f"{Y['first_server_layer']}–{Y['total_layers'] - 1} |")
    add(f"| baseline | {Y['plain_baseline']} |")
    add(f"| store | {Y['store']} |")
    cpu = results.get("cpu", {})
    per = ", ".join(f"{k} {fmt(v['cpu']['other_share'] * 100, '.0f')}%" for k, v in S.items()
                    if isinstance(v.get("cpu"), dict) and not math.isnan(nz(v["cpu"].get("other_share")))
                    and nz(v.get("section_seconds")) >= 1)
    add(f"| other load | other processes took {fmt((cpu.get('other_share') or 0) * 100, '.0f')}% of the machine's "
        f"CPU time during the run (hypervisor steal {fmt((cpu.get('steal_share') or 0) * 100, '.0f')}%)"
        + (f"; per section: {per}" if per else "") + f"; load average at start "
        f"{fmt(M.get('loadavg_start', [float('nan')])[0], '.2f')} |\n")

    add("## Targets\n")
    add("| target | measured | result |\n|---|---|---|")
    for t in targets(results):
        add(f"| {t['target']} | {t['measured']} | **{'PASS' if t['pass'] else 'MISS'}** |")
    add("")

    if "decode" in S:
        d = S["decode"]
        add("## 1. Decode throughput and time to first token\n")
        add(f"Greedy, {d['prompt_tokens']}-token chat prompt, exactly {d['new_tokens']} new tokens on both sides "
            f"(plain: `generate(min_new_tokens=max_new_tokens)`; split: `Session.chat` with end-of-sequence "
            f"ignored), median of {d['reps']} alternating runs after a warm-up. Tokens/s = (tokens − 1) / time from "
            "first to last token, as `TurnResult.tokens_per_second` defines it.\n")
        add("| | split (gRPC) | plain `generate` | split / plain |\n|---|---|---|---|")
        add(f"| decode tokens/s | {fmt(d['split']['tokens_per_second'])} | {fmt(d['plain']['tokens_per_second'])} "
            f"| {fmt(d['tps_ratio'], '.2f')} |")
        add(f"| time to first token (ms) | {fmt(d['split']['time_to_first_token'] * 1000)} | "
            f"{fmt(d['plain']['time_to_first_token'] * 1000)} | {fmt(d['ttft_ratio'], '.2f')} |")
        add(f"| open turn (ms, before the prompt; not in TTFT) | {fmt(d['split'].get('open_seconds', 0) * 1000)} "
            "| – | |")
        add(f"| commit (ms, after the last token) | {fmt(d['split'].get('commit_seconds', 0) * 1000)} | – | |")
        add("")
        n = d["new_tokens"]
        eos = d["split_first_eos_at"]
        same = d["greedy_tokens_identical"]
        note = (f"the split system sampled end-of-sequence at token {eos + 1}, where plain `generate` is forced on "
                "by `min_new_tokens`" if eos is not None else "")
        add(f"Greedy tokens identical to plain `generate`: {same} of {n}" + (f" ({note})." if note else ".") + "\n")
        if "decode" in plots:
            add(f"![decode]({plots['decode']})\n")

    if "context" in S:
        rows = S["context"]["rows"]
        add("## 2. Per-token decode latency vs context length\n")
        add(f"{S['context']['metric'][0].upper() + S['context']['metric'][1:]}. Prompts are a public-domain "
            f"passage repeated up to the length; {rows[0]['decode_steps']} decode steps per length. "
            "Throughput ratio = plain latency / split latency (> 1: split is faster).\n")
        add("| context | split ms/token | plain ms/token | split / plain throughput | (mean-based) | split TTFT ms "
            "| plain prefill ms | split / plain prefill speed |")
        add("|---|---|---|---|---|---|---|---|")
        for r in rows:
            add(f"| {r['context_tokens']} | {fmt(r['split_token_ms'])} | {fmt(r['plain_token_ms'])} | "
                f"**{fmt(r['decode_ratio'], '.2f')}** | {fmt(r['decode_ratio_mean'], '.2f')} | "
                f"{fmt(r['split_ttft_ms'], '.0f')} | {fmt(r['plain_prefill_ms'], '.0f')} | "
                f"{fmt(r['prefill_ratio'], '.2f')} |")
        add("")
        add("Where a split decode step's time goes (medians, ms): the engine's layer call is timed on the server's "
            "worker thread; the gRPC round trip is send-to-receive of the step on the client.\n")
        add("| context | server layers | gRPC + server overhead | client | total | plain total |")
        add("|---|---|---|---|---|---|")
        for r in rows:
            add(f"| {r['context_tokens']} | {fmt(r['split_server_layers_ms'])} | {fmt(r['split_transport_ms'])} | "
                f"{fmt(r['split_client_ms'])} | {fmt(r['split_token_ms'])} | {fmt(r['plain_token_ms'])} |")
        add("")
        for k in ("context", "breakdown"):
            if k in plots:
                add(f"![{k}]({plots[k]})\n")

    if "wire" in S:
        w = S["wire"]
        add("## 3. Bytes on the wire\n")
        add(f"Serialized `TurnRequest`/`TurnResponse` sizes seen by a client interceptor ({w['decode_steps_measured']} "
            f"decode steps). Hidden size {w['hidden_size']}, wire dtype {w['wire_dtype']} "
            f"({w['bytes_per_element']} B/element). {w['note'][0].upper() + w['note'][1:]}.\n")
        add("| | bytes | baseline: raw hidden-state payload | target |\n|---|---|---|---|")
        add(f"| decode step, request (median / max) | {fmt(w['decode_request_bytes']['median'], '.0f')} / "
            f"{w['decode_request_bytes']['max']} | {w['payload_bytes_per_step'] // 2} | |")
        add(f"| decode step, response (median / max) | {fmt(w['decode_response_bytes']['median'], '.0f')} / "
            f"{w['decode_response_bytes']['max']} | {w['payload_bytes_per_step'] // 2} | |")
        add(f"| decode step, both ways (max) | {w['decode_step_bytes']['max']} | {w['payload_bytes_per_step']} | "
            f"≤ {w['target_bytes_per_step']} |")
        add(f"| per prompt token (prefill requests) | {fmt(w['prefill_request_bytes_per_token'])} | "
            f"{w['prefill_payload_bytes_per_token']} | |")
        add("")
        if w["per_context"]:
            add("Per decode step at each context length (medians): "
                + ", ".join(f"{p['context_tokens']}: {p['decode_request_bytes']:.0f} + "
                            f"{p['decode_response_bytes']:.0f} B" for p in w["per_context"])
                + " — constant: only the new token's hidden state travels, never the history.\n")
        if "wire" in plots:
            add(f"![wire]({plots['wire']})\n")

    if "store" in S:
        st = S["store"]
        c = st["commits"]
        add("## 4. Session store\n")
        add(f"One session, {st['turns']} short turns ({st['tokens_per_turn_generated']} generated tokens each). "
            f"Bytes written measured from {st['method']}. Baselines: the KV bytes of only the turn's new tokens "
            f"(ideal append) and of the whole cache (full rewrite), at {st['kv_bytes_per_token']:,} B per token "
            "for the server's layers. Commit time is client-observed (commit sent → committed received).\n")
        add("| turn | history tokens | new tokens | bytes written | KV of new tokens | KV of whole cache | writes "
            "| commit ms |")
        add("|---|---|---|---|---|---|---|---|")
        pick = {0, 1, len(c) // 4, len(c) // 2, 3 * len(c) // 4, len(c) - 2, len(c) - 1}
        pick = sorted((pick | {t - 1 for t in st["compactions"]}) & set(range(len(c))))
        for i in pick:
            r = c[i]
            add(f"| {r['turn']} | {r['history_tokens']} | {r['new_tokens']} | {r['bytes_written']:,} | "
                f"{r['new_tokens_kv_bytes']:,} | {r['whole_cache_kv_bytes']:,} | {r['writes']} | "
                f"{fmt(r['commit_ms'])} |")
        add("")
        add(f"Bytes per new token: first third of turns {fmt(st['early_bytes_per_new_token'], ',.0f')}, last third "
            f"{fmt(st['late_bytes_per_new_token'], ',.0f')} (**{fmt(st['late_over_early'], '.2f')}×**, amortized "
            f"{fmt(st['amortized_late_over_early'], '.2f')}×). Linear fit: "
            f"{fmt(st['bytes_per_history_token_slope'], ',.0f')} B more per commit for every token of history = "
            f"{fmt(st['history_share'], '.2f')} of a whole-cache "
            f"rewrite (0 = independent of history, 1 = rewrites everything). Commit time: "
            f"{fmt(st['commit_ms_early'])} ms early, {fmt(st['commit_ms_late'])} ms late (medians). "
            + (f"Turn(s) {', '.join(map(str, st['compactions']))} rewrote the whole session (compaction). "
               if st["compactions"] else "No commit rewrote the history. ")
            + f"Over all turns the store wrote {fmt(st['total_over_new_kv'], '.2f')}× the KV bytes of the new "
              "tokens.\n")
        if "store" in plots:
            add(f"![store]({plots['store']})\n")
        if st.get("loads"):
            add("Cache load time vs cache size: opening a turn on a stored session (read, authenticate, decrypt "
                "into the engine's cache), client-observed open → opened. Baseline: recomputing that context "
                "from scratch (plain transformers prefill; the split system's own prefill alongside). The "
                "stored files were just written, so reads come from the OS page cache.\n")
            add("| cache tokens | stored MiB | open turn ms | plain re-prefill ms | split re-prefill ms | "
                "re-prefill / open |")
            add("|---|---|---|---|---|---|")
            for r in st["loads"]:
                add(f"| {r['cache_tokens']} | {fmt(r['stored_bytes'] / 2**20)} | {fmt(r['open_ms'])} | "
                    f"{fmt(r['plain_reprefill_ms'], '.0f')} | {fmt(r['split_reprefill_ms'], '.0f')} | "
                    f"{fmt(ratio(r['plain_reprefill_ms'], r['open_ms']), '.1f')}× |")
            add("")
            if "cache_load" in plots:
                add(f"![cache load]({plots['cache_load']})\n")

    if "concurrency" in S:
        cc = S["concurrency"]
        add("## 5. Concurrent sessions\n")
        add(f"Threads, each with its own `Session` on one shared `Client`, against the one server; "
            f"{cc['tokens_per_session']} tokens per session, {cc['prompt_tokens']}-token prompt. "
            f"{cc['metric'][0].upper() + cc['metric'][1:]}. Reference: plain `generate` with a batch of the same "
            "size (what batching the model achieves on this machine)."
            + (f" Each point is the best of {cc['reps']} alternating repeats on both sides (all values are in "
               "results.json)." if cc.get("reps", 1) > 1 else "") + "\n")
        add("| sessions | aggregate tok/s | × one session | per-session decode tok/s | mean TTFT ms | "
            "step round trip ms | steps per engine call | plain batched tok/s | × |")
        add("|---|---|---|---|---|---|---|---|---|")
        for r in cc["rows"]:
            add(f"| {r['sessions']} | {fmt(r['aggregate_tokens_per_second'])} | **{fmt(r['scaling'], '.2f')}** | "
                f"{fmt(r['mean_session_tokens_per_second'])} | {fmt(r['mean_ttft_ms'], '.0f')} | "
                f"{fmt(r['median_step_round_trip_ms'])} | {fmt(r['steps_per_layer_call'], '.2f')} | "
                f"{fmt(r['plain_batched_tokens_per_second'])} | {fmt(r['plain_batched_scaling'], '.2f')} |")
        add("")
        if "concurrency" in plots:
            add(f"![concurrency]({plots['concurrency']})\n")

    if "prepare" in S:
        p = S["prepare"]
        add("## 6. Prepare\n")
        add(f"Source: {p['source']}; {p['how']}.\n")
        add("| | seconds | peak RSS MB |\n|---|---|---|")
        add(f"| `infemeral-client prepare --quiet` | {fmt(p['prepare']['seconds'])} | "
            f"{fmt(p['prepare']['peak_rss_mb'], '.0f')} |")
        add(f"| baseline: {p['baseline_load'].get('what', 'load the same GGUF with transformers')} | "
            f"{fmt(p['baseline_load']['seconds'])} | {fmt(p['baseline_load']['peak_rss_mb'], '.0f')} |")
        add(f"| prepare / baseline | {fmt(p['time_ratio'], '.2f')}× | {fmt(p['rss_ratio'], '.2f')}× |")
        add("")
        add(f"Input {fmt(p['gguf_mb'])} MB; output: client bundle {fmt(p['client_bundle_mb'])} MB, server bundle "
            f"{fmt(p['server_bundle_mb'])} MB.\n")

    add("## Analysis\n")
    for para in analysis(results):
        add(para + "\n")
    (out / "REPORT.md").write_text("\n".join(L))


def analysis(results: dict) -> list[str]:
    """Short, data-driven notes on where the time goes (every number comes from this run)."""
    S, Y = results["sections"], results["system"]
    paras = []
    other = nz(results.get("cpu", {}).get("other_share"))
    if other > 0.10:
        paras.append(f"**Caveat: a shared machine.** Other processes took {other:.0%} of this machine's CPU time "
                     "during the run (see the setup table), so absolute timings are slower and noisier than on an idle "
                     "machine, and individual ratios can move by tens of percent between runs. Split and plain were "
                     "interleaved (alternating runs; plain decode steps before and after each split turn) so that "
                     "load bursts hit both sides, but single-run ratios near a threshold should be re-measured.")
    if "context" in S:
        rows = S["context"]["rows"]
        r0, rn = rows[0], rows[-1]
        over = nz(rn["decode_ratio"]) > 1.05
        txt = (f"**Decode.** A split decode step does the same arithmetic as a plain one ({Y['total_layers']} layers "
               f"+ LM head) plus two {Y['hidden_size']}×{Y['hidden_size']} rotations, a protobuf round trip over "
               f"loopback gRPC and a hand-off to the engine's worker thread. At {r0['context_tokens']} tokens a step "
               f"costs {r0['split_token_ms']:.1f} ms split vs {r0['plain_token_ms']:.1f} ms plain: "
               f"{r0['split_server_layers_ms']:.1f} ms in the server's {Y['server_layers']} layers, "
               f"{r0['split_transport_ms']:.1f} ms of gRPC and server overhead around them, and "
               f"{r0['split_client_ms']:.1f} ms on the client (embedding, layer 0, rotations, final norm, the LM head "
               f"over {Y['vocab_size']:,} tokens, sampling and detokenising). ")
        if nz(rn["decode_ratio"]) < 1.0 and len(rows) > 1:
            txt += (f"At {rn['context_tokens']} tokens the server's layers alone take "
                    f"{rn['split_server_layers_ms']:.1f} ms per step (up from {r0['split_server_layers_ms']:.1f} ms at "
                    f"{r0['context_tokens']}) against {rn['plain_token_ms']:.1f} ms for plain's whole step (up from "
                    f"{r0['plain_token_ms']:.1f} ms): the served layers' per-step cost grows faster with the context "
                    "than transformers' does, which points at the server's decode attention over its cache. ")
        if over:
            txt += (f"At long contexts the split system decodes faster than plain transformers "
                    f"({rn['decode_ratio']:.2f}× at {rn['context_tokens']} tokens). A likely reason (not profiled "
                    "further): transformers' `DynamicCache` appends each step's keys and values with `torch.cat`, "
                    "copying every layer's whole history on every step. ")
        worst = min(rows, key=lambda r: nz(r["decode_ratio"]) if not math.isnan(nz(r["decode_ratio"])) else -1.0)
        if worst is r0:
            txt += ("The client's and the transport's share is a fixed cost per step, so the ratio is worst where "
                    "steps are cheapest (short contexts, small models); with a large model on a GPU the same "
                    "fixed cost is a smaller share.")
        paras.append(txt)
    if "context" in S:
        rows, probe = S["context"]["rows"], S["context"].get("attention_probe")
        rn = rows[-1]
        txt = (f"**Prefill.** The split system processes a {rn['context_tokens']}-token prompt at "
               f"{rn['prefill_ratio']:.2f}× plain transformers' speed (TTFT {rn['split_ttft_ms']:.0f} ms vs "
               f"{rn['plain_prefill_ms']:.0f} ms); no target is set for prefill. ")
        if rn["prefill_ratio"] >= 0.95:
            if probe:
                txt += (f"For reference, one layer's attention at {probe['tokens']} tokens takes "
                        f"{probe['mask_ms']:.0f} ms with the explicit causal mask infemeral passes for multi-token "
                        f"steps and {probe['is_causal_ms']:.0f} ms with `is_causal=True`.")
        elif probe and probe["mask_ms"] > 1.2 * probe["is_causal_ms"]:
            txt += (f"A likely cause, measured in this run: for multi-token steps infemeral's attention passes an "
                    f"explicit boolean causal mask to `scaled_dot_product_attention`, which for one layer at "
                    f"{probe['tokens']} tokens takes {probe['mask_ms']:.0f} ms against {probe['is_causal_ms']:.0f} ms "
                    "with `is_causal=True`, the kernel transformers uses for a prompt without a cache. Using "
                    "`is_causal` when a step starts from an empty cache would recover most of the gap.")
        elif probe:
            txt += (f"The attention kernel is not the difference here (explicit mask {probe['mask_ms']:.0f} ms vs "
                    f"is_causal {probe['is_causal_ms']:.0f} ms per layer at {probe['tokens']} tokens).")
        paras.append(txt)
    if "decode" in S:
        d = S["decode"]
        paras.append(f"**End to end.** Over a whole {d['new_tokens']}-token answer the split system decodes at "
                     f"{d['tps_ratio']:.2f}× plain `generate` and reaches its first token at {d['ttft_ratio']:.2f}× "
                     f"plain's time; a turn additionally opens ({d['split'].get('open_seconds', 0) * 1000:.0f} ms) "
                     f"and commits ({d['split'].get('commit_seconds', 0) * 1000:.0f} ms) its encrypted session, "
                     "outside both measures.")
    if "wire" in S:
        w = S["wire"]
        paras.append(f"**Wire.** A decode step moves {w['decode_step_bytes']['max']} B both ways, of which "
                     f"{w['payload_bytes_per_step']} B are the two hidden vectors; the other "
                     f"{w['framing_overhead_bytes']} B are protobuf framing, dtype/shape and the cache length. "
                     "It does not grow with the context, and prompts cost "
                     f"{w['prefill_request_bytes_per_token']:.0f} B per token ({w['prefill_payload_bytes_per_token']} "
                     "B payload).")
    if "store" in S:
        st = S["store"]
        if nz(st["late_over_early"]) <= STORE_TARGET:
            txt = (f"**Store.** Commits write about {st['late_bytes_per_new_token']:,.0f} B per new token however "
                   f"long the conversation ({st['kv_bytes_per_token']:,} B of KV per token plus framing), "
                   f"{st['late_over_early']:.2f}× early vs late. ")
            if st["compactions"]:
                big = max((c for c in st["commits"] if c["turn"] in st["compactions"]),
                          key=lambda c: c["bytes_written"])
                txt += (f"The exception is compaction: turn(s) {', '.join(map(str, st['compactions']))} rewrote the "
                        f"whole session ({big['bytes_written'] / 2**20:.1f} MiB at {big['cache_length']} tokens), so "
                        f"over all {st['turns']} turns the store wrote {st['total_over_new_kv']:.2f}× the KV of the "
                        "new tokens; how often that happens, not each commit, is what grows with history. ")
        else:
            txt = (f"**Store.** Bytes written per commit grow with the history ({st['history_share']:.2f} of a "
                   f"whole-cache rewrite per history token): the store this run measured rewrites the session's "
                   f"sealed cache on every commit, so the last turns wrote {st['late_over_early']:.1f}× as much per "
                   "new token as the first. The append-only chunk format being introduced "
                   "(`infemeral/kvcache/stored.py`) should bring this to the KV of the new tokens only; rerun to "
                   "check. ")
        txt += (f"A commit takes {st['commit_ms_early']:.0f} ms in the first third of the turns and "
                f"{st['commit_ms_late']:.0f} ms in the last (medians, client-observed). ")
        if st.get("loads"):
            big = st["loads"][-1]
            txt += (f"Loading a {big['cache_tokens']}-token cache ({big['stored_bytes'] / 2**20:.0f} MiB) to open a "
                    f"turn takes {big['open_ms']:.0f} ms, "
                    f"{ratio(big['plain_reprefill_ms'], big['open_ms']):.0f}× less than recomputing it.")
        paras.append(txt)
    if "concurrency" in S:
        rows = {r["sessions"]: r for r in S["concurrency"]["rows"]}
        top = max(rows)
        spc = rows[top]["steps_per_layer_call"]
        eight = rows.get(8)
        txt = f"**Concurrency.** {top} sessions give {rows[top]['scaling']:.2f}× one session's aggregate throughput"
        txt += f" and eight give {eight['scaling']:.2f}×. " if eight is not None and top != 8 else ". "
        if math.isnan(spc) or spc < 1.05:
            txt += ("The engine ran one session's step per forward (no cross-session batching); plain batched "
                    f"`generate` reaches {rows[top]['plain_batched_scaling']:.2f}× with a batch of {top} on the same "
                    "machine, roughly what batching steps across sessions could recover. ")
        else:
            txt += (f"The engine's scheduler ran {spc:.2f} session steps per forward on average (largest batch "
                    f"{rows[top].get('largest_batch')}); plain batched `generate` reaches "
                    f"{rows[top]['plain_batched_scaling']:.2f}× with a batch of {top} on the same machine. ")
        txt += ("On this machine the client halves of all sessions (embedding, layer 0, LM head and sampling for "
                "every token, in Python threads of this one process) share the same cores as the server, which a "
                "real deployment (clients on their own machines, server on a GPU) would not; the per-session "
                "client work does not batch.")
        paras.append(txt)
    if "prepare" in S:
        p = S["prepare"]
        paras.append(f"**Prepare.** {p['prepare']['seconds']:.0f} s and {fmt(p['prepare']['peak_rss_mb'], '.0f')} MB "
                     f"peak, {fmt(p['time_ratio'], '.1f')}× the time and {fmt(p['rss_ratio'], '.1f')}× the memory of "
                     "just loading the model; GGUF input is dequantised whole first, then layers are rotated and "
                     "written one at a time.")
    return paras


# -- main ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fast smoke run (fewer lengths, tokens, repeats)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the server's layers and the plain baseline run (the client is always CPU)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="server and baseline dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--model", choices=["default", "random-8b", "random-tiny"], default="default",
                        help="default: the packaged SmolLM2-135M-Instruct; random-8b: random-weight Llama of a "
                             "real 8B shape built in memory (GPU); random-tiny: that code path at toy size")
    parser.add_argument("--only", help=f"comma-separated subset of sections: {','.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default docs/benchmarks)")
    args = parser.parse_args(argv)
    if args.only and not set(args.only.split(",")) <= set(SECTIONS):
        parser.error(f"--only takes {','.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    if args.model == "random-8b" and args.device != "cuda":
        print("warning: random-8b on the CPU needs ~40 GB of memory and hours; it is meant for --device cuda",
              file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    params = QUICK if args.quick else FULL

    with tempfile.TemporaryDirectory(prefix="infemeral-bench-") as tmp:
        results = Bench(args, params, Path(tmp)).run()
    # JSON gets NaN as null; the plots and the report work from the raw numbers (NaN prints as "–" or "nan").
    (args.out / "results.json").write_text(json.dumps(clean(results), indent=1) + "\n")
    plots = make_plots(results, args.out)
    results_plots = sorted(plots.values())
    write_report(results, args.out, plots)
    log(f"wrote {args.out / 'results.json'}, {args.out / 'REPORT.md'} and {', '.join(results_plots)}")
    for t in targets(results):
        log(f"{'PASS' if t['pass'] else 'MISS'}  {t['target']}: {t['measured']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
