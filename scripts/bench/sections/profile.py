"""Profile: where one decode step's time goes, end to end, at 1 and 8 concurrent sessions.

Timers are wrapped around the functions a decode step passes through (nothing else changes): on the
client the embedding + layer 0 + rotation (`ClientModel.cloak`), the un-rotation + final norm + LM head
(`ClientModel.logits`), sampling, detokenising and the protobuf conversions; on the server the engine's
`step` (a gRPC handler thread hands the step to the engine's worker and waits for its result), the
batched forward pass over the served layers and, inside it, the paged attention. The gRPC round trip is
timed by a client interceptor. Sessions run as threads of this process (the wrappers see only this
process), with `profile_steps` decode steps each; figures are per decode step of one session.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from bench.harness import fmt, log, mean, median, ratio
from bench.sections import Result

NAME = "profile"
TITLE = "Where a decode step's time goes"
PROMPT = "Describe a busy harbour at dawn."
SESSIONS = (1, 8)


@dataclass
class ProfileRow:
    sessions: int
    part: str
    ms_per_step: float   # per decode step of one session (a forward pass shared by k steps counts once per step)
    share: float         # of the token cycle


class Probe:
    """Wraps the functions a decode step passes through; records (label, seconds, size) per call."""

    def __init__(self, split):
        self.split, self.records, self._undo = split, defaultdict(list), []

    def wrap(self, owner, name: str, label: str, size=lambda *a, **k: 1) -> None:
        original = getattr(owner, name)
        records = self.records[label]

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                records.append((time.perf_counter() - t, size(*args, **kwargs)))

        self._replace(owner, name, original, timed)

    def wrap_future(self, owner, name: str, label: str, size=lambda *a, **k: 1) -> None:
        """Like `wrap` for a call that returns a future: from the call until the future is done."""
        original = getattr(owner, name)
        records = self.records[label]

        def timed(*args, **kwargs):
            t, n = time.perf_counter(), size(*args, **kwargs)
            future = original(*args, **kwargs)
            future.add_done_callback(lambda _: records.append((time.perf_counter() - t, n)))
            return future

        self._replace(owner, name, original, timed)

    def _replace(self, owner, name: str, original, timed) -> None:
        had_own = name in vars(owner) if not isinstance(owner, type) else True
        setattr(owner, name, timed)
        self._undo.append((owner, name, original, had_own))

    def __enter__(self) -> "Probe":
        from infemeral.client import turn_link
        from infemeral.client.sampling import Sampler
        from infemeral.kvcache.paged import PagedBatch
        from infemeral.server import turn_call

        client, engine = self.split.client, self.split.engine
        rows = lambda hidden, *a, **k: int(hidden.shape[0])  # noqa: E731
        self.wrap(client.model, "cloak", "client_cloak", lambda ids, *a, **k: len(ids))
        self.wrap(client.model, "logits", "client_logits")
        self.wrap(client.tokenizer, "decode", "client_detokenise")
        self.wrap(Sampler, "__call__", "client_sampling")
        self.wrap(turn_link, "to_proto", "client_serialise")  # the module a turn's steps call them from
        self.wrap(turn_link, "from_proto", "client_serialise")
        self.wrap(turn_call, "to_proto", "server_serialise")
        self.wrap(turn_call, "from_proto", "server_serialise")
        # the service submits a step and awaits its future
        self.wrap_future(engine, "submit_step", "engine_step", lambda turn, hidden, *a, **k: int(hidden.shape[0]))
        self.wrap(layer_stack(engine), "forward_batch", "forward", rows)
        self.wrap(PagedBatch, "attend", "attention")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original, had_own in reversed(self._undo):
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    def decode(self, label: str) -> list[float]:
        """Seconds of the calls that belonged to one-token (decode) steps."""
        return [s for s, size in self.records[label] if size == 1]


def layer_stack(engine):
    for owner in (engine, getattr(engine, "runner", None)):
        layers = getattr(owner, "layers", None)
        if layers is not None and hasattr(layers, "forward_batch"):
            return getattr(layers, "_inner", layers)
    raise RuntimeError("cannot find the engine's layer stack to time")


def profile(split, sessions: int, steps: int) -> tuple[list[ProfileRow], dict]:
    from infemeral.client.sampling import SamplingParams

    k0 = len(split.recorder.turns)
    with Probe(split) as probe:
        threads = [threading.Thread(target=lambda: split.client.new_session().chat(
            PROMPT, SamplingParams(max_new_tokens=steps + 1, speculate="off"))) for _ in range(sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    turns = split.recorder.turns[k0:]
    decode_steps = [pair for turn in turns for pair in turn.decode_steps(steps + 1)]
    sends = [[q.t for q, _ in turn.decode_steps(steps + 1)] for turn in turns]
    cycle = median([b - a for s in sends for a, b in zip(s, s[1:])])
    round_trip = median([b.t - a.t for a, b in decode_steps])
    n = len(decode_steps)
    forwards = [(s, size) for s, size in probe.records["forward"] if size <= sessions]  # decode-only forwards
    decode_forward_s = sum(s for s, _ in forwards)
    per_step_forward = decode_forward_s / max(1, sum(size for _, size in forwards))
    attention_s = sum(s for s, _ in probe.records["attention"])
    all_forward_s = sum(s for s, _ in probe.records["forward"])
    attention_share = ratio(attention_s, all_forward_s)
    engine_step = median(probe.decode("engine_step"))
    per_call = {label: median(probe.decode(label)) for label in ("client_cloak", "client_logits")}
    per_call["client_sampling"] = median([s for s, _ in probe.records["client_sampling"]])
    per_call["client_detokenise"] = median([s for s, _ in probe.records["client_detokenise"]])
    per_call["client_serialise"] = 2 * median([s for s, _ in probe.records["client_serialise"]])
    per_call["server_serialise"] = 2 * median([s for s, _ in probe.records["server_serialise"]])
    forward_wall = median([s for s, _ in forwards])
    parts = [
        ("client: embedding + layer 0 + rotation", per_call["client_cloak"]),
        ("client: un-rotation + final norm + LM head", per_call["client_logits"]),
        ("client: sampling", per_call["client_sampling"]),
        ("client: detokenising", per_call["client_detokenise"]),
        ("client: tensor ⇄ protobuf", per_call["client_serialise"]),
        ("gRPC + service (round trip − engine step)", round_trip - engine_step),
        ("  of which server tensor ⇄ protobuf", per_call["server_serialise"]),
        ("engine: hand-off and waiting (engine step − one forward)", engine_step - forward_wall),
        ("engine: forward pass of the batch (served layers)", forward_wall),
        ("  of which paged attention", forward_wall * attention_share),
        ("token cycle (decode step send → next send)", cycle),
    ]
    rows = [ProfileRow(sessions, part, seconds * 1000, ratio(seconds, cycle)) for part, seconds in parts]
    facts = {"decode_steps": n, "forwards": len(forwards), "steps_per_forward": ratio(
        sum(size for _, size in forwards), len(forwards)), "forward_ms_per_step": per_step_forward * 1000,
        "client_ms_total": sum(per_call[k] for k in per_call if k.startswith("client")) * 1000,
        "mean_cycle_ms": mean([b - a for s in sends for a, b in zip(s, s[1:])]) * 1000}
    return rows, facts


def run(wb) -> Result:
    split = wb.split()
    rows, facts = [], {}
    for n in SESSIONS:
        got, f = profile(split, n, wb.params.profile_steps)
        rows += got
        facts[n] = f
        for r in got:
            log(f"  {n} session(s): {r.part:58s} {r.ms_per_step:7.2f} ms ({fmt(r.share * 100, '.0f')}%)")
        log(f"  {n} session(s): {f['steps_per_forward']:.2f} steps per forward")
    method = ("Medians per decode step of one session, in the server's dtype "
              f"({split.dtype_name}); the client runs in float32. Sessions are threads of this process. The parts "
              "overlap in time across sessions (8 sessions' clients run while the server computes), so at 8 "
              "sessions they do not add up to the token cycle.")
    return Result(NAME, method, rows, [], {str(k): v for k, v in facts.items()})


def report(r: Result) -> list[str]:
    lines = [r.method + "\n"]
    by_part: dict[str, dict[int, ProfileRow]] = {}
    for x in r.rows:
        by_part.setdefault(x.part, {})[x.sessions] = x
    counts = sorted({x.sessions for x in r.rows})
    lines.append("| part | " + " | ".join(f"{n} session(s): ms per step (share of cycle)" for n in counts) + " |")
    lines.append("|---|" + "---|" * len(counts))
    for part, cols in by_part.items():
        lines.append(f"| {part} | " + " | ".join(
            f"{fmt(cols[n].ms_per_step, '.2f')} ({fmt(cols[n].share * 100, '.0f')}%)" if n in cols else "–"
            for n in counts) + " |")
    lines.append("")
    lines.append("Steps per forward pass: " + ", ".join(
        f"{n} session(s) {fmt(r.facts[str(n)]['steps_per_forward'], '.2f')}" for n in counts) + ".\n")
    return lines
