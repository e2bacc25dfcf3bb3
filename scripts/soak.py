"""Soak a real server with misbehaving clients and a flaky store, on loopback, for a bounded time.

    python scripts/soak.py --clients 16 --minutes 10 --store redis --report docs/soak-run.md

Starts `infemeral-server` (float32, CPU) on 127.0.0.1 and N client processes, each with its own session.
For M minutes every client picks actions at random (seeded): normal turns, mostly, and faults — cancel
mid-turn, go quiet past the server's turn-idle bound, vanish without closing the stream, reconnect, delete
and start over, and ask to be SIGKILLed mid-turn (the orchestrator does it, then starts a new process that
resumes the saved session). With `--store redis` the orchestrator also SIGKILLs and restarts Redis (which
keeps its data in an append-only file) now and then.

At the end every client's session is reopened and checked: the server holds the version and length the
client saved, and a greedy continuation through the split system equals plain transformers on the same
transcript (token for token, so the stored cache is intact). The report gives turns done, outcomes by
action and status, sessions verified, KV pool pages free at the end (must be all of them), server RSS at
start and end, and health-check latency throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_CLIENTS, MAX_MINUTES = 64, 120
IDLE_SECONDS = 10.0  # the server's --turn-idle-seconds here (default 30): idle faults take seconds, not minutes
STORE_RECOVERY_SECONDS = 5.0  # after a Redis restart: loading its append-only file, reconnecting
MAX_HISTORY = 1500  # start a new session before the window would slide (verification compares exactly)
PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Name a planet.", "Tell me a short fact.",
           "What colour is the sky?", "Give me a word that rhymes with cat.", "Name an ocean.",
           "Continue the story in one sentence.", "What do bees make?", "Say something kind."]
# action: weight (per client, per action)
ACTIONS = {"turn": 60, "cancel": 8, "abandon": 5, "idle": 5, "vanish": 5, "reconnect": 7, "delete": 4,
           "sigkill": 3}
EXPECTED = {  # outcomes that are the point of the action (anything else is reported as unexpected)
    "turn": {"OK"}, "cancel": {"OK"}, "abandon": {"OK"}, "idle": {"DEADLINE_EXCEEDED"}, "vanish": {"OK"},
    "reconnect": {"OK"}, "delete": {"OK"}, "sigkill": {"KILLED"},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# =============================================================================================== client
class Worker:
    """One client process: one session, saved after every action, resumed by the next incarnation."""

    def __init__(self, args):
        from infemeral.client.client import Client

        self.args = args
        self.rng = random.Random(f"{args.seed}/{args.worker}/{args.incarnation}")
        self.path = Path(args.sessions) / f"client-{args.worker:02d}.session"
        self.Client = Client
        self.client = Client(args.address, args.client_bundle, timeout=120)
        self.session = self.client.load_session(self.path) if self.path.exists() else self.client.new_session()
        self.leaked: list = []  # streams this client walked away from without closing them

    def emit(self, **event) -> None:
        print(json.dumps(event), flush=True)

    def run(self) -> None:
        self.emit(kind="start", version=self.session.version)
        while time.time() < self.args.end_at:
            action = self.rng.choices(list(ACTIONS), list(ACTIONS.values()))[0]
            if action != "turn" and self.session.pending_commit is not None:
                action = "turn"  # settle an unconfirmed commit first
            started = time.time()
            status, detail = self.attempt(action)
            self.emit(kind="action", action=action, status=status, detail=detail, started=started, ended=time.time())
            self.session.save(self.path)
            time.sleep(self.rng.uniform(0.2, 1.5))  # think time
        self.emit(kind="done", version=self.session.version)

    def attempt(self, action: str) -> tuple[str, str]:
        """(status, a short description for the report: no payloads here, only status messages)."""
        from infemeral.errors import StatusError

        try:
            getattr(self, action)()
            return "OK", ""
        except StatusError as e:
            return (e.code.name if e.code is not None else "STATUS_ERROR"), e.message[:160]
        except Exception as e:  # noqa: BLE001 - counted in the report
            return type(e).__name__, str(e)[:160]

    # -- actions ------------------------------------------------------------------------------------
    def turn(self) -> None:
        from infemeral.client.sampling import SamplingParams

        if len(self.session.history_ids) > MAX_HISTORY:
            self.delete()
        self.session.chat(self.rng.choice(PROMPTS), SamplingParams(max_new_tokens=self.rng.randint(2, 12)))

    def abandon(self) -> None:
        """Stop reading the answer half-way (the SDK ends the stream without a commit)."""
        stream = self.session.stream(self.rng.choice(PROMPTS), self._params(16))
        next(stream)
        stream.close()

    def cancel(self) -> None:
        """Cancel the RPC mid-turn, sometimes while the server computes a step."""
        raw = self._raw_open()
        rows = self.rng.choice([1, 256])
        raw.step(rows)
        if rows == 1:
            raw.receive()
        raw.call.cancel()

    def idle(self) -> None:
        """Open a turn, step, then say nothing past the idle bound; the next message meets DEADLINE_EXCEEDED."""
        raw = self._raw_open()
        raw.step(1)
        raw.receive()
        time.sleep(self.args.idle_seconds + 1.5)
        raw.step(1)
        raw.receive()

    def vanish(self) -> None:
        """Open a turn and walk away from the stream without closing or cancelling it; come back later."""
        raw = self._raw_open()
        raw.step(1)
        raw.receive()
        self.leaked.append(raw)  # kept referenced, so nothing closes it on this side
        time.sleep(self.args.idle_seconds + 1.0)

    def reconnect(self) -> None:
        """Drop the connection and come back as a new client from the saved session."""
        self.session.save(self.path)
        self.client.close()
        self.client = self.Client(self.args.address, self.args.client_bundle, timeout=120)
        self.session = self.client.load_session(self.path)
        self.turn()

    def delete(self) -> None:
        if self.session.version:
            self.session.delete()
        self.session = self.client.new_session()

    def sigkill(self) -> None:
        """Ask to be killed mid-turn, and keep the turn open (keep-alives) while the orchestrator does it."""
        stream = self.session.stream(self.rng.choice(PROMPTS), self._params(32))
        next(stream)
        self.emit(kind="killme")
        time.sleep(60)
        raise RuntimeError("not killed")

    # -- helpers ------------------------------------------------------------------------------------
    def _params(self, n: int):
        from infemeral.client.sampling import SamplingParams

        return SamplingParams(max_new_tokens=n)

    def _raw_open(self) -> "RawTurn":
        raw = RawTurn(self.client, self.session)
        raw.open()
        return raw


class RawTurn:
    """A Turn stream driven by hand, with random hidden states (never committed)."""

    def __init__(self, client, session):
        from infemeral.protocol import pb_grpc

        self.client, self.session = client, session
        self.requests: queue.Queue = queue.Queue()
        self.call = pb_grpc.InfemeralStub(client.channel).Turn(iter(self.requests.get, None), timeout=120)
        self.length = session.cache.length

    def receive(self):
        import grpc

        from infemeral.errors import from_rpc_error

        try:
            return next(self.call)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def open(self) -> None:
        from infemeral.protocol import pb

        s = self.session
        self.requests.put(pb.TurnRequest(open=pb.OpenTurn(
            session_id=s.id, session_key=s.key, expected_version=s.version,
            bundle_fingerprint=self.client.bundle.server_fingerprint, reserve_tokens=512)))
        self.receive()

    def step(self, rows: int) -> None:
        import torch

        from infemeral.protocol import pb
        from infemeral.protocol.tensors import to_proto

        hidden = torch.randn(rows, self.client.model.hidden_size) * 0.5
        self.requests.put(pb.TurnRequest(step=pb.Step(hidden=to_proto(hidden), cache_length=self.length)))
        self.length += rows


# ========================================================================================= orchestrator
@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # (action, status) -> count
    details: dict = field(default_factory=dict)  # (action, status) -> one example message
    store_down: list = field(default_factory=list)  # [killed at, answering again at] (wall clock)
    rss_mb: list = field(default_factory=list)  # (seconds since start, server RSS)
    peak_used_pages: float = 0.0  # most KV pool pages in use at any sample
    turn_seconds: list = field(default_factory=list)  # SDK turns that committed, start to finish
    kills: int = 0
    redis_restarts: int = 0
    health_ms: list[float] = field(default_factory=list)
    health_failures: int = 0
    worker_crashes: list[str] = field(default_factory=list)


class Orchestrator:
    def __init__(self, args):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="infemeral-soak-"))
        self.sessions = self.work / "sessions"
        self.sessions.mkdir()
        self.tally = Tally()
        self.lock = threading.Lock()
        self.workers: dict[int, subprocess.Popen] = {}
        self.incarnations: Counter = Counter()
        self.stopping = threading.Event()
        self.rng = random.Random(args.seed)
        self.redis: subprocess.Popen | None = None
        self.redis_down_since: float | None = None

    # -- processes ----------------------------------------------------------------------------------
    def start_redis(self) -> None:
        self.redis = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.work)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        r = redis.Redis(port=self.redis_port)
        for _ in range(200):
            try:
                r.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def start_server(self) -> None:
        from infemeral.client.health import wait_until_serving
        from infemeral.cloak.bundle import ServerBundle
        from infemeral.layers.stack import head_dim

        bundle = ServerBundle.open(self.args.bundles / "server", verify=False)
        page_bytes = 16 * bundle.num_layers * 2 * bundle.config.num_key_value_heads * head_dim(bundle.config) * 4
        self.page_mib = page_bytes / 2**20  # default page size, float32

        self.port, self.metrics_port = free_port(), free_port()
        store = f"redis://127.0.0.1:{self.redis_port}/0" if self.args.store == "redis" else str(self.work / "store")
        env = dict(os.environ, INFEMERAL_BUNDLE=str(self.args.bundles / "server"), INFEMERAL_STORE=store,
                   INFEMERAL_LISTEN=f"127.0.0.1:{self.port}", INFEMERAL_DEVICE="cpu", INFEMERAL_DTYPE="float32",
                   INFEMERAL_METRICS_PORT=str(self.metrics_port), INFEMERAL_TURN_IDLE_SECONDS=str(IDLE_SECONDS),
                   INFEMERAL_MAX_TURN_SECONDS="300", INFEMERAL_VERIFY_BUNDLE="false",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.server_log = open(self.work / "server.log", "w")
        self.server = subprocess.Popen([sys.executable, "-m", "infemeral.server.main", "--log-level", "WARNING"],
                                       env=env, stdout=self.server_log, stderr=subprocess.STDOUT)
        wait_until_serving(f"127.0.0.1:{self.port}", self.server, timeout=300)

    def spawn(self, worker: int) -> None:
        incarnation = self.incarnations[worker]
        self.incarnations[worker] += 1
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(worker), "--incarnation", str(incarnation),
             "--seed", str(self.args.seed), "--address", f"127.0.0.1:{self.port}",
             "--client-bundle", str(self.args.bundles / "client"), "--sessions", str(self.sessions),
             "--end-at", str(self.end_at), "--idle-seconds", str(IDLE_SECONDS)],
            stdout=subprocess.PIPE, stderr=open(self.work / f"client-{worker:02d}-{incarnation}.log", "w"), text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")))
        self.workers[worker] = proc
        threading.Thread(target=self.listen, args=(worker, proc), daemon=True).start()

    def listen(self, worker: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event["kind"] == "action":
                status = event["status"]
                if event["action"] == "turn" and status == "OK":
                    self.tally.turn_seconds.append(event["ended"] - event["started"])
                if status == "UNAVAILABLE" and self.overlaps_store_down(event["started"], event["ended"]):
                    status = "UNAVAILABLE (store down)"
                with self.lock:
                    self.tally.outcomes[(event["action"], status)] += 1
                    self.tally.details.setdefault((event["action"], status), event.get("detail", ""))
            elif event["kind"] == "killme":
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                with self.lock:
                    self.tally.kills += 1
                    self.tally.outcomes[("sigkill", "KILLED")] += 1
                if time.time() < self.end_at - 5:
                    self.spawn(worker)
                return
        code = proc.wait()
        if code != 0:
            with self.lock:
                log = sorted(self.work.glob(f"client-{worker:02d}-*.log"))[-1].read_text()
                self.tally.worker_crashes.append(f"client {worker}: exit {code}: {log[-400:]}")

    def overlaps_store_down(self, started: float, ended: float) -> bool:
        """Whether an action ran while Redis was down (or reloading its data: a few seconds after)."""
        windows = list(self.tally.store_down)
        if self.redis_down_since is not None:
            windows.append((self.redis_down_since, time.time()))
        return any(started <= up + STORE_RECOVERY_SECONDS and ended >= down for down, up in windows)

    # -- background: health prober, Redis restarts -----------------------------------------------------
    def probe_health(self) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            last_sample = 0.0
            while not self.stopping.wait(0.25):
                if time.time() - last_sample >= 30:
                    last_sample = time.time()
                    self.tally.rss_mb.append((last_sample - self.started_at, self.rss_mb()))
                used = self.metrics().get("infemeral_kv_pool_used_pages", 0)
                self.tally.peak_used_pages = max(self.tally.peak_used_pages, used)
                started = time.perf_counter()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    self.tally.health_ms.append((time.perf_counter() - started) * 1000)
                except grpc.RpcError:
                    self.tally.health_failures += 1

    def restart_redis_now_and_then(self) -> None:
        while not self.stopping.wait(self.rng.uniform(60, 150)):
            if time.time() > self.end_at - 30:
                return
            self.redis_down_since = time.time()
            self.redis.send_signal(signal.SIGKILL)
            self.redis.wait()
            time.sleep(self.rng.uniform(0.5, 3.0))
            self.start_redis()
            self.tally.store_down.append((self.redis_down_since, time.time()))
            self.redis_down_since = None
            self.tally.redis_restarts += 1

    # -- measurements ----------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        values = {}
        for line in text.splitlines():
            m = re.match(r"^(infemeral_\w+?)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m:
                values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return values

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.server.pid).memory_info().rss / 2**20

    def resident_by_kind(self) -> dict[str, float]:
        """The server's resident memory (MiB) by kind, from /proc/PID/smaps; empty where there is none."""
        try:
            return resident_by_kind(Path(f"/proc/{self.server.pid}/smaps").read_text())
        except OSError:
            return {}

    def wait_quiet(self, timeout: float = 60) -> dict[str, float]:
        """Until no turn is open and no page is used (vanished streams end at the idle bound)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m.get("infemeral_active_turns", 1) == 0 and m.get("infemeral_kv_pool_used_pages", 1) == 0) or \
                    time.monotonic() > deadline:
                return m
            time.sleep(0.5)

    # -- the run ---------------------------------------------------------------------------------------
    def main(self) -> str:
        args = self.args
        try:
            if args.store == "redis":
                self.redis_port = free_port()
                self.start_redis()
            self.start_server()
            self.rss_start = self.rss_mb()
            self.resident_start = self.resident_by_kind()
            self.started_at = time.time()
            self.end_at = self.started_at + args.minutes * 60
            threading.Thread(target=self.probe_health, daemon=True).start()
            if args.store == "redis":
                threading.Thread(target=self.restart_redis_now_and_then, daemon=True).start()
            for worker in range(args.clients):
                self.spawn(worker)
            while time.time() < self.end_at + 90 and any(p.poll() is None for p in self.workers.values()):
                time.sleep(1)
            for p in self.workers.values():
                if p.poll() is None:
                    p.kill()
            self.stopping.set()
            self.at_end = self.wait_quiet()
            self.verified = self.verify()
            self.after_verify = self.wait_quiet()
            self.rss_end = self.rss_mb()
            self.resident_end = self.resident_by_kind()
            return self.report()
        finally:
            self.stopping.set()
            for p in [*self.workers.values(), getattr(self, "server", None), self.redis]:
                if p is not None and p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        p.kill()
            if not args.keep:
                shutil.rmtree(self.work, ignore_errors=True)

    def verify(self) -> dict[str, int]:
        """Reopen every client's session; check the server's version and length, then a greedy continuation
        against plain transformers on the same transcript."""
        import torch
        from transformers import AutoModelForCausalLM

        from infemeral.client.client import Client
        from infemeral.client.sampling import SamplingParams
        from infemeral.cloak.sources import default_gguf_path

        path = default_gguf_path()
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         dtype=torch.float32).eval()
        counts = Counter()
        with Client(f"127.0.0.1:{self.port}", self.args.bundles / "client", timeout=120) as client:
            for file in sorted(self.sessions.glob("client-*.session")):
                session = client.load_session(file)
                if session.pending_commit is not None:
                    session.chat("Hello again.", SamplingParams(max_new_tokens=1))  # settles it first
                if session.version == 0:
                    counts["nothing committed"] += 1
                    continue
                prompt = "Summarise our conversation in a few words."
                ids = client.tokenizer.apply_chat_template(session.messages + [{"role": "user", "content": prompt}],
                                                           add_generation_prompt=True, tokenize=True)
                ids = list(ids if isinstance(ids, list) else ids["input_ids"])
                try:
                    result = session.chat(prompt, SamplingParams(max_new_tokens=6))
                except Exception as e:  # noqa: BLE001 - reported
                    counts[f"reopen failed: {type(e).__name__}"] += 1
                    continue
                with torch.no_grad():
                    expected = reference.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                                  pad_token_id=client.tokenizer.eos_token_id)[0, len(ids):].tolist()
                same = expected[:len(result.token_ids)] == result.token_ids
                counts["intact" if same else "continuation differs"] += 1
        return counts

    def report(self) -> str:
        tally, args = self.tally, self.args
        done = sum(n for (action, status), n in tally.outcomes.items() if status == "OK")
        committed_turns = self.at_end.get('infemeral_turns_total{outcome="committed"}', 0)
        unexpected = {k: n for k, n in tally.outcomes.items()
                      if k[1] not in EXPECTED[k[0]] and k[1] != "UNAVAILABLE (store down)"}
        health = sorted(tally.health_ms)
        turn_seconds = sorted(tally.turn_seconds)
        total = self.at_end.get("infemeral_kv_pool_pages", 0)
        server_outcomes = sorted((m.group(1), v) for k, v in self.at_end.items()
                                 if (m := re.match(r'infemeral_turns_total\{outcome="(\w+)"\}', k)))
        lines = [
            f"## Soak: {args.clients} clients, {args.minutes:g} min, store {args.store}, seed {args.seed}",
            "",
            f"- machine: {os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.1f}",
            f"- actions finished as intended: {done}; turns committed (server count): {committed_turns:.0f}",
            f"- client processes SIGKILLed mid-turn: {tally.kills}; Redis restarts: {tally.redis_restarts}",
            f"- sessions verified at the end: {dict(self.verified)}",
            f"- KV pool at the end: {total - self.at_end.get('infemeral_kv_pool_used_pages', 0):.0f} of "
            f"{total:.0f} pages free; open turns {self.at_end.get('infemeral_active_turns', -1):.0f}; after the "
            f"verification turns {total - self.after_verify.get('infemeral_kv_pool_used_pages', 0):.0f} free",
            f"- server RSS: {self.rss_start:.0f} MiB at start, {self.rss_end:.0f} MiB at the end; at most "
            f"{tally.peak_used_pages:.0f} KV pages were in use at once ({tally.peak_used_pages * self.page_mib:.0f} "
            f"MiB of pool memory, which stays resident once touched)",
            *[f"- server resident memory {when} by kind (MiB): "
              + (", ".join(f"{k} {v:.0f}" for k, v in kinds.items()) or "not readable here")
              for when, kinds in (("at start", self.resident_start), ("at the end", self.resident_end))],
            f"- turn latency (whole SDK turn, {len(turn_seconds)} turns): p50 {_quantile(turn_seconds, 0.5):.1f} s, "
            f"p90 {_quantile(turn_seconds, 0.9):.1f} s",
            f"- health checks: {len(health)} answered, {tally.health_failures} failed; latency p50 {_quantile(health, 0.5):.1f} ms, "
            f"p99 {_quantile(health, 0.99):.1f} ms, max {health[-1] if health else float('nan'):.1f} ms",
            "",
            "| action | status | count |",
            "| --- | --- | --- |",
            *[f"| {a} | {s} | {n} |" for (a, s), n in sorted(tally.outcomes.items())],
            "",
            "Server turn outcomes: " + ", ".join(f"{name} {n:.0f}" for name, n in server_outcomes),
            f"Outcomes other than the action's intended one: {sum(unexpected.values())}",
            *[f"    {a}/{s}: {n}, e.g. {tally.details.get((a, s), '')!r}" for (a, s), n in sorted(unexpected.items())],
            "Server RSS over the run (s: MiB): " + ", ".join(f"{t:.0f}: {mb:.0f}" for t, mb in tally.rss_mb),
            f"Client processes that crashed: {len(tally.worker_crashes)}",
            *[f"    {c}" for c in tally.worker_crashes],
        ]
        return "\n".join(lines) + "\n"


ARENA_HEAP = 64 << 20  # glibc reserves each thread arena's heaps as 64 MiB regions aligned to 64 MiB (64-bit)


def resident_by_kind(smaps: str) -> dict[str, float]:
    """Resident MiB by kind: glibc's thread arenas (and how many heaps they hold), its main heap, other anonymous
    memory (large allocations mapped on their own: the KV pool, big tensors) and file-backed pages (code, libraries,
    and the bundle's weights, which are mapped from their files and paged in by the first turns)."""
    kinds = {"thread arenas": 0.0, "main heap": 0.0, "other anonymous": 0.0, "file-backed": 0.0}
    arenas, kind = 0, None
    for line in smaps.splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ (\d+)\s*(.*)$", line)
        if head:
            start, end, perms, inode, name = int(head[1], 16), int(head[2], 16), head[3], int(head[4]), head[5]
            if name == "[heap]":
                kind = "main heap"
            elif inode or name.startswith("/"):
                kind = "file-backed"
            elif not name and perms.startswith("rw") and start % ARENA_HEAP == 0 and end - start <= ARENA_HEAP:
                kind, arenas = "thread arenas", arenas + 1
            else:
                kind = "other anonymous"
        elif line.startswith("Rss:") and kind is not None:
            kinds[kind] += int(line.split()[1]) / 1024
    return {**kinds, "thread arena heaps": arenas}


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def ensure_bundles(directory: Path) -> Path:
    if (directory / "server" / "manifest.json").exists() and (directory / "client" / "manifest.json").exists():
        return directory
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource, default_gguf_path

    print(f"preparing bundles of the packaged model in {directory} ...", file=sys.stderr)
    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prepare(output=directory, source=ModelSource(model, tokenizer, "packaged SmolLM2", packaged=True),
            progress=False)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16, help=f"client processes (at most {MAX_CLIENTS})")
    parser.add_argument("--minutes", type=float, default=10.0, help=f"length of the faulty phase (at most {MAX_MINUTES})")
    parser.add_argument("--store", choices=["dir", "redis"], default="dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundles", type=Path, default=Path.home() / ".cache" / "infemeral-soak" / "bundles",
                        help="bundles of the packaged model (prepared there if missing)")
    parser.add_argument("--report", type=Path, help="also write the report (Markdown) here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, sessions, store)")
    # worker mode (started by the orchestrator)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--incarnation", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--client-bundle", help=argparse.SUPPRESS)
    parser.add_argument("--sessions", help=argparse.SUPPRESS)
    parser.add_argument("--end-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.worker is not None:
        if not args.address.startswith("127.0.0.1:"):
            parser.error("the soak runs on loopback only")
        Worker(args).run()
        return 0
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.minutes <= MAX_MINUTES:
        parser.error(f"--clients must be 1..{MAX_CLIENTS} and --minutes in (0, {MAX_MINUTES}]")
    if args.store == "redis" and shutil.which("redis-server") is None:
        parser.error("--store redis needs redis-server installed")
    args.bundles = ensure_bundles(args.bundles.expanduser())
    report = Orchestrator(args).main()
    print(report)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
