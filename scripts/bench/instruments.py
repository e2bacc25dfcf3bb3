"""Instruments that watch the split system without changing it.

`WireRecorder` (a gRPC client interceptor) records the size and time of every Turn message;
`LayerTimer` wraps the engine's served layers to time each forward on the engine's worker thread;
`StoreMeter` counts bytes the session store writes; `Stamps` timestamps each token plain `generate`
produces; `run_measured` runs a subprocess and reads its own peak memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from bench.harness import median, now


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


# A small launcher between us and the measured command. Linux seeds a child's peak RSS with its parent's
# at fork/exec (vfork shares the parent's memory outright), so a child started from this process would
# report at least our own peak; started from a fresh ~10 MB interpreter, it reports its own.
_PEAK_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""


def run_measured(cmd: list[str]) -> dict:
    """Run a subprocess; its wall time and its own peak RSS (wait4 rusage of that child, from a fresh launcher)."""
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as peak:
        t = now()
        proc = subprocess.Popen([sys.executable, "-c", _PEAK_LAUNCHER, peak.name, *cmd],
                                stdout=subprocess.DEVNULL, stderr=err)
        proc.wait()
        seconds = now() - t
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2000:]
        maxrss_kb = peak.read().strip()
    if proc.returncode != 0 or not maxrss_kb:
        raise RuntimeError(f"{' '.join(cmd)} failed with code {proc.returncode}:\n{tail}")
    return {"seconds": seconds, "peak_rss_mb": int(maxrss_kb) / 1024}


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
