"""Speculation: decode speed with and without speculative decoding, over an emulated WAN (DESIGN.md §9).

The client reaches the in-process server through `scripts/delay_proxy.py`, which delays each direction
by half the round trip (0, 20 and 80 ms RTT). Four workloads of five prompts each (`bench/workloads.py`):
copying a passage, answering from a given document, rewriting a code snippet, open chat. Every prompt
runs in a fresh session with speculation off and with prompt-lookup drafts (the default), alternating
which goes first, greedy, up to `spec_tokens` new tokens; tokens/s = (tokens − 1) / time from the first
to the last token. Open chat also runs two other draft sources: the answer index (this client's
earlier answers — warmed with the answers to ten other questions, and frozen, so no prompt drafts from
its own answer) and a draft model (the packaged SmolLM2 drafting for itself: as good a draft model as
there can be, and as costly as the served model — the worst case for its cost).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import at_least, fmt, log, mean, ratio
from bench.sections import Result
from bench.workloads import EARLIER_CHAT_PROMPTS, WORKLOADS

NAME = "speculation"
TITLE = "Speculative decoding over a WAN"
RTTS_MS = (0, 20, 80)
TARGET_RTT = 80
SPEEDUP_TARGETS = {"copy": 3.0, "document": 1.8, "code": 1.8}  # mean over the prompts, at TARGET_RTT
NEVER_BELOW = 0.95  # every workload, every RTT
VARIANTS = {"chat": ("answers", "draft")}  # extra draft sources measured on a workload


@dataclass
class SpecRow:
    workload: str
    prompt: int
    rtt_ms: int
    mode: str                   # "off", "ngram" (the default), "answers" (ngram + answer index), "draft"
    generated_tokens: int
    tokens_per_second: float
    time_to_first_token_ms: float
    round_trips: int
    drafted_tokens: int
    accepted_drafts: int
    wall_seconds: float
    identical: bool             # greedy tokens equal to speculation off for the same prompt

    @property
    def tokens_per_round_trip(self) -> float:
        return self.generated_tokens / self.round_trips if self.round_trips else float("nan")


def run(wb) -> Result:
    from delay_proxy import DelayProxy

    from infemeral.client.client import Client
    from infemeral.speculation.answer_index import AnswerIndex
    from infemeral.speculation.draft_model import DraftModel

    n = wb.params.spec_tokens
    split = wb.split()
    workloads = {w: prompts[:wb.params.spec_prompts] for w, prompts in WORKLOADS.items()}
    answers = AnswerIndex()
    drafter = DraftModel(wb.reference)
    rows: list[SpecRow] = []
    for rtt in RTTS_MS:
        with DelayProxy(split.address, rtt_ms=rtt) as proxy:
            clients = {"plain": Client(proxy.address, wb.client_dir, timeout=600, client_device="cpu"),
                       "answers": Client(proxy.address, wb.client_dir, timeout=600, answer_index=answers,
                                         client_device="cpu"),
                       "draft": Client(proxy.address, wb.client_dir, timeout=600, draft_model=drafter,
                                       client_device="cpu")}
            try:
                if rtt == RTTS_MS[0]:
                    warm_answer_index(clients["plain"], answers, n)
                for client in clients.values():
                    turn(client, "Hello!", 4, "ngram")  # warm-up
                log(f"  RTT {rtt} ms")
                for workload, prompts in workloads.items():
                    for i, prompt in enumerate(prompts):
                        rows += measure_prompt(clients, workload, i, prompt, rtt, n)
            finally:
                for client in clients.values():
                    client.close()
    facts = summarise(rows)
    targets = make_targets(facts)
    method = (f"The client reaches the in-process server through `scripts/delay_proxy.py` (each direction delayed "
              f"by RTT/2; RTT {', '.join(map(str, RTTS_MS))} ms). Four workloads of {wb.params.spec_prompts} prompts "
              "each (`scripts/bench/workloads.py`): copying a passage, answering from a given document, rewriting a "
              "code snippet, open chat. Each prompt runs in a fresh session with speculation off and on (prompt "
              f"lookup, the default; max_draft 8), alternating which goes first; greedy, at most {n} new tokens, "
              "float32 on both sides, one session at a time. Open chat also runs with the answer index (warmed "
              f"with the answers to {len(EARLIER_CHAT_PROMPTS)} other questions, then frozen) and with a draft model "
              "(the packaged SmolLM2 drafting for itself: the best drafts there can be, at the full cost of the "
              "served model on this CPU).")
    return Result(NAME, method, rows, targets, facts)


def warm_answer_index(client, answers, n: int) -> None:
    """Answer ten other questions (speculation off, not timed) and put the answers in the index, frozen."""
    for prompt in EARLIER_CHAT_PROMPTS:
        answers.add(turn(client, prompt, n, "off").token_ids)
    answers.add = lambda ids: None  # frozen: the measured answers do not feed later runs
    log(f"  answer index warmed with {len(EARLIER_CHAT_PROMPTS)} answers ({answers.num_tokens} tokens)")


def turn(client, prompt: str, n: int, speculate: str):
    from infemeral.client.sampling import SamplingParams

    session = client.new_session()
    try:
        return session.chat(prompt, SamplingParams(max_new_tokens=n, speculate=speculate))
    finally:
        session.delete()


def measure_prompt(clients: dict, workload: str, i: int, prompt: str, rtt: int, n: int) -> list[SpecRow]:
    """Speculation off and on for one prompt (order alternating between prompts), then the variants."""
    from bench.harness import now

    runs = [("off", "plain", "off"), ("ngram", "plain", "ngram")]
    runs = runs if i % 2 == 0 else runs[::-1]
    runs += [(v, v, "draft" if v == "draft" else "ngram") for v in VARIANTS.get(workload, ())]
    results = {}
    for mode, client, speculate in runs:
        t = now()
        r = turn(clients[client], prompt, n, speculate)
        results[mode] = (r, now() - t)
    baseline = results["off"][0].token_ids
    out = []
    for mode, (r, wall) in results.items():
        out.append(SpecRow(workload, i, rtt, mode, r.generated_tokens, r.tokens_per_second,
                           r.time_to_first_token * 1000, r.round_trips, r.drafted_tokens, r.accepted_drafts, wall,
                           r.token_ids == baseline))
    on, off = results["ngram"][0], results["off"][0]
    log(f"    {workload:8s} #{i}: {off.tokens_per_second:5.1f} -> {on.tokens_per_second:5.1f} tok/s "
        f"({ratio(on.tokens_per_second, off.tokens_per_second):.2f}x), {on.tokens_per_round_trip:.2f} tokens/round trip"
        + "".join(f", {m} {results[m][0].tokens_per_second:.1f} tok/s" for m in results if m not in ("off", "ngram")))
    return out


def summarise(rows: list[SpecRow]) -> dict:
    """Per workload, RTT and mode: mean speedup over the prompts (each prompt against its own 'off' run),
    mean tokens per round trip, mean TTFT; and whether every run gave speculation-off's tokens."""
    off = {(r.workload, r.prompt, r.rtt_ms): r for r in rows if r.mode == "off"}
    cells: dict[str, dict] = {}
    for r in rows:
        if r.mode == "off":
            continue
        key = f"{r.workload}/{r.mode}/{r.rtt_ms}"
        base = off[(r.workload, r.prompt, r.rtt_ms)]
        cell = cells.setdefault(key, {"workload": r.workload, "mode": r.mode, "rtt_ms": r.rtt_ms, "speedups": [],
                                      "tokens_per_round_trip": [], "ttft_ratio": [], "tps_off": [], "tps_on": []})
        cell["speedups"].append(ratio(r.tokens_per_second, base.tokens_per_second))
        cell["tokens_per_round_trip"].append(r.tokens_per_round_trip)
        cell["ttft_ratio"].append(ratio(r.time_to_first_token_ms, base.time_to_first_token_ms))
        cell["tps_off"].append(base.tokens_per_second)
        cell["tps_on"].append(r.tokens_per_second)
    for cell in cells.values():
        for k in ("speedups", "tokens_per_round_trip", "ttft_ratio", "tps_off", "tps_on"):
            cell[f"mean_{k}"] = mean(cell[k])
    mismatches = [f"{r.workload}#{r.prompt}/{r.mode}/{r.rtt_ms}ms" for r in rows if not r.identical]
    return {"cells": cells, "runs": len(rows), "mismatches": mismatches}


def make_targets(facts: dict) -> list:
    cells = facts["cells"]
    targets = []
    for workload, goal in SPEEDUP_TARGETS.items():
        cell = cells.get(f"{workload}/ngram/{TARGET_RTT}")
        value = cell["mean_speedups"] if cell else float("nan")
        targets.append(at_least(NAME, f"{workload}_speedup_{TARGET_RTT}ms",
                                f"{workload}: tokens/s with speculation >= {goal}x without, at {TARGET_RTT} ms RTT "
                                "(mean over the prompts)", value, goal, f"{fmt(value, '.2f')}x"))
    default = [c for c in cells.values() if c["mode"] == "ngram"]
    worst = min(default, key=lambda c: c["mean_speedups"]) if default else None
    value = worst["mean_speedups"] if worst else float("nan")
    where = f"{worst['workload']} at {worst['rtt_ms']} ms" if worst else "–"
    targets.append(at_least(NAME, "never_slower", f"every workload at every RTT (0 ms included) >= {NEVER_BELOW}x "
                            "speculation off", value, NEVER_BELOW, f"lowest {fmt(value, '.2f')}x: {where}"))
    bad = facts["mismatches"]
    targets.append(at_least(NAME, "greedy_identical", "greedy tokens with speculation (every source) identical "
                            "to speculation off", -len(bad), 0,
                            f"{facts['runs'] - len(bad)} of {facts['runs']} runs identical"
                            + (f"; differ: {', '.join(bad[:5])}" if bad else "")))
    return targets


def report(r: Result) -> list[str]:
    cells = r.facts["cells"]
    lines = [r.method + "\n",
             "Speedup = tokens/s with speculation / tokens/s without, per prompt, averaged over the prompts "
             "(mean tokens/s without → with beside it). Tokens per round trip = generated tokens / steps that "
             "produced tokens (1.0 without speculation). TTFT ratio = time to first token with / without.\n",
             "| workload | drafts | RTT | speedup | tokens/s (off → on) | tokens per round trip | TTFT ratio |",
             "|---|---|---|---|---|---|---|"]
    for cell in sorted(cells.values(), key=lambda c: (list(WORKLOADS).index(c["workload"]), c["mode"] != "ngram",
                                                      c["mode"], c["rtt_ms"])):
        tps = f"{fmt(cell['mean_tps_off'])} → {fmt(cell['mean_tps_on'])}"
        lines.append(f"| {cell['workload']} | {cell['mode']} | {cell['rtt_ms']} ms | "
                     f"{fmt(cell['mean_speedups'], '.2f')}x | {tps} | "
                     f"{fmt(cell['mean_tokens_per_round_trip'], '.2f')} | {fmt(cell['mean_ttft_ratio'], '.2f')} |")
    lines += ["", "drafts: `ngram` = prompt lookup over the conversation (the default); `answers` = prompt lookup, "
              "then the answer index of earlier answers; `draft` = prompt lookup, then the draft model.\n"]
    return lines


def plot(r: Result, out) -> list[str]:
    import matplotlib.pyplot as plt

    cells = r.facts["cells"]
    keys = [(w, "ngram") for w in WORKLOADS] + [(w, v) for w, vs in VARIANTS.items() for v in vs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(RTTS_MS)
    for j, rtt in enumerate(RTTS_MS):
        xs = [i + (j - (len(RTTS_MS) - 1) / 2) * width for i in range(len(keys))]
        for ax, field in ((axes[0], "mean_speedups"), (axes[1], "mean_tokens_per_round_trip")):
            ys = [cells.get(f"{w}/{m}/{rtt}", {}).get(field, float("nan")) for w, m in keys]
            ax.bar(xs, ys, width, label=f"{rtt} ms RTT")
    labels = [w if m == "ngram" else f"{w}\n+{m}" for w, m in keys]
    for ax, title in ((axes[0], "tokens/s, speculation on / off"), (axes[1], "tokens per round trip")):
        ax.set_xticks(range(len(keys)), labels)
        ax.set_title(title)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.legend()
    axes[0].axhline(NEVER_BELOW, color="tab:red", ls=":", lw=1, label=f"floor {NEVER_BELOW}x")
    for i, (w, m) in enumerate(keys):
        if m == "ngram" and w in SPEEDUP_TARGETS:
            axes[0].plot([i + width], [SPEEDUP_TARGETS[w]], "r*", ms=10)
    axes[0].set_ylabel("speedup (red star: target at 80 ms)")
    fig.tight_layout()
    fig.savefig(out / "speculation.png", dpi=110)
    plt.close(fig)
    return ["speculation.png"]
