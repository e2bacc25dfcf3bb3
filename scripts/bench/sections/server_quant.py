"""Quantised served layers: quality against float32, server-bundle bytes, resident weights, decode step.

Quality (default model): bundles prepared with each `--server-quant` mode (same model, each its own basis),
run in-process through the layers' real kernels in float32 activations: perplexity on held text, the first
1,024 tokens of each (infemeral/eval/data/kjv_genesis_37-40.txt; and the GPL-3 licence the first measurements used,
where the system has it at /usr/share/common-licenses/GPL-3; neither is calibrated on), and greedy agreement
with the float32 split (its greedy continuations of chat prompts, teacher-forced through each mode: top-1 over
every position, and the first divergence). The plain float32 model stands in for the float32 split, which matches it
token for token (docs/design.md §1). The baseline the issue measured — the plain model's own layers (norm gains
apart) round-to-nearest symmetric int4 in groups of 32 — is measured in the same run
(scripts/studies/server_quant.py).

Bytes and memory: each mode's server bundle on disk, and the weights the served layers hold once loaded for
bfloat16 activations (tensor bytes; the process's RSS above a no-weights baseline is reported beside them),
against bfloat16, at the default model and at a Llama-3-8B shape (random bf16 weights written to disk like
`prepare_big` does; `LAYERS_8B` layers of the real shape, scaled to its 31 served layers by the per-layer bytes).

Speed: one decode step (one token, cache of `CONTEXT` tokens) of the served layers on this CPU, each mode
against bfloat16 in the same run, interleaved.
"""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness import at_most, fmt, log, median, now, ratio
from bench.instruments import dir_size
from bench.sections import Result

NAME = "server_quant"
TITLE = "Quantised served layers: quality, bytes, resident weights, decode step"
MODES = {"int8": dict(server_quant="int8"), "int4": dict(server_quant="int4")}  # each with its defaults
EXTRA_INT4 = {"int4 g=32": dict(server_quant="int4", group_size=32),  # the default method at the finer groups
              "int4 hqq": dict(server_quant="int4", quant_method="hqq"),
              "int4 rtn": dict(server_quant="int4", quant_method="rtn")}
INT8_PPL, INT4_PPL, BASELINE_PPL = 1.01, 1.15, 1.24
INT4_BYTES, INT8_RESIDENT, INT4_RESIDENT = 0.3, 0.55, 0.3
CONTEXT = 128
LAYERS_8B = 5  # 1 client layer + 4 served: bytes and speed per served layer at the real width
SERVED_8B = 31

CHILD = """
import gc, json, sys, torch
from infemeral.cloak.bundle import DTYPES, ServerBundle
from infemeral.quant import served
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
bundle = ServerBundle.open(sys.argv[1], verify=False)
gc.collect(); before = rss()
stack = served.load_stack(bundle, DTYPES[sys.argv[2]])
gc.collect()
print(json.dumps({"rss_above_baseline": rss() - before, "weights": served.weight_bytes(stack),
                  "kernels": served.kernels_in_use(stack)}))
"""


@dataclass
class PerplexityRow:
    mode: str                 # float32 split, int8 per row, int4 g=N, baseline
    method: str
    text: str
    perplexity: float
    ratio: float              # to float32


@dataclass
class AgreementRow:
    mode: str
    method: str
    positions: int            # greedy positions compared
    top1: float
    first_divergence: int | None


@dataclass
class BytesRow:
    model: str                # default, 8b-shape
    mode: str                 # bfloat16, int8, int4
    bundle_mb: float          # the server bundle on disk (8B: scaled to every served layer)
    weights_mb: float         # tensors the loaded layers hold (8B: scaled likewise)
    rss_mb: float             # the loading process's RSS above its no-weights baseline (as measured, not scaled)
    kernels: str


@dataclass
class StepRow:
    model: str
    mode: str
    step_ms: float            # one decode step through the served layers measured
    ratio: float              # to bfloat16, same run


def run(wb) -> Result:
    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource

    work = wb.tmp / "server-quant"
    work.mkdir(exist_ok=True)
    modes = {**MODES, **({} if wb.quick else EXTRA_INT4)}
    bundles, seconds = {}, {}
    for mode, kwargs in {"bfloat16": {}, **modes}.items():
        log(f"preparing the default model's bundles: {mode}")
        t = now()
        bundles[mode] = prepare(output=work / mode.replace(" ", "-"), source=ModelSource(wb.reference, wb.tokenizer),
                                progress=False, dtype="bfloat16" if mode == "bfloat16" else "float32", **kwargs)
        seconds[mode] = now() - t
    quality = _quality(wb, bundles, list(modes))
    sizes = _bytes("default", {m: b.server_dir for m, b in bundles.items() if m in ("bfloat16", *MODES)})
    steps = _steps("default", {m: b.server_dir for m, b in bundles.items() if m in ("bfloat16", *MODES)},
                   reps=5 if wb.quick else 20)
    shutil.rmtree(work, ignore_errors=True)
    if not wb.quick:
        big_sizes, big_steps = _8b_shape(wb)
        sizes += big_sizes
        steps += big_steps
    facts = {"prepare_seconds": seconds}
    targets = _targets(quality, sizes)
    method = __doc__.split("\n\n", 1)[1].replace("\n", " ")
    return Result(NAME, method, quality + sizes + steps, targets, facts)


# -- quality ----------------------------------------------------------------------------------------------
def _quality(wb, bundles, modes) -> list:
    from infemeral.eval.metrics import agreement, chat_ids, greedy_sequences, perplexity
    from infemeral.eval.server_quant import AGREEMENT_PROMPTS, TEXT_TOKENS
    from infemeral.eval.systems import BundleSplit, PlainReference
    from studies import server_quant as study

    tokenizer = wb.tokenizer
    texts = {name: tokenizer(path.read_text(), add_special_tokens=False)["input_ids"][:TEXT_TOKENS]
             for name, path in study.held_texts().items()}
    reference = PlainReference(wb.reference)
    base = {name: perplexity(reference, ids) for name, ids in texts.items()}
    prompts = [chat_ids(tokenizer, p) for p in AGREEMENT_PROMPTS]
    positions = 128 if wb.quick else 512
    log(f"  float32 reference: perplexity {', '.join(f'{v:.3f} ({k})' for k, v in base.items())}; "
        f"{positions} greedy positions")
    sequences = greedy_sequences(reference, prompts, positions, {tokenizer.eos_token_id} - {None})
    rows = []
    for mode in ["float32 split", *modes]:
        if mode == "float32 split":
            system, label, method = BundleSplit(wb.client_dir, wb.server_dir), mode, "–"
        else:
            system = BundleSplit(bundles[mode].client_dir, bundles[mode].server_dir)
            q = system.quant
            label, method = study.Mode.of(q).label, q.method
        for name, ids in texts.items():
            ppl = perplexity(system, ids)
            rows.append(PerplexityRow(label, method, name, ppl, ppl / base[name]))
            log(f"  {label:12s} {method:5s} {name}: perplexity {ppl:.3f} ({ppl / base[name]:.3f}x)")
        a = agreement(system, sequences)
        rows.append(AgreementRow(label, method, a.positions, a.top1_rate, a.first_divergence))
        log(f"  {label:12s} {method:5s}: {a.describe()}")
        del system
        gc.collect()
    ref = study.Reference.from_transformers(wb.reference, tokenizer)
    split = study.FloatSplit(ref, "plain", study.quantize_row(ref, "plain", study.Mode("int4", "rtn-sym", 32)))
    for name, ids in texts.items():
        ppl = perplexity(split, ids)
        rows.append(PerplexityRow("baseline: plain model int4 g=32", "rtn-sym", name, ppl, ppl / base[name]))
        log(f"  baseline (the plain model's layers, gains apart, int4 g=32 round-to-nearest symmetric) {name}: "
            f"{ppl / base[name]:.3f}x")
    return rows


# -- bytes and resident weights -------------------------------------------------------------------------
def _resident(server_dir: Path, dtype: str = "bfloat16") -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(server_dir), dtype], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"loading {server_dir} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _bytes(model: str, server_dirs: dict[str, Path], scale: float = 1.0) -> list[BytesRow]:
    rows = []
    for mode, directory in server_dirs.items():
        r = _resident(directory)
        layer_files = dir_size(directory, ".safetensors")
        rows.append(BytesRow(model, mode, layer_files * scale / 2**20, r["weights"] * scale / 2**20,
                             r["rss_above_baseline"] / 2**20,
                             ", ".join(f"{k} {v}" for k, v in r["kernels"].items())))
        log(f"  {model} {mode:8s}: bundle {rows[-1].bundle_mb:8.1f} MB, weights {rows[-1].weights_mb:8.1f} MB, "
            f"RSS +{rows[-1].rss_mb:.0f} MB ({rows[-1].kernels})")
    return rows


# -- decode step --------------------------------------------------------------------------------------------
def _steps(model: str, server_dirs: dict[str, Path], reps: int) -> list[StepRow]:
    import torch

    from infemeral.cloak.bundle import ServerBundle
    from infemeral.quant import served

    stacks, caches = {}, {}
    g = torch.Generator().manual_seed(0)
    for mode, directory in server_dirs.items():
        bundle = ServerBundle.open(directory, verify=False)
        stacks[mode] = served.load_stack(bundle, torch.bfloat16)
        caches[mode] = stacks[mode].new_cache(CONTEXT + reps + 8)
        d = bundle.config.hidden_size
        stacks[mode](torch.randn(CONTEXT, d, generator=g), caches[mode])
    x = torch.randn(1, d, generator=g)
    samples = {mode: [] for mode in stacks}
    order = list(stacks)
    for rep in range(reps + 2):  # the first two rounds warm up
        for mode in order[rep % len(order):] + order[:rep % len(order)]:
            t = now()
            stacks[mode](x, caches[mode])
            if rep >= 2:
                samples[mode].append(now() - t)
            caches[mode].truncate(1)
    base = median(samples["bfloat16"])
    rows = [StepRow(model, mode, median(s) * 1000, ratio(median(s), base)) for mode, s in samples.items()]
    for r in rows:
        log(f"  {model} {r.mode:8s}: decode step {r.step_ms:7.2f} ms ({r.ratio:.2f}x bfloat16)")
    return rows


def _8b_shape(wb) -> tuple[list[BytesRow], list[StepRow]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # scripts/, for random_checkpoint
    import random_checkpoint

    from infemeral.cloak.prepare import prepare

    ckpt, out = wb.tmp / "8b-shape", wb.tmp / "8b-bundles"
    log(f"writing a random Llama-3-8B-shaped checkpoint with {LAYERS_8B} layers (bf16)")
    try:
        random_checkpoint.write_checkpoint(ckpt, "llama-3-8b", "bfloat16", progress=False, num_layers=LAYERS_8B,
                                           tokenizer_from=wb.client_dir / "tokenizer")
        dirs = {}
        for mode, kwargs in {"bfloat16": {}, "int8": dict(server_quant="int8", quant_method="rtn"),
                             "int4": dict(server_quant="int4", quant_method="rtn")}.items():
            t = now()
            prepare(ckpt, out / mode, dtype="bfloat16", progress=False, **kwargs)
            shutil.rmtree(out / mode / "client")  # the tables are the client's: not measured here
            dirs[mode] = out / mode / "server"
            log(f"  prepared {mode} in {now() - t:.0f} s")
        sizes = _bytes("8b-shape", dirs, scale=SERVED_8B / (LAYERS_8B - 1))
        steps = _steps("8b-shape", dirs, reps=10)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    return sizes, steps


# -- targets and report ------------------------------------------------------------------------------------
def _targets(quality: list, sizes: list[BytesRow]) -> list:
    targets = []
    for text in dict.fromkeys(r.text for r in quality if isinstance(r, PerplexityRow)):
        rows = [r for r in quality if isinstance(r, PerplexityRow) and r.text == text]
        tag = "gpl3" if text == "GPL-3" else "kjv"
        int8 = next(r for r in rows if r.mode.startswith("int8"))
        best = min((r for r in rows if r.mode.startswith("int4")), key=lambda r: r.ratio)
        baseline = next(r for r in rows if r.mode.startswith("baseline"))
        targets += [
            at_most(NAME, f"int8_perplexity_{tag}", f"{text}: int8 perplexity ≤ {INT8_PPL}× float32", int8.ratio,
                    INT8_PPL, f"{int8.ratio:.4f}x, {int8.method}"),
            at_most(NAME, f"int4_perplexity_{tag}", f"{text}: best int4 perplexity ≤ {INT4_PPL}× float32", best.ratio,
                    INT4_PPL, f"{best.ratio:.3f}x, {best.method} {best.mode}",
                    "" if best.ratio <= INT4_PPL else "what each method reaches on each text: docs/server_quant.md"),
            at_most(NAME, f"int4_beats_baseline_{tag}", f"{text}: best int4 better than the plain model's own layers "
                    f"round-to-nearest int4 g=32 (the first measurement: {BASELINE_PPL}x on GPL-3)", best.ratio,
                    baseline.ratio, f"{best.ratio:.3f}x against {baseline.ratio:.3f}x in this run"),
        ]
    for model in dict.fromkeys(r.model for r in sizes):
        rows = {r.mode: r for r in sizes if r.model == model}
        bf16 = rows["bfloat16"]
        b4 = ratio(rows["int4"].bundle_mb, bf16.bundle_mb)
        r8, r4 = ratio(rows["int8"].weights_mb, bf16.weights_mb), ratio(rows["int4"].weights_mb, bf16.weights_mb)
        tag = "8b" if model == "8b-shape" else "default"
        targets += [
            at_most(NAME, f"{tag}_int4_bundle", f"{model}: int4 server bundle ≤ {INT4_BYTES}× bf16", b4, INT4_BYTES,
                    f"{b4:.3f}x"),
            at_most(NAME, f"{tag}_int8_resident", f"{model}: int8 resident weights ≤ {INT8_RESIDENT}× bf16", r8,
                    INT8_RESIDENT, f"{r8:.3f}x"),
            at_most(NAME, f"{tag}_int4_resident", f"{model}: int4 resident weights ≤ {INT4_RESIDENT}× bf16", r4,
                    INT4_RESIDENT, f"{r4:.3f}x"),
        ]
    return targets


def report(r: Result) -> list[str]:
    ppl = [x for x in r.rows if isinstance(x, PerplexityRow)]
    agreement = {(x.mode, x.method): x for x in r.rows if isinstance(x, AgreementRow)}
    sizes = [x for x in r.rows if isinstance(x, BytesRow)]
    steps = {(x.model, x.mode): x for x in r.rows if isinstance(x, StepRow)}
    texts = list(dict.fromkeys(x.text for x in ppl))
    lines = [r.method + "\n", "| served layers | method | " + " | ".join(f"perplexity, {t} (× float32)" for t in texts)
             + " | greedy positions | top-1 agreement | first divergence |",
             "|---|---|" + "---:|" * len(texts) + "---:|---:|---:|"]
    for mode, method in dict.fromkeys((x.mode, x.method) for x in ppl):
        cells = {x.text: x for x in ppl if x.mode == mode and x.method == method}
        a = agreement.get((mode, method))
        first = "–" if a is None else ("none" if a.first_divergence is None else str(a.first_divergence))
        lines.append(f"| {mode} | {method} | " + " | ".join(
            f"{cells[t].perplexity:.3f} ({cells[t].ratio:.3f})" if t in cells else "–" for t in texts)
            + f" | {a.positions if a else '–'} | {fmt(a.top1 * 100, '.1f') + '%' if a else '–'} | {first} |")
    lines += ["", "| model | mode | server bundle MB | resident weights MB | × bf16 | RSS above baseline MB | "
              "decode step ms | step × bf16 | kernels |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for x in sizes:
        base = next(y for y in sizes if y.model == x.model and y.mode == "bfloat16")
        step = steps.get((x.model, x.mode))
        lines.append(f"| {x.model} | {x.mode} | {fmt(x.bundle_mb)} | {fmt(x.weights_mb)} | "
                     f"{fmt(ratio(x.weights_mb, base.weights_mb), '.3f')} | {fmt(x.rss_mb, '.0f')} | "
                     f"{fmt(step and step.step_ms, '.2f')} | {fmt(step and step.ratio, '.2f')} | {x.kernels} |")
    return lines + [""]
