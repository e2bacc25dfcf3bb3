"""The command line of the benchmarks (`scripts/bench.py` runs `main`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import bench  # noqa: E402
from bench import report  # noqa: E402
from bench.harness import CpuSnapshot, MachineLoad, log, now, T0  # noqa: E402
from bench.sections import ORDER, load  # noqa: E402
from bench.systems import FULL, QUICK, RANDOM_SHAPES, ROOT, Workbench, machine_info  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "benchmarks"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench.py", description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fast smoke run (fewer lengths, tokens, repeats)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the server's layers and the plain baseline run (the client is always CPU)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="server and baseline dtype of the sections that use one (default: float32 on cpu, "
                             "bfloat16 on cuda); the context section measures float32 and bfloat16 on a CPU")
    parser.add_argument("--model", choices=["default", *RANDOM_SHAPES], default="default",
                        help="default: the packaged SmolLM2-135M-Instruct; random-8b: a random-weight Llama of a "
                             "real 8B shape built in memory (GPU); random-tiny: that code path at toy size")
    parser.add_argument("--only", help=f"comma-separated sections: {','.join(ORDER)}")
    parser.add_argument("--spec-workloads", default="",
                        help="comma-separated workloads of the speculation section (copy,document,code,chat; "
                             "default: all)")
    parser.add_argument("--spec-variants", default="",
                        help="comma-separated draft sources the speculation section's chat runs besides speculation "
                             "off and prompt lookup (answers,draft,head,head-chain,auto; default: all)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory for results.json, REPORT.md and plots (default docs/benchmarks for a "
                             "run of every section; a run with --only writes files only when --out is given)")
    args = parser.parse_args(argv)
    args.sections = [s for s in ORDER if s in set(args.only.split(","))] if args.only else list(ORDER)
    if args.only and not set(args.only.split(",")) <= set(ORDER):
        parser.error(f"--only takes {','.join(ORDER)}")
    from bench.workloads import WORKLOADS

    unknown = {w for w in args.spec_workloads.split(",") if w} - set(WORKLOADS)
    if unknown:
        parser.error(f"--spec-workloads takes {','.join(WORKLOADS)}, not {','.join(sorted(unknown))}")
    from bench.sections.speculation import VARIANTS

    known = {v for vs in VARIANTS.values() for v in vs}
    unknown = {v for v in args.spec_variants.split(",") if v} - known
    if unknown:
        parser.error(f"--spec-variants takes {','.join(sorted(known))}, not {','.join(sorted(unknown))}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    if args.model == "random-8b" and args.device != "cuda":
        print("warning: random-8b on the CPU needs ~40 GB of memory and hours; it is meant for --device cuda",
              file=sys.stderr)
    if args.out is None and not args.only:
        args.out = DEFAULT_OUT
    return args


def run_sections(wb: Workbench, names: list[str]) -> list:
    results = []
    for name in names:
        log(f"== {name} ==")
        before = CpuSnapshot.take()
        result = load(name).run(wb)
        after = CpuSnapshot.take()
        result.load, result.seconds = MachineLoad.between(before, after), after.wall - before.wall
        for target in result.targets:
            print(target.line(), flush=True)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    machine = machine_info(args.device)
    log(f"machine: {machine['cpu']} ({machine['cores']} cores), torch {torch.__version__}, device {args.device}")
    start = CpuSnapshot.take()
    with tempfile.TemporaryDirectory(prefix="infemeral-bench-") as tmp:
        params = dataclasses.replace(QUICK if args.quick else FULL,
                                     spec_workloads=tuple(w for w in args.spec_workloads.split(",") if w),
                                     spec_variants=tuple(v for v in args.spec_variants.split(",") if v))
        wb = Workbench(model=args.model, device=args.device, dtype=args.dtype, params=params, tmp=Path(tmp),
                       quick=args.quick)
        try:
            results = run_sections(wb, args.sections)
        finally:
            dtypes = wb.server_dtypes
            wb.close()
    run = {"machine": machine, "model": wb.model_name, "server_dtypes": dtypes,
           "load": MachineLoad.between(start, CpuSnapshot.take()), "total_seconds": now() - T0,
           "config": {"mode": "quick" if args.quick else "full", "model": args.model, "device": args.device,
                      "dtype": wb.dtype_name, "params": wb.params, "sections": args.sections,
                      "command": " ".join([".venv/bin/python scripts/bench.py"] + (argv or sys.argv[1:])),
                      "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}}
    log(f"load during the run: {run['load'].describe()}")
    for target in (t for r in results for t in r.targets):
        print(target.line(), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report.write_json(run, results, args.out)
        plots = report.write_plots(results, args.out)
        report.write_markdown(run, results, plots, args.out)
        log(f"wrote {args.out / 'results.json'} and {args.out / 'REPORT.md'}")
    return 0
