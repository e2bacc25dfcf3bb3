"""Perplexity of the plain (unsplit) model over a long text under each KV-window mode.

Reproduces, in kind, the StreamingLLM result (Xiao et al., 2023): a sliding
window that keeps a few attention-sink tokens stays close to dense attention,
while a window that drops the first tokens, or one that does not re-rotate the
surviving keys after an eviction, does much worse.

The model's own decoder layers run through `LayerStack` over our `KVCache`, and
`apply_window(cache, policy, 1, inv_freq)` is called before every step, exactly
as the client and the server do. The window modes feed the text one token at a
time (after a prefill that fits in the window without evicting); dense attention
never evicts, so it is run in larger chunks, which is the same computation.

    python -m infemeral.eval.perplexity                      # print the table
    python -m infemeral.eval.perplexity --write docs/window_perplexity.md
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from infemeral.eval.metrics import DEFAULT_TEXT, perplexity
from infemeral.eval.systems import load_model
from infemeral.kvcache.window import WindowPolicy, apply_window, rope_shift_frequencies
from infemeral.layers import architecture
from infemeral.layers.stack import LayerStack

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DOC = REPO / "docs" / "window_perplexity.md"
TABLE_START = "<!-- perplexity-table:start -->"
TABLE_END = "<!-- perplexity-table:end -->"

DENSE = "dense"
SINKS = "sinks + window"
NO_SINKS = "window, no sinks"
NO_REROTATE = "sinks + window, no re-rotation"
MODES = (DENSE, SINKS, NO_SINKS, NO_REROTATE)
SHORT_NAMES = {"dense": DENSE, "sinks": SINKS, "no-sinks": NO_SINKS, "no-rerotate": NO_REROTATE}


def policies(window: int, sink_tokens: int = 4, page_size: int = 16,
             length: int | None = None) -> dict[str, WindowPolicy]:
    """The four policies compared, for a window of `window` tokens (dense holds `length` tokens)."""
    return {
        DENSE: WindowPolicy(max(length or 0, window), sink_tokens, page_size, enabled=False),
        SINKS: WindowPolicy(window, sink_tokens, page_size),
        NO_SINKS: WindowPolicy(window, 0, page_size),
        NO_REROTATE: WindowPolicy(window, sink_tokens, page_size, rerotate=False),
    }


class PlainModel:
    """Embedding, every decoder layer (one LayerStack), final norm and LM head of one model."""

    def __init__(self, config: PretrainedConfig, state_dict: Mapping[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32):
        self.config = config
        prefix = "model." if any(k.startswith("model.layers.") for k in state_dict) else ""
        per_layer = []
        for i in range(config.num_hidden_layers):
            head = f"{prefix}layers.{i}."
            per_layer.append({k[len(head):]: v for k, v in state_dict.items() if k.startswith(head)})
        self.layers = LayerStack(config, 0, per_layer, dtype=dtype)
        self.embed = state_dict[f"{prefix}embed_tokens.weight"].to(dtype)
        self.lm_head = state_dict.get("lm_head.weight", state_dict[f"{prefix}embed_tokens.weight"]).to(dtype)
        self.norm = architecture.norm_class(config)(config.hidden_size, eps=config.rms_norm_eps)
        self.norm.weight.data = state_dict[f"{prefix}norm.weight"].to(dtype)
        self.norm.requires_grad_(False)

    @classmethod
    def from_transformers(cls, model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> "PlainModel":
        return cls(model.config, model.state_dict(), dtype)

    def inv_freq(self, max_context: int) -> torch.Tensor:
        return rope_shift_frequencies(self.layers.rotary, self.config, max_context)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Append tokens `ids` [n] to `cache`; logits of the next token at each: [n, vocab], float32."""
        hidden = self.layers(self.embed[ids], cache)
        return (self.norm(hidden.unsqueeze(0))[0] @ self.lm_head.T).float()

    def step(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """As `logits`, as log-probabilities."""
        return torch.log_softmax(self.logits(ids, cache), dim=-1)


class Windowed:
    """`model` as an evaluation system (`infemeral.eval.metrics`) whose cache keeps `policy`'s window: the window
    is applied before every part fed, as the client and the server apply it before every step."""

    def __init__(self, model: PlainModel, policy: WindowPolicy, capacity: int):
        self.model, self.policy, self.capacity = model, policy, capacity
        self.inv_freq = model.inv_freq(policy.max_context)
        self.evictions = 0  # parts that evicted

    def new_cache(self):
        return self.model.layers.new_cache(capacity=self.capacity)

    def logits(self, ids: list[int], cache) -> torch.Tensor:
        self.evictions += bool(apply_window(cache, self.policy, len(ids), self.inv_freq))
        return self.model.logits(torch.tensor(ids, dtype=torch.long), cache)


@dataclass
class Result:
    mode: str
    policy: WindowPolicy
    tokens: int  # tokens whose probability was scored (len(ids) - 1)
    nll: float  # mean negative log-likelihood, nats per token
    evictions: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@torch.inference_mode()
def score_window(model: PlainModel, ids: list[int] | torch.Tensor, policy: WindowPolicy, prefill: int = 16,
                 dense_chunk: int = 512, mode: str = "") -> Result:
    """Score every token after the first: NLL of ids[t + 1] given ids[: t + 1] as the window keeps them.

    The first `prefill` tokens (at most what fits without evicting) go in one step, then one token per step,
    each step preceded by `apply_window(cache, policy, 1, inv_freq)`. A disabled policy (dense) never evicts,
    so it runs in chunks of `dense_chunk`, which gives the same numbers as token by token.
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    n = ids.shape[0]
    if n < 2:
        raise ValueError("need at least two tokens")
    if not policy.enabled and policy.max_context < n:
        raise ValueError(f"dense attention needs max_context >= {n} tokens, got {policy.max_context}")
    system = Windowed(model, policy, capacity=min(n, policy.max_context) + 1)
    first = max(1, min(prefill, policy.max_context - 1 if policy.enabled else n))
    start = time.perf_counter()
    ppl = perplexity(system, ids.tolist(), chunk=1 if policy.enabled else max(1, dense_chunk), first=first)
    return Result(mode, policy, n - 1, math.log(ppl), system.evictions, time.perf_counter() - start)


def compare(model: PlainModel, ids: list[int] | torch.Tensor, window: int, sink_tokens: int = 4,
            page_size: int = 16, modes: tuple[str, ...] = MODES, prefill: int = 16,
            progress: Callable[[Result], None] | None = None) -> dict[str, Result]:
    """Perplexity of the same tokens under each mode for one window size."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    chosen = policies(window, sink_tokens, page_size, length=ids.shape[0])
    results = {}
    for mode in modes:
        results[mode] = score_window(model, ids, chosen[mode], prefill=prefill, mode=mode)
        if progress:
            progress(results[mode])
    return results


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
    block = f"{TABLE_START}\n{settings}\n\n{table}\n{TABLE_END}"
    text = path.read_text() if path.exists() else ""
    if TABLE_START in text and TABLE_END in text:
        text = re.sub(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), lambda _: block, text, flags=re.S)
    else:
        text = (text.rstrip() + "\n\n" if text else "# Sliding-window perplexity\n\n") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def tokenize(tokenizer, text: str, limit: int | None = None) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:limit] if limit else ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infemeral.eval.perplexity", description=__doc__.split("\n\n")[0])
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

    model, tokenizer = load_model(args.model)
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
