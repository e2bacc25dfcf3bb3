"""Draft heads side by side on the comparison set (`held_out_prompts()`: 20 chat prompts on subjects no training
prompt has, so no head trained on any number of `chat_prompts` has seen them), measured as train-drafter
measures its own (`head/measure.py`: stepping through the model's answers as a session steps): first draft right,
and tokens per round trip with chains of 5 drafts and with trees of 63 nodes in 5 levels. The answers are the
model's own, greedy, in float32 on this machine's CPU (what the laptop drafts from), made once and kept in
train-drafter's cache.

    .venv/bin/python scripts/studies/compare_heads.py .bundles/draft-head-default gpu-head/ [--model default]

scripts/gpu_train_head.py runs the same comparison on the GPU machine for the head it trains there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from infemeral.speculation.head.settings import DEFAULT_CACHE, TrainSettings

SHAPES = (("chain of 5", 5, 0), ("tree of 63 nodes, 5 levels", 5, 63))  # (name, drafts or levels, tree nodes)


def comparison_data(answers, positions: int, cache_dir: str | Path | None, progress: bool = False):
    """The model's answers (`answers`, an `Answers`) to the comparison set, long enough for `positions` measured
    positions each and the drafts that follow the last of them."""
    from infemeral.speculation.head.data import training_data
    from infemeral.speculation.head.prompts import held_out_prompts

    longest = max(depth for _, depth, _ in SHAPES)
    settings = dataclasses.replace(TrainSettings(), max_new_tokens=positions + longest + 1)
    return training_data(answers, held_out_prompts(), settings,
                         cache_dir=None if cache_dir is None else Path(cache_dir).expanduser(), progress=progress)


def float32_answers(model: str | Path, target, tokenizer):
    """The model answering here in float32 on the CPU, as the comparison has it answer wherever it runs."""
    import torch

    from infemeral.speculation.head.train import local_answers

    return local_answers(model, target, tokenizer, TrainSettings(generate_dtype="float32", device="cpu"),
                         torch.device("cpu"))


def load_heads(paths: dict[str, Path], answers) -> dict:
    """{name: DraftHead} for the head directories in `paths`, on the CPU in float32, against `answers`' model."""
    import torch

    from infemeral.speculation.head.drafter import DraftHead
    from infemeral.speculation.head.measure import TargetTables

    tables = TargetTables(*answers.target_weights(), torch.device("cpu"))
    return {name: DraftHead.load(path, tables) for name, path in paths.items()}


def compare(heads: dict, data, positions: int, progress: bool = False) -> list[dict]:
    """One row per head and draft shape: first draft right, tokens per round trip, the draft vocabulary's
    coverage of the answers, over the first `positions` answer positions of each comparison prompt."""
    from infemeral.speculation.head.measure import measure

    rows = []
    for name, head in heads.items():
        for shape, depth, nodes in SHAPES:
            first, per_step, coverage = measure(head, data, depth, positions, progress, tree_nodes=nodes)
            rows.append({"head": name, "shape": shape, "prompts": len(data.ids), "positions": positions,
                         "first_draft": first, "tokens_per_round_trip": per_step, "vocab_coverage": coverage})
    return rows


def table(rows: list[dict]) -> list[str]:
    """The rows as a markdown table."""
    lines = ["| head | drafts | first draft right | tokens per round trip | draft vocabulary covers |",
             "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['head']} | {r['shape']} | {100 * r['first_draft']:.1f} % | "
                     f"{r['tokens_per_round_trip']:.2f} | {100 * r['vocab_coverage']:.1f} % |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+", type=Path, help="draft head directories (config.json + weights)")
    parser.add_argument("--model", default="default", help="the model they draft for: 'default' (the packaged "
                        "SmolLM2), a .gguf file or a model directory")
    parser.add_argument("--positions", type=int, default=TrainSettings().eval_positions,
                        help="answer positions measured per prompt (train-drafter's own measure's)")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the comparison answers are kept "
                        "('none': nowhere)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.heads if not (p / "config.json").exists()]
    if missing:
        parser.error(f"no draft head (config.json) in {', '.join(missing)}")

    import torch

    from infemeral.cloak.sources import load_model

    target, tokenizer = load_model(args.model, torch.float32)
    answers = float32_answers(args.model, target, tokenizer)
    data = comparison_data(answers, args.positions, None if args.cache == "none" else args.cache, progress=True)
    rows = compare(load_heads({str(p): p for p in args.heads}, answers), data, args.positions, progress=True)
    print("\n".join(table(rows)))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
