"""Start-up: the wall time of short commands, each in its own process, as a person types them.

One `infemeral-server` runs for the section. Every repetition runs, in a rotating order, `python -c "import torch"`
(the floor: any command that computes pays it), `infemeral-client --help`, `info`, `delete --session NAME` (a
session saved just before by the SDK in this process) and `generate "What is the capital of France?" --verbose`,
whose own report gives the turn's time (first token + decode), so its overhead is its wall time minus that. The
server's and `serve`'s time to ready (from the process's start to SERVING / an HTTP 200 from /v1/models) are
figures, measured as many times.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.harness import at_most, fmt, log, median, now, ratio
from bench.sections import Result

NAME = "startup"
TITLE = "Start-up of the commands"

QUESTION = "What is the capital of France?"
GENERATE_OVERHEAD_S = 2.5  # the issue's targets: generate <= its turn + 2.5 s; info, --help, delete <= 1 s
SHORT_COMMAND_S = 1.0
BIN = Path(sys.executable).parent


@dataclass
class CommandRow:
    command: str
    seconds: float         # median wall time
    runs: int
    turn_seconds: float = float("nan")  # generate: the turn its --verbose line reports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_command() -> list[str]:
    exe = BIN / "infemeral-client"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "infemeral.cli"]


def timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t = now()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    seconds = now() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with code {proc.returncode}:\n{proc.stderr[-2000:]}")
    return seconds, proc


def turn_seconds(verbose: str) -> float:
    """First token plus decode time from generate's --verbose line (decode = (generated - 1) / tokens per s)."""
    first = float(re.search(r"first token ([\d.]+)s", verbose).group(1))
    generated = int(re.search(r"(\d+) generated", verbose).group(1))
    rate = float(re.search(r"([\d.]+) tokens/s", verbose).group(1))
    return first + ((generated - 1) / rate if generated > 1 and rate > 0 else 0.0)


def wait_ready(probe, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited during start-up with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.args} not ready in {timeout} s")
        time.sleep(0.02)


def grpc_serving(address: str):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)

    def probe() -> bool:
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
    return probe


def http_ok(url: str):
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False
    return probe


def start(cmd: list[str], env: dict, probe) -> tuple[float, subprocess.Popen]:
    """Start a long-running command; seconds until `probe` says it is ready."""
    t = now()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(probe, proc)
    except BaseException:
        stop(proc)
        raise
    return now() - t, proc


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(wb) -> Result:
    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams

    reps = 2 if wb.quick else 5
    tmp = wb.tmp / "startup"
    sessions = tmp / "sessions"
    grpc_port = free_port()
    address = f"127.0.0.1:{grpc_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFEMERAL_")}
    env.update(INFEMERAL_BUNDLE=str(wb.server_dir), INFEMERAL_STORE=str(tmp / "store"), INFEMERAL_LISTEN=address,
               INFEMERAL_METRICS_PORT="0", INFEMERAL_DEVICE="cpu", INFEMERAL_SERVER=address,
               INFEMERAL_CLIENT_BUNDLE=str(wb.client_dir), INFEMERAL_SESSIONS_DIR=str(sessions),
               INFEMERAL_ANSWER_INDEX_DIR=str(tmp / "answers"))
    server_cmd = [str(BIN / "infemeral-server")] if (BIN / "infemeral-server").exists() else \
        [sys.executable, "-m", "infemeral.server.main"]
    client = client_command()

    server_ready, serve_ready = [], []
    for _ in range(reps - 1):  # the last start stays up for the commands
        seconds, proc = start(server_cmd, env, grpc_serving(address))
        stop(proc)
        server_ready.append(seconds)
    seconds, server = start(server_cmd, env, grpc_serving(address))
    server_ready.append(seconds)
    log(f"server ready in {fmt(median(server_ready), '.2f')} s (median of {reps})")
    times: dict[str, list[float]] = {"import torch": [], "--help": [], "info": [], "delete": [], "generate": []}
    turns: list[float] = []
    try:
        sdk = Client(address, wb.client_dir, timeout=120)
        try:
            def delete_one() -> float:
                session = sdk.new_session()
                session.chat("Hi", SamplingParams(max_new_tokens=2))
                session.save(sessions / "bench.session")
                return timed(client + ["delete", "--session", "bench"], env)[0]

            def generate_one() -> float:
                seconds, proc = timed(client + ["generate", QUESTION, "--verbose", "--temperature", "0",
                                                "--max-new-tokens", "32"], env)
                turns.append(turn_seconds(proc.stderr))
                return seconds

            steps = {"import torch": lambda: timed([sys.executable, "-c", "import torch"], env)[0],
                     "--help": lambda: timed(client + ["--help"], env)[0],
                     "info": lambda: timed(client + ["info"], env)[0],
                     "delete": delete_one, "generate": generate_one}
            names = list(steps)
            for rep in range(reps):
                for name in names[rep % len(names):] + names[:rep % len(names)]:  # a rotating order
                    times[name].append(steps[name]())
                log(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names))
        finally:
            sdk.close()
        serve_port = free_port()
        serve_env = dict(env, INFEMERAL_SERVE_PORT=str(serve_port))
        for _ in range(reps):
            seconds, proc = start(client + ["serve"], serve_env, http_ok(f"http://127.0.0.1:{serve_port}/v1/models"))
            stop(proc)
            serve_ready.append(seconds)
        log(f"serve ready in {fmt(median(serve_ready), '.2f')} s (median of {reps})")
    finally:
        stop(server)

    rows = [CommandRow(f"infemeral-client {n}" if n != "import torch" else 'python -c "import torch"',
                       median(times[n]), len(times[n])) for n in times]
    rows[-1].turn_seconds = median(turns)
    rows += [CommandRow("infemeral-server: start to SERVING", median(server_ready), len(server_ready)),
             CommandRow("infemeral-client serve: start to HTTP 200", median(serve_ready), len(serve_ready))]
    floor = median(times["import torch"])
    overheads = [wall - turn for wall, turn in zip(times["generate"], turns)]
    overhead = median(overheads)
    facts = {"floor": floor, "generate_overhead": overhead, "turn": median(turns),
             "server_ready": median(server_ready), "serve_ready": median(serve_ready)}

    def short(name: str) -> str:
        value = median(times[name])
        return f"{value:.2f} s, {ratio(value, floor):.2f}x of import torch ({floor:.2f} s)"

    targets = [
        at_most(NAME, "generate_overhead", f"generate's wall time at most its turn + {GENERATE_OVERHEAD_S} s",
                overhead, GENERATE_OVERHEAD_S,
                f"{overhead:.2f} s over a {median(turns):.2f} s turn, wall {median(times['generate']):.2f} s; "
                f"{ratio(overhead, floor):.2f}x of import torch ({floor:.2f} s)",
                note=f"importing torch alone takes {floor:.2f} s on this machine; everything else around the turn "
                     f"(the command's other imports, the bundle, the tokenizer, connecting, deleting the session) "
                     f"{overhead - floor:.2f} s"),
        at_most(NAME, "info", f"info at most {SHORT_COMMAND_S} s", median(times["info"]), SHORT_COMMAND_S,
                short("info")),
        at_most(NAME, "help", f"--help at most {SHORT_COMMAND_S} s", median(times["--help"]), SHORT_COMMAND_S,
                short("--help")),
        at_most(NAME, "delete", f"delete at most {SHORT_COMMAND_S} s", median(times["delete"]), SHORT_COMMAND_S,
                short("delete")),
    ]
    method = (f"Each command in its own process, {reps} repetitions in a rotating order against one "
              f"infemeral-server on 127.0.0.1 (CPU, float32), medians; generate answers with up to 32 greedy "
              f"tokens. Time to ready: {reps} starts each, polled every 20 ms.")
    return Result(NAME, method, rows, targets, facts)


def report(r: Result) -> list[str]:
    f = r.facts
    lines = [r.method + "\n", "| command | median s | runs | / import torch |", "|---|---|---|---|"]
    lines += [f"| {row.command} | {fmt(row.seconds, '.2f')} | {row.runs} | {fmt(ratio(row.seconds, f['floor']), '.2f')}× |"
              for row in r.rows]
    lines += ["", f"generate: a {fmt(f['turn'], '.2f')} s turn, {fmt(f['generate_overhead'], '.2f')} s around it "
                  f"(start-up, loading, the session's deletion).\n"]
    lines += [f"- {t.line()}" + (f" — {t.note}" if t.note and not t.passed else "") for t in r.targets]
    return lines + [""]
