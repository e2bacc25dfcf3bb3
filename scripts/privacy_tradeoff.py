"""The client_layers trade-off, measured with the audit: what each observer recovers, and what it costs the client.

    PYTHONPATH=. python scripts/privacy_tradeoff.py                  # prepares the default model 3 times
    PYTHONPATH=. python scripts/privacy_tradeoff.py --bundles /tmp/b  # reuse /tmp/b/cl1, cl2, cl4 if there

For 1, 2 and 4 client layers on the packaged default model: norm matching, Gram
linking, vocabulary matching (simulated public-weights operator) and K/V inversion on
the audit's built-in sample, the audit's wall time on a 60-token prompt, and the
client's cost per decode token (embedding, local layers, rotation, un-rotation,
final norm, LM head; the server's share excluded). Prints a markdown table for
docs/privacy_audit.md and a TARGET line for the audit's time budget.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from infemeral.audit import DEFAULT_PROMPT, audit
from infemeral.audit.observed import render
from infemeral.client_half.half import ClientModel
from infemeral.cloak.bundle import ClientBundle
from infemeral.cloak.prepare import prepare

BUDGET_PROMPT = "Maria Lopez, SSN 078-05-1120, has HIV; password Tr0ub4dor&3."  # 60 tokens with the chat template
BUDGET_SECONDS = 120.0
DECODE_STEPS = 64
REPEATS = 5


@dataclass
class Row:
    client_layers: int
    norms: float
    norms_raw: float
    auc_within: float
    auc_across: float
    vocabulary: float
    kv: float
    full_scans: int
    audit_seconds: float
    budget_tokens: int
    budget_seconds: float
    ms_per_token: float
    params_per_token: int  # weights the client reads per decode token (local layers + LM head)


def bundles_for(root: Path, layers: int) -> Path:
    client = root / f"cl{layers}" / "client"
    if not (client / "manifest.json").exists():
        prepare(None, root / f"cl{layers}", client_layers=layers, progress=False)
    return client


def client_cost(client_dir: Path) -> tuple[float, int]:
    """Wall time of one decode token's client work after the sample prompt (the fastest of REPEATS runs
    of DECODE_STEPS tokens: other load on the machine only ever adds), and the number of weights that
    work reads."""
    bundle = ClientBundle.open(client_dir)
    model, tokenizer = ClientModel(bundle), bundle.tokenizer()
    ids = render(tokenizer, [{"role": "user", "content": DEFAULT_PROMPT}])
    runs = []
    for _ in range(REPEATS):
        cache = model.new_cache()
        residual = model.cloak(ids, cache)[-1:]  # stands in for the server's answer: same shape, same work
        times = []
        for step in range(DECODE_STEPS):
            started = time.perf_counter()
            hidden = model.cloak([ids[step % len(ids)]], cache)
            model.logits(residual)
            times.append(time.perf_counter() - started)
            residual = hidden
        runs.append(min(times))
    params = sum(p.numel() for p in model.layers.parameters()) + sum(t.numel() for t in model.head.tensors())
    return 1000 * min(runs), params


def measure(root: Path, layers: int) -> Row:
    client = bundles_for(root, layers)
    report = audit(None, client)
    started = time.perf_counter()
    budget = audit(BUDGET_PROMPT, client)
    budget_seconds = time.perf_counter() - started
    m = report.metric
    return Row(layers, m("norms", "user_rate"), m("norms_raw", "user_rate"), m("gram", "auc_within"),
               m("gram", "auc_across"), m("vocabulary", "user_rate"), m("kv", "user_rate"),
               m("vocabulary", "full_scans") + m("kv", "full_scans"), report.seconds, budget.prompt_tokens,
               budget_seconds, *client_cost(client))


def table(rows: list[Row]) -> str:
    base = rows[0].ms_per_token
    lines = ["| client layers | norm matching | Gram AUC (within / across) | vocabulary matching | K/V inversion "
             "| audit time (sample / 60 tokens) | client weights read per token | client ms per token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r.client_layers} | {100 * r.norms:.0f} % (raw embeddings: {100 * r.norms_raw:.0f} %) "
                     f"| {r.auc_within:.3f} / {r.auc_across:.3f} | {100 * r.vocabulary:.0f} % | {100 * r.kv:.0f} % "
                     f"| {r.audit_seconds:.0f} s / {r.budget_seconds:.0f} s | {r.params_per_token / 1e6:.1f} M "
                     f"| {r.ms_per_token:.1f} ({r.ms_per_token / base:.2f}x) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundles", type=Path, help="where to keep the prepared bundles (default: a temp dir)")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cost-only", action="store_true", help="only the client's cost per token")
    args = parser.parse_args()
    root = args.bundles or Path(tempfile.mkdtemp(prefix="infemeral-tradeoff-"))
    client_cost(bundles_for(root, args.layers[0]))  # warm-up: the first timings in a process run slow
    if args.cost_only:
        for layers in args.layers:
            ms, params = client_cost(bundles_for(root, layers))
            print(f"client_layers={layers}: {ms:.2f} ms per token, {params / 1e6:.1f} M weights read", flush=True)
        return
    rows = []
    for layers in args.layers:
        rows.append(measure(root, layers))
        print(f"client_layers={layers}: {rows[-1]}", flush=True)
    print()
    print(table(rows))
    print()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for r in rows:
        if r.client_layers == 1:
            verdict = "PASS" if r.budget_seconds < BUDGET_SECONDS else "MISS"
            print(f"TARGET audit budget_{r.budget_tokens}_tokens_under_{BUDGET_SECONDS:.0f}s: {verdict} "
                  f"({r.budget_seconds:.1f} s)")


if __name__ == "__main__":
    main()
