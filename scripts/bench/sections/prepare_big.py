"""Prepare a big model: `infemeral-client prepare` on a sharded safetensors checkpoint of a real 3B shape.

The checkpoint (Llama-3.2-3B shape: hidden 3,072, 28 layers, 24/8 heads, MLP 8,192, vocabulary 128,256,
tied; random bf16 weights, ~6 GB in 2 GB shards) is written shard by shard by scripts/random_checkpoint.py,
so nothing is downloaded. `prepare` runs in a child process; its peak RSS (wait4) is compared with a child
that does everything but the weights (imports, config, tokenizer) and with the sizes of the parts prepare
must hold at once: one layer, the embedding (tied head), and the basis Q (float64 + float32). A quick run
uses a small shape (~0.45 GB) to check the code path.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness import at_most, fmt, log
from bench.instruments import dir_size, run_measured
from bench.sections import Result

NAME = "prepare_big"
TITLE = "Preparing a big model: time and peak memory against its parts"
PEAK_TARGET = 0.4  # peak RSS above the no-weights baseline <= 0.4 x the whole checkpoint

BASELINE = """
import sys
import infemeral.cli.main, infemeral.cloak.prepare
from infemeral.cloak.sources import open_source
source = open_source(sys.argv[1])
source.tokenizer(); source.generation_config()
"""


@dataclass
class PrepareBigRow:
    what: str
    seconds: float
    peak_rss_mb: float


def run(wb) -> Result:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # scripts/, for random_checkpoint
    import random_checkpoint

    shape = "small-llama" if wb.quick else "llama-3.2-3b"
    ckpt, out = wb.tmp / "big-checkpoint", wb.tmp / "big-bundles"
    log(f"writing a random {shape} checkpoint (bf16, sharded)")
    try:
        sizes = random_checkpoint.write_checkpoint(ckpt, shape, "bfloat16", shard_mb=2048 if not wb.quick else 128,
                                                   progress=False, tokenizer_from=wb.client_dir / "tokenizer")
        exe = [sys.executable, "-m", "infemeral.cli"]
        base = run_measured([sys.executable, "-c", BASELINE, str(ckpt)])
        log(f"  baseline (no weights): {base['seconds']:.0f} s, peak RSS {base['peak_rss_mb']:.0f} MB")
        prep = run_measured(exe + ["prepare", str(ckpt), "--output", str(out), "--dtype", "bfloat16", "--quiet"])
        log(f"  prepare: {prep['seconds']:.0f} s, peak RSS {prep['peak_rss_mb']:.0f} MB")
        client_mb, server_mb = dir_size(out / "client") / 2**20, dir_size(out / "server") / 2**20
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    mb = 2**20
    above = prep["peak_rss_mb"] - base["peak_rss_mb"]
    facts = {"shape": shape, "model_mb": sizes.model / mb, "layer_mb": sizes.largest_layer / mb,
             "tables_mb": sizes.tables / mb, "basis_mb": sizes.basis / mb, "above_baseline_mb": above,
             "client_bundle_mb": client_mb, "server_bundle_mb": server_mb,
             "above_over_model": above / (sizes.model / mb)}
    rows = [PrepareBigRow("infemeral-client prepare --dtype bfloat16", prep["seconds"], prep["peak_rss_mb"]),
            PrepareBigRow("baseline: imports, config and tokenizer only", base["seconds"], base["peak_rss_mb"])]
    targets = [at_most(NAME, "peak_rss", f"peak RSS above the no-weights baseline ≤ {PEAK_TARGET}× the checkpoint",
                       facts["above_over_model"], PEAK_TARGET,
                       f"{above:.0f} MB = {facts['above_over_model']:.2f}x of {sizes.model / mb:.0f} MB")]
    method = (f"Random-weight {shape} checkpoint in bf16 safetensors shards (scripts/random_checkpoint.py), "
              "prepared to bf16 bundles by `infemeral-client prepare` in a child process; peak RSS from wait4().")
    return Result(NAME, method, rows, targets, facts)


def report(r: Result) -> list[str]:
    f = r.facts
    lines = [r.method + "\n", "| | seconds | peak RSS MB |", "|---|---:|---:|"]
    lines += [f"| {row.what} | {fmt(row.seconds, '.0f')} | {fmt(row.peak_rss_mb, '.0f')} |" for row in r.rows]
    lines += ["", "| part | MB |", "|---|---:|", f"| whole checkpoint | {fmt(f['model_mb'], '.0f')} |",
              f"| one layer | {fmt(f['layer_mb'], '.0f')} |", f"| embedding / head | {fmt(f['tables_mb'], '.0f')} |",
              f"| basis Q (float64 + float32) | {fmt(f['basis_mb'], '.0f')} |",
              f"| **prepare's peak above the baseline** | **{fmt(f['above_baseline_mb'], '.0f')}** |", "",
              f"Bundles written: client {fmt(f['client_bundle_mb'], '.0f')} MB, server "
              f"{fmt(f['server_bundle_mb'], '.0f')} MB.\n"]
    return lines
