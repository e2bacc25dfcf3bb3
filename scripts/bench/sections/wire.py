"""Wire: serialized bytes per decode step and per prompt token, seen by a client interceptor.

Only the new token's hidden state may travel, never the history: a decode step must cost
<= 2 x hidden x bytes-per-element + 512 bytes both ways at any context length.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import at_most, fmt, log
from bench.instruments import wire_of
from bench.sections import Result
from bench.systems import ITEMSIZE

NAME = "wire"
TITLE = "Bytes on the wire"
SLACK = 512
TOKENS = 12


@dataclass
class WireRow:
    context_tokens: int
    decode_request_bytes: int   # largest decode-step request of the turn
    decode_response_bytes: int
    prefill_bytes_per_token: float
    decode_steps: int


def run(wb) -> Result:
    split = wb.split()
    rows = []
    for length in sorted({wb.params.contexts[0], min(1024, wb.params.contexts[-1])}):
        text, _ = split.prompt_of_length(length)
        turn = split.turn(text, TOKENS)
        w = wire_of(turn.turn, turn.generated_tokens)
        rows.append(WireRow(turn.cache_length - turn.generated_tokens + 1, max(w["decode_request_sizes"]),
                            max(w["decode_response_sizes"]), w["prefill_request_bytes"] / max(1, w["prefill_rows"]),
                            len(w["decode_request_sizes"])))
    bpe = ITEMSIZE[split.info.dtype]
    hidden = split.info.hidden_size
    goal = 2 * hidden * bpe + SLACK
    worst = max(r.decode_request_bytes + r.decode_response_bytes for r in rows)
    for r in rows:
        log(f"  context {r.context_tokens}: decode step {r.decode_request_bytes} + {r.decode_response_bytes} B, "
            f"prefill {r.prefill_bytes_per_token:.0f} B per token")
    target = at_most(NAME, "bytes_per_step", f"bytes per decode step <= 2 x hidden x bytes-per-element + {SLACK} "
                     f"(= {goal} B)", worst, goal, f"max {worst} B, limit {goal} B")
    method = (f"Serialized `TurnRequest`/`TurnResponse` sizes seen by a client interceptor over one {TOKENS}-token "
              f"turn per context length. Hidden size {hidden}, wire dtype {split.info.dtype} ({bpe} B/element); the "
              f"raw payload of a decode step is {2 * hidden * bpe} B both ways. gRPC adds a 5-byte length prefix "
              "and HTTP/2 a 9-byte frame header per message (not counted).")
    return Result(NAME, method, rows, [target], {"payload_bytes_per_step": 2 * hidden * bpe, "limit": goal})


def report(r: Result) -> list[str]:
    lines = [r.method + "\n", "| context | decode request B | decode response B | prefill B per token |",
             "|---|---|---|---|"]
    lines += [f"| {x.context_tokens} | {x.decode_request_bytes} | {x.decode_response_bytes} | "
              f"{fmt(x.prefill_bytes_per_token, '.0f')} |" for x in r.rows]
    return lines + [""]
