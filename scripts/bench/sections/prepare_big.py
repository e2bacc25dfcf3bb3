"""Prepare a big model: `infemeral-client prepare` on a sharded safetensors checkpoint of a real 3B shape.

The checkpoint (Llama-3.2-3B shape: hidden 3,072, 28 layers, 24/8 heads, MLP 8,192, vocabulary 128,256,
tied; random bf16 weights, ~6 GB in 2 GB shards) is written shard by shard by scripts/random_checkpoint.py,
so nothing is downloaded. `prepare` runs in a child process; its peak RSS (wait4) is compared with a child
that does everything but the weights (imports, config, tokenizer) and with the sizes of the parts prepare
must hold at once: one layer, the embedding (tied head), and the basis Q (float64 + float32). A quick run
uses a small shape (~0.45 GB) to check the code path.

Then the time each quantization method adds, at the Llama-3-8B shape (hidden 4,096, MLP 14,336, untied head):
a random checkpoint of its first two layers (layer 0 stays on the client, so one layer is served) is
prepared once per method in a child process that times each served layer from reading it to having
written it (calibration passes and the agreement check included). Prepare at 32 layers is estimated as
the measured run plus 30 more served layers at that time; the per-layer work is what grows with depth.
A quick run cuts SmolLM2-135M's shape instead, to check the code path.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness import at_most, fmt, log, now
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

# the child that runs timed_prepare: argv = scripts/, timings file, checkpoint, output, scheme, method
TIMED_PREPARE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bench.sections.prepare_big import timed_prepare
json.dump(timed_prepare(*sys.argv[3:7]), open(sys.argv[2], "w"))
"""
# (scheme, method), each named explicitly; DEFAULTS: what prepare picks for a scheme without --quant-method
METHODS = (("none", "none"), ("int8", "rtn"), ("int8", "gptq"), ("int4", "rtn"), ("int4", "hqq"), ("int4", "gptq"))
DEFAULTS = {("int8", "rtn"), ("int4", "gptq")}
FULL_DEPTH = 32  # Llama-3-8B's decoder layers


@dataclass
class MethodRow:
    what: str
    seconds: float           # the whole prepare of the cut checkpoint, in its child process
    layer_seconds: float     # one served layer, read to written
    full_seconds: float      # estimated for all FULL_DEPTH layers
    peak_rss_mb: float


def timed_prepare(checkpoint: str, out: str, scheme: str, method: str) -> list[float]:
    """Prepare bf16 bundles with a clock on each served layer: seconds from the call that reads it (layer_tensors)
    to the end of the save_file that writes it (the served layers' files are the first ones prepare writes)."""
    import infemeral.cloak.prepare as P

    reads, writes = {}, []
    read_layer, save = P.layer_tensors, P.save_file

    def timed_read(source, index):
        reads[index] = now()
        return read_layer(source, index)

    def timed_save(*args, **kwargs):
        save(*args, **kwargs)
        writes.append(now())

    P.layer_tensors, P.save_file = timed_read, timed_save
    try:
        bundles = P.prepare(checkpoint, out, dtype="bfloat16", progress=False, server_quant=scheme,
                            quant_method=None if method == "none" else method)
    finally:
        P.layer_tensors, P.save_file = read_layer, save
    first = json.loads((bundles.server_dir / "manifest.json").read_text())["first_layer"]
    return [writes[k] - reads[i] for k, i in enumerate(sorted(i for i in reads if i >= first))]


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
    facts["methods_shape"], facts["methods_layers"], method_rows = method_times(wb, random_checkpoint)
    facts["method_rows"] = [vars(row) for row in method_rows]
    return Result(NAME, method, rows, targets, facts)


def method_times(wb, random_checkpoint) -> tuple[str, int, list[MethodRow]]:
    """Prepare a two-layer cut of the 8B shape once per quantization method; each served layer timed."""
    shape, layers = ("smollm2-135m" if wb.quick else "llama-3-8b"), 2  # vocabularies the tokenizer fits
    ckpt, timings = wb.tmp / "methods-checkpoint", wb.tmp / "layer-seconds.json"
    log(f"writing a random {shape} checkpoint cut to {layers} layers (bf16)")
    rows = []
    try:
        random_checkpoint.write_checkpoint(ckpt, shape, "bfloat16", progress=False, num_layers=layers,
                                           tokenizer_from=wb.client_dir / "tokenizer")
        for scheme, method in METHODS:
            if method == "hqq" and importlib.util.find_spec("hqq") is None:
                log("  int4 hqq skipped: the hqq package is not installed (pip install 'infemeral[quant]')")
                continue
            out = wb.tmp / f"methods-{scheme}-{method}"
            measured = run_measured([sys.executable, "-c", TIMED_PREPARE, str(Path(__file__).parents[2]),
                                     str(timings), str(ckpt), str(out), scheme, method])
            shutil.rmtree(out, ignore_errors=True)
            per_layer = json.loads(timings.read_text())
            layer = sum(per_layer) / len(per_layer)
            what = ("--server-quant none" if scheme == "none" else
                    f"--server-quant {scheme} --quant-method {method}"
                    + (" (the default)" if (scheme, method) in DEFAULTS else ""))
            full = measured["seconds"] + layer * (FULL_DEPTH - layers)
            rows.append(MethodRow(what, measured["seconds"], layer, full, measured["peak_rss_mb"]))
            log(f"  {what}: {measured['seconds']:.0f} s, a served layer {layer:.1f} s, ~{full / 60:.0f} min at "
                f"{FULL_DEPTH} layers; peak RSS {measured['peak_rss_mb']:.0f} MB")
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return shape, layers, rows


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
    n = f["methods_layers"]
    lines += [f"Prepare's time by quantization method, {f['methods_shape']} shape (bf16 bundles): measured on {n} "
              f"layers ({n - 1} served), and estimated at {FULL_DEPTH} layers as the measured run plus "
              f"{FULL_DEPTH - n} more served layers at the measured per-layer time.\n",
              f"| | measured s ({n} layers) | one served layer s | estimate at {FULL_DEPTH} layers, min | "
              "peak RSS MB |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {row['what']} | {fmt(row['seconds'], '.0f')} | {fmt(row['layer_seconds'])} | "
              f"{fmt(row['full_seconds'] / 60, '.0f')} | {fmt(row['peak_rss_mb'], '.0f')} |"
              for row in f["method_rows"]]
    return lines + [""]
