"""Decode: tokens/s and time to first token of one whole answer, split over localhost gRPC vs plain `generate`.

Greedy, exactly `decode_tokens` new tokens on both sides (plain: `generate(min_new_tokens=max_new_tokens)`;
split: `Session.chat` with end-of-sequence ignored), alternating runs after a warm-up, medians reported.
In float32 the split system must produce plain's tokens exactly (docs/design.md §1).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import at_least, fmt, interleave, log, median, ratio
from bench.sections import Result

NAME = "decode"
TITLE = "Decode throughput and time to first token"
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class DecodeRow:
    system: str               # "split" or "plain"
    tokens_per_second: float  # (tokens - 1) / first-to-last-token time
    time_to_first_token_ms: float
    wall_seconds: float
    open_ms: float = float("nan")    # split only: opening the turn (before the prompt)
    commit_ms: float = float("nan")  # split only: committing (after the last token)


def run(wb) -> Result:
    n, split, plain = wb.params.decode_tokens, wb.split(), wb.plain()
    ids = split.template(PROMPT)
    plains, splits = interleave(wb.params.decode_reps, lambda: plain.generate(ids, n), lambda: split.turn(PROMPT, n))
    rows = [DecodeRow("plain", p.tokens_per_second, p.time_to_first_token * 1000, p.wall_seconds) for p in plains]
    rows += [DecodeRow("split", s.tokens_per_second, s.time_to_first_token * 1000, s.wall_seconds,
                       s.open_seconds * 1000, s.commit_seconds * 1000) for s in splits]
    for row in rows:
        log(f"  {row.system:5s}: {row.tokens_per_second:6.1f} tok/s, TTFT {row.time_to_first_token_ms:6.1f} ms")
    a, b = splits[0].token_ids, plains[0].token_ids
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def med(system, attr):
        return median([getattr(r, attr) for r in rows if r.system == system])

    facts = {"prompt_tokens": len(ids), "new_tokens": n, "reps": wb.params.decode_reps, "dtype": split.dtype_name,
             "greedy_tokens_identical": same,
             "tps_ratio": ratio(med("split", "tokens_per_second"), med("plain", "tokens_per_second")),
             "ttft_ratio": ratio(med("split", "time_to_first_token_ms"), med("plain", "time_to_first_token_ms"))}
    log(f"  split/plain decode tokens/s = {facts['tps_ratio']:.2f}; greedy tokens identical for {same} of {n}")
    targets = []
    if split.dtype_name == "float32":
        targets.append(at_least(NAME, "greedy_identical", "float32 split greedy tokens identical to plain `generate`",
                                same, n, f"{same} of {n} tokens"))
    method = (f"Greedy, {len(ids)}-token chat prompt, exactly {n} new tokens on both sides in {split.dtype_name} "
              "(plain: `generate(min_new_tokens=max_new_tokens)`; split: `Session.chat` with end-of-sequence "
              f"ignored), medians of {wb.params.decode_reps} alternating runs after a warm-up. Tokens/s = "
              "(tokens − 1) / time from first to last token.")
    return Result(NAME, method, rows, targets, facts)


def report(r: Result) -> list[str]:
    f = r.facts

    def med(system, attr):
        return median([getattr(x, attr) for x in r.rows if x.system == system])

    return [r.method + "\n", "| | split (gRPC) | plain `generate` | split / plain |", "|---|---|---|---|",
            f"| decode tokens/s | {fmt(med('split', 'tokens_per_second'))} | {fmt(med('plain', 'tokens_per_second'))} "
            f"| {fmt(f['tps_ratio'], '.2f')} |",
            f"| time to first token (ms) | {fmt(med('split', 'time_to_first_token_ms'))} | "
            f"{fmt(med('plain', 'time_to_first_token_ms'))} | {fmt(f['ttft_ratio'], '.2f')} |",
            f"| open turn (ms, not in TTFT) | {fmt(med('split', 'open_ms'))} | – | |",
            f"| commit (ms, after the last token) | {fmt(med('split', 'commit_ms'))} | – | |", "",
            f"Greedy tokens identical to plain `generate`: {f['greedy_tokens_identical']} of {f['new_tokens']}.\n"]
