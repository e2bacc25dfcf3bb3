"""Prepare: `infemeral-client prepare` in a subprocess against loading the same GGUF with transformers.

Both run as child processes so each one's peak memory is its own (wait4's rusage of that child). For a
random-weight model nothing is on disk to load, so the workbench's own in-process build and prepare
times are reported instead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness import fmt, log, ratio
from bench.instruments import dir_size, run_measured
from bench.sections import Result

NAME = "prepare"
TITLE = "Prepare"

LOAD_GGUF = """
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging
logging.disable_progress_bar()
from infemeral.cloak.sources import default_gguf_path
p = default_gguf_path()
AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
"""


@dataclass
class PrepareRow:
    what: str
    seconds: float
    peak_rss_mb: float


def run(wb) -> Result:
    out = wb.tmp / "prepare-section"
    if wb.model_kind == "default":
        from infemeral.cloak.sources import default_gguf_path

        exe = Path(sys.executable).parent / "infemeral-client"
        cmd = ([str(exe)] if exe.exists() else
               [sys.executable, "-c", "import sys; from infemeral.cli.main import main; sys.exit(main())"])
        log("baseline: loading the packaged GGUF with transformers in a subprocess")
        base = run_measured([sys.executable, "-c", LOAD_GGUF])
        log(f"  {base['seconds']:.1f} s, peak RSS {base['peak_rss_mb']:.0f} MB")
        log("infemeral-client prepare --output <tmp> --quiet (subprocess)")
        prep = run_measured(cmd + ["prepare", "--output", str(out), "--quiet"])
        log(f"  {prep['seconds']:.1f} s, peak RSS {prep['peak_rss_mb']:.0f} MB")
        gguf = default_gguf_path()
        rows = [PrepareRow("infemeral-client prepare --quiet", prep["seconds"], prep["peak_rss_mb"]),
                PrepareRow("baseline: load the same GGUF with transformers", base["seconds"], base["peak_rss_mb"])]
        method = f"Source: {gguf.name} (packaged GGUF); each in a subprocess, peak RSS from wait4() of that child."
        facts = {"gguf_mb": gguf.stat().st_size / 2**20, "client_bundle_mb": dir_size(out / "client") / 2**20,
                 "server_bundle_mb": dir_size(out / "server") / 2**20}
    else:
        rows = [PrepareRow("prepare (in-process)", wb.prepare_seconds, wb.peak_rss_mb),
                PrepareRow("baseline: building the random model", wb.build_seconds, float("nan"))]
        method = (f"Source: {wb.model_name}, built in memory; in-process, so peak RSS is the benchmark process's "
                  "(it includes the model itself).")
        facts = {"gguf_mb": float("nan"), "client_bundle_mb": dir_size(wb.client_dir) / 2**20,
                 "server_bundle_mb": dir_size(wb.server_dir) / 2**20}
    facts["time_ratio"] = ratio(rows[0].seconds, rows[1].seconds)
    facts["rss_ratio"] = ratio(rows[0].peak_rss_mb, rows[1].peak_rss_mb)
    return Result(NAME, method, rows, [], facts)


def report(r: Result) -> list[str]:
    f = r.facts
    lines = [r.method + "\n", "| | seconds | peak RSS MB |", "|---|---|---|"]
    lines += [f"| {row.what} | {fmt(row.seconds)} | {fmt(row.peak_rss_mb, '.0f')} |" for row in r.rows]
    lines += [f"| prepare / baseline | {fmt(f['time_ratio'], '.2f')}× | {fmt(f['rss_ratio'], '.2f')}× |", "",
              f"Input {fmt(f['gguf_mb'])} MB; output: client bundle {fmt(f['client_bundle_mb'])} MB, server bundle "
              f"{fmt(f['server_bundle_mb'])} MB.\n"]
    return lines
