"""Perplexity of the plain model under each KV-window mode: the study behind docs/window_perplexity.md.

The measure itself (the plain model, the window modes, scoring) is infemeral/eval/perplexity.py.

    python scripts/studies/perplexity.py                      # print the table
    python scripts/studies/perplexity.py --write docs/window_perplexity.md
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from infemeral.cloak.sources import load_model
from infemeral.eval.metrics import DEFAULT_TEXT
from infemeral.eval.perplexity import DENSE, MODES, NO_REROTATE, NO_SINKS, SINKS, PlainModel, Result, compare, tokenize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the studies package, run as a file too
from studies.docs_block import put_block  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DOC = REPO / "docs" / "window_perplexity.md"
TABLE_START = "<!-- perplexity-table:start -->"
TABLE_END = "<!-- perplexity-table:end -->"
SHORT_NAMES = {"dense": DENSE, "sinks": SINKS, "no-sinks": NO_SINKS, "no-rerotate": NO_REROTATE}


def markdown_table(rows: Mapping[int, Mapping[str, Result]]) -> str:
    """One row per window size, one column per mode: perplexity (and its ratio to dense)."""
    modes = [m for m in MODES if any(m in r for r in rows.values())]
    lines = ["| window (tokens) | " + " | ".join(modes) + " |",
             "|---:|" + "---:|" * len(modes)]
    for window, results in rows.items():
        dense = results.get(DENSE)
        cells = []
        for mode in modes:
            r = results.get(mode)
            if r is None:
                cells.append("—")
            elif dense is None or mode == DENSE:
                cells.append(f"{r.perplexity:.2f}")
            else:
                cells.append(f"{r.perplexity:.2f} (×{r.perplexity / dense.perplexity:.2f})")
        lines.append(f"| {window} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_table(path: Path, table: str, settings: str) -> None:
    """Put the table between the markers in `path` (creating a minimal file when it has none)."""
    put_block(path, TABLE_START, TABLE_END, f"{settings}\n\n{table}", "Sliding-window perplexity")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/studies/perplexity.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a .gguf file, checkpoint directory or Hub id (default: packaged SmolLM2)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="plain-text file (default: %(default)s)")
    parser.add_argument("--tokens", type=int, help="score only the first N tokens of the text")
    parser.add_argument("--window", type=int, nargs="+", default=[64, 128, 256, 512, 1024],
                        help="window sizes (max_context) to compare (default: %(default)s)")
    parser.add_argument("--sinks", type=int, default=4, help="sink tokens (default: %(default)s)")
    parser.add_argument("--page-size", type=int, default=16, help="eviction page (default: %(default)s)")
    parser.add_argument("--modes", nargs="+", choices=list(SHORT_NAMES), default=list(SHORT_NAMES),
                        help="modes to run (default: all; dense is always run, once, as the reference)")
    parser.add_argument("--prefill", type=int, default=16, help="tokens in the first step (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: %(default)s; one token per step gains little from more, "
                             "and extra threads slow it down badly on a busy machine)")
    parser.add_argument("--write", type=Path, nargs="?", const=DEFAULT_DOC, metavar="PATH",
                        help=f"also put the table into this markdown file (default: {DEFAULT_DOC.relative_to(REPO)})")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tokenizer = load_model(args.model, hub=True)
    plain = PlainModel.from_transformers(model)
    del model
    ids = tokenize(tokenizer, args.text.read_text(), args.tokens)
    name = args.model or "packaged SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)"
    try:
        text_name = args.text.resolve().relative_to(REPO)
    except ValueError:
        text_name = args.text
    print(f"{name}; {text_name}: {len(ids)} tokens", file=sys.stderr)

    rows: dict[int, dict[str, Result]] = {}
    dense = None
    for window in args.window:
        wanted = tuple(m for m in MODES[1:] if m in {SHORT_NAMES[k] for k in args.modes})
        modes = wanted if dense is not None else (DENSE, *wanted)  # dense does not depend on the window: run it once
        rows[window] = compare(plain, ids, window, args.sinks, args.page_size, modes, args.prefill,
                               progress=lambda r: print(f"  window {r.policy.max_context if r.policy.enabled else '-'}"
                                                        f" {r.mode}: ppl {r.perplexity:.3f} "
                                                        f"({r.evictions} evictions, {r.seconds:.1f} s)",
                                                        file=sys.stderr))
        dense = dense or rows[window][DENSE]
        rows[window][DENSE] = dense
    table = markdown_table(rows)
    settings = (f"Model: {name}. Text: `{text_name}`, {len(ids)} tokens, {len(ids) - 1} scored. "
                f"Sinks: {args.sinks}; page size: {args.page_size}; first step: {args.prefill} tokens, then one "
                "token per step. Perplexity = exp(mean NLL); (×r) is the ratio to dense attention.")
    print(settings + "\n\n" + table)
    if args.write:
        write_table(args.write, table, settings)
        print(f"wrote {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
