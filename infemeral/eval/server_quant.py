"""`infemeral-client eval server-quant`: what a user's (quantised) server bundle costs in quality.

The client bundle in float32 and the server bundle through its real layers (`systems.BundleSplit`) against the
plain model in float32, which the float32 split matches token for token (docs/design.md §1): perplexity over
held text (default: the Genesis excerpt shipped as package data, never calibrated on), scored in chunks with
dense attention, and top-1 agreement with float32's greedy answers to chat prompts, teacher-forced through the
bundle, with the first divergence (the token where free-running greedy decoding would part from float32).

The study of every quantisation method and weight arrangement, and the tables of docs/server_quant.md, are
scripts/studies/server_quant.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

from infemeral.eval.metrics import DEFAULT_TEXT, agreement, chat_ids, greedy_sequences, perplexity
from infemeral.quant.agreement import Agreement

TEXT_TOKENS = 1024
AGREEMENT_PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle works, part by part.",
    "Describe a walk through a busy city market in the morning.",
    "Tell me about the history of sailing ships.",
)


@dataclass
class BundleReport:
    quant: str
    text_tokens: int
    reference_perplexity: float
    perplexity: float
    agreement: Agreement

    @property
    def ratio(self) -> float:
        return self.perplexity / self.reference_perplexity

    def describe(self) -> str:
        return (f"served layers {self.quant}: perplexity {self.perplexity:.3f} against {self.reference_perplexity:.3f} "
                f"in float32 ({self.ratio:.3f}x) over {self.text_tokens} tokens; {self.agreement.describe()}")


def measure_bundle(reference, candidate, tokenizer, text: str, text_tokens: int = TEXT_TOKENS,
                   positions: int = 512, stop: set[int] = frozenset(), quant: str = "",
                   progress: bool = False) -> BundleReport:
    """Perplexity and greedy agreement of `candidate` against `reference` (both `.logits(ids, cache)` systems).
    A CPU takes minutes over the defaults, so `progress` shows one bar (on stderr) over the four phases' tokens."""
    from tqdm.auto import tqdm

    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:text_tokens]
    prompts = [chat_ids(tokenizer, p) for p in AGREEMENT_PROMPTS]
    scored = max(len(ids) - 1, 0)
    with tqdm(total=positions + 2 * scored + positions, unit="tok", disable=not progress, leave=False) as bar:
        bar.set_description("float32 greedy answers")
        sequences = greedy_sequences(reference, prompts, positions, set(stop), advance=bar.update)
        compared = sum(len(continuation) for _, continuation in sequences)
        bar.total = bar.n + 2 * scored + compared  # the answers may run a little past `positions`
        bar.set_description("float32 perplexity")
        reference_perplexity = perplexity(reference, ids, advance=bar.update)
        bar.set_description(f"{quant or 'bundle'} perplexity")
        candidate_perplexity = perplexity(candidate, ids, advance=bar.update)
        bar.set_description(f"{quant or 'bundle'} agreement")
        agreed = agreement(candidate, sequences, advance=bar.update)
    return BundleReport(quant, len(ids), reference_perplexity, candidate_perplexity, agreed)


def run_bundle(model: str | None, client_dir: Path, server_dir: Path, text: Path | Traversable | None = None,
               text_tokens: int = TEXT_TOKENS, positions: int = 512, dtype: str = "float32",
               progress: bool = False) -> BundleReport:
    """The bundles against `model` (default: the packaged SmolLM2) on `text` (default: DEFAULT_TEXT)."""
    from infemeral.cloak.bundle import DTYPES
    from infemeral.cloak.sources import load_model
    from infemeral.eval.systems import BundleSplit, PlainReference

    text = DEFAULT_TEXT if text is None else text
    if not text.is_file():
        raise ValueError(f"held text {text} not found: pass --text FILE, a few thousand words the model was not "
                         "tuned on")
    if progress:
        print("loading the float32 model and the bundles...", file=sys.stderr, flush=True)
    plain, tokenizer = load_model(model, hub=True)
    candidate = BundleSplit(client_dir, server_dir, DTYPES[dtype])
    eos = candidate.client.bundle.generation_config().eos_token_id
    stop = set(eos if isinstance(eos, list) else [] if eos is None else [eos]) | {tokenizer.eos_token_id}
    return measure_bundle(PlainReference(plain), candidate, tokenizer, text.read_text(encoding="utf-8"),
                          text_tokens, positions, stop - {None}, candidate.quant.describe(), progress)
