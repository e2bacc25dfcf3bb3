"""Context: per-token decode latency at growing context lengths, split vs plain transformers, per dtype.

For each dtype (float32 and bfloat16 on a CPU) and each context length: plain prefill, half of the plain
decode steps, one split turn, the other half of the plain steps (continuing the same DynamicCache), so
that slow drift or a burst of other load hits both sides alike. Split latency is the interval between
successive decode-step sends (one whole token cycle: client, gRPC, server); plain latency is one
single-token forward + argmax. Each split step is also split into server layers / gRPC and server
overhead / client, from the wire log and the engine's layer timer.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.harness import at_least, fmt, log, median, ratio
from bench.sections import Result

NAME = "context"
TITLE = "Per-token decode latency vs context length"
TARGETS = {"float32": 0.9, "bfloat16": 0.8}  # split / plain decode throughput at every context length


@dataclass
class ContextRow:
    dtype: str
    context_tokens: int
    split_token_ms: float         # median interval between decode-step sends
    plain_token_ms: float         # median single-token forward + argmax
    server_layers_ms: float       # the engine's layer call
    transport_ms: float           # gRPC round trip minus the layer call: serialisation, network, hand-off
    client_ms: float              # token cycle minus the round trip: embedding, layer 0, LM head, sampling
    split_ttft_ms: float
    plain_prefill_ms: float

    @property
    def decode_ratio(self) -> float:
        """Split decode throughput / plain (> 1: split is faster)."""
        return ratio(self.plain_token_ms, self.split_token_ms)

    @property
    def prefill_ratio(self) -> float:
        return ratio(self.plain_prefill_ms, self.split_ttft_ms)


def dtypes(wb) -> list[str]:
    return wb.params.context_dtypes if wb.device == "cpu" else [wb.dtype_name]


def measure(wb, dtype: str, length: int) -> ContextRow:
    steps, split, plain = wb.params.context_steps, wb.split(dtype), wb.plain(dtype)
    text, ids = split.prompt_of_length(length)
    state = plain.prefill(ids)
    plain.steps(state, steps // 2)
    sp = split.turn(text, steps + 1)
    plain.steps(state, steps - steps // 2)
    token = median(sp.token_intervals) * 1000
    round_trip = median(sp.step_round_trips) * 1000
    layers = median(sp.server_layer_seconds) * 1000
    return ContextRow(dtype, len(ids), token, median(state["step_seconds"]) * 1000, layers, round_trip - layers,
                      token - round_trip, sp.time_to_first_token * 1000, state["prefill_seconds"] * 1000)


def run(wb) -> Result:
    rows, targets = [], []
    for dtype in dtypes(wb):
        for length in wb.params.contexts:
            row = measure(wb, dtype, length)
            rows.append(row)
            log(f"  {dtype} context {row.context_tokens:5d}: split {row.split_token_ms:6.1f} ms/token (layers "
                f"{row.server_layers_ms:5.1f}, transport {row.transport_ms:4.1f}, client {row.client_ms:5.1f}), plain "
                f"{row.plain_token_ms:6.1f} -> {row.decode_ratio:.2f}x")
        mine = [r for r in rows if r.dtype == dtype]
        worst = min(mine, key=lambda r: r.decode_ratio if r.decode_ratio == r.decode_ratio else -1.0)
        goal = TARGETS.get(dtype)
        if goal is not None:
            targets.append(at_least(
                NAME, f"{dtype}_decode_ratio", f"split decode >= {goal}x plain transformers in {dtype} at every "
                f"context {mine[0].context_tokens}..{mine[-1].context_tokens}", worst.decode_ratio, goal,
                f"min {worst.decode_ratio:.2f}x at {worst.context_tokens} tokens; "
                + ", ".join(f"{r.context_tokens}: {r.decode_ratio:.2f}" for r in mine)))
    method = ("Median per-token decode latency over the decode steps. Split: interval between successive "
              "decode-step sends (one whole token cycle); plain: one single-token forward + argmax with a "
              "DynamicCache, half of the steps before and half after the split turn. Prompts are a public-domain "
              f"passage repeated up to the length; {wb.params.context_steps} decode steps per length. The split "
              "client runs in float32 whatever the server's dtype.")
    return Result(NAME, method, rows, targets, {"dtypes": dtypes(wb)})


def report(r: Result) -> list[str]:
    lines = [r.method + "\n",
             "| dtype | context | split ms/token | plain ms/token | split / plain | server layers | gRPC + hand-off "
             "| client | split TTFT ms | plain prefill ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r.rows:
        lines.append(f"| {x.dtype} | {x.context_tokens} | {fmt(x.split_token_ms)} | {fmt(x.plain_token_ms)} | "
                     f"**{fmt(x.decode_ratio, '.2f')}** | {fmt(x.server_layers_ms)} | {fmt(x.transport_ms)} | "
                     f"{fmt(x.client_ms)} | {fmt(x.split_ttft_ms, '.0f')} | {fmt(x.plain_prefill_ms, '.0f')} |")
    return lines + [""]


def plot(r: Result, out) -> list[str]:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for dtype, color in zip(r.facts["dtypes"], ("tab:blue", "tab:orange", "tab:green")):
        rows = [x for x in r.rows if x.dtype == dtype]
        xs = [x.context_tokens for x in rows]
        axes[0].plot(xs, [x.split_token_ms for x in rows], "o-", color=color, label=f"split {dtype}")
        axes[0].plot(xs, [x.plain_token_ms for x in rows], "s--", color=color, label=f"plain {dtype}")
        axes[1].plot(xs, [x.decode_ratio for x in rows], "o-", color=color, label=dtype)
        if dtype in TARGETS:
            axes[1].axhline(TARGETS[dtype], color=color, ls=":", lw=1)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("ms per decoded token (median)")
    axes[1].set_ylabel("split / plain throughput (dotted: targets)")
    axes[1].axhline(1.0, color="black", lw=0.6)
    fig.tight_layout()
    fig.savefig(out / "context.png", dpi=110)
    plt.close(fig)
    return ["context.png"]
