"""How closely a reduced client half (bf16, fp16, int8 weights) follows the float32 one.

Only the client half changes between the runs compared here; the server half is the same float32
computation for all of them, so every difference comes from the laptop's precision. The reference is
the float32 client, which is token-identical to plain transformers (tests/e2e/test_exactness.py).

Definitions (over a set of token sequences, each a prompt and a continuation):
  * positions: every continuation token, predicted from the tokens before it (teacher-forced: both
    clients see the same prefix, so each position is one comparison);
  * top-1 agreement: share of positions where the candidate's argmax is the float32 client's;
  * first divergence: the first continuation position where the argmax differs, i.e. the token at
    which free-running greedy generation with the candidate would part from float32 (until then both
    have seen the same prefix, so this is exact, not an estimate);
  * max logit error: max |candidate − float32| over all positions and vocabulary entries; reported
    with the median gap between float32's top two logits, which says how near-tied the choices are.

On the default model the continuations are float32 greedy generations (the real split: client
bundle, float32 server layers). On a random-weight model greedy falls into a short cycle within a few
tokens, so there the positions are a fixed random token sequence instead, and the server is an
identity stand-in (the client's layer output goes straight to the final norm and head): 32 layers of
an 8B model cannot run in float32 on a laptop CPU, and only the client half is under test.

    python -m infemeral.eval.client_precision                          # default model, 512 greedy positions
    python -m infemeral.eval.client_precision --model random-8b        # 8B-shaped random client half
    python -m infemeral.eval.client_precision --write docs/benchmarks/client_agreement.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from infemeral.client_half.half import ClientModel
from infemeral.eval.metrics import Sequence, chat_ids, greedy_sequences, teacher_forced_logits
from infemeral.eval.systems import Split
from infemeral.quant.agreement import Agreement

MODES = {"bfloat16": dict(dtype="bfloat16"), "float16": dict(dtype="float16"), "int8": dict(quant="int8")}
PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle works, part by part.",
    "Describe a walk through a busy city market in the morning.",
    "Give me a detailed recipe for bread, with every step explained.",
    "Tell me about the history of sailing ships.",
    "Write a letter to a friend about a trip to the mountains.",
    "Explain how rain forms, for a curious ten-year-old.",
    "Describe the life of a honeybee from egg to forager.",
)
MARKER = "<!-- agreement {} {} -->"  # start/end, model: regenerated blocks in the markdown file


@dataclass
class ClientComparison:
    """One reduced client against the float32 one: top-1 agreement, and how far its logits move."""

    label: str
    agreement: Agreement
    max_logit_error: float
    mean_logit_error: float
    median_top2_gap: float  # of the float32 reference: how near-tied its choices are


class IdentityServer:
    """A stand-in server half that returns what it is sent (for client halves of models too big to run whole)."""

    def new_cache(self):
        return None

    def __call__(self, hidden: torch.Tensor, cache) -> torch.Tensor:
        return hidden


def client_logits(client: ClientModel, server, seq: Sequence, chunk: int = 128) -> torch.Tensor:
    """Logits [len(continuation), vocab] of the split through `client` predicting each continuation token."""
    return teacher_forced_logits(Split(client, server), seq.prompt, seq.continuation, chunk)


def compare(label: str, reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> ClientComparison:
    matches, errors, gaps = [], [], []
    max_error = 0.0
    for ref, got in zip(reference, candidate, strict=True):
        matches.append(ref.argmax(-1) == got.argmax(-1))
        error = (got - ref).abs()
        max_error = max(max_error, float(error.max()))
        errors.append(error.mean(-1))
        top2 = ref.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    return ClientComparison(label, Agreement.from_matches(matches), max_error, float(torch.cat(errors).mean()),
                            float(torch.cat(gaps).median()))


def measure(reference: ClientModel, candidates: dict[str, Callable[[], ClientModel]], server,
            sequences: list[Sequence]) -> list[ClientComparison]:
    """Agreement of each candidate (built one at a time, then dropped) with the float32 reference."""
    ref_logits = [client_logits(reference, server, s) for s in sequences]
    results = []
    for label, build in candidates.items():
        client = build()
        results.append(compare(label, ref_logits, [client_logits(client, server, s) for s in sequences]))
        del client
    return results


# -- the two settings: the default model (real split), an 8B-shaped random client half ----------------

def default_model_setup(num_positions: int, work: Path):
    """Bundles of the packaged model; float32 client and server; greedy continuations of chat prompts."""
    from infemeral.cloak.bundle import ClientBundle, ServerBundle
    from infemeral.cloak.prepare import prepare
    from infemeral.layers.stack import LayerStack

    bundles = prepare(None, work, progress=False)
    bundle = ClientBundle.open(bundles.client_dir)
    server_bundle = ServerBundle.open(bundles.server_dir)
    first = server_bundle.first_layer
    server = LayerStack(server_bundle.config, first,
                        [server_bundle.layer_weights(i) for i in range(first, first + server_bundle.num_layers)])
    reference = ClientModel(bundle, dtype="float32", device="cpu")
    tokenizer = bundle.tokenizer()
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    stop = {tokenizer.eos_token_id, *_eos_ids(bundle)}
    per_prompt = -(-num_positions // 4)
    sequences = greedy_sequences(Split(reference, server), prompts, num_positions, stop, per_prompt=per_prompt)
    candidates = {label: (lambda kw=kw: ClientModel(bundle, device="cpu", **kw)) for label, kw in MODES.items()}
    return reference, candidates, server, sequences


def _eos_ids(bundle) -> set[int]:
    eos = bundle.generation_config().eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


RANDOM_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)


def random_client_tensors(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """A client bundle's tensors (embedding, layer 0, final norm, LM head) with random float32 weights."""
    from infemeral.layers.architecture import decoder_layer_class

    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        layer = decoder_layer_class(config)(config, 0)
    tensors = {f"layers.0.{name}": _random(p.shape, "norm" in name, generator)
               for name, p in layer.state_dict().items()}
    d = config.hidden_size
    tensors["embed_tokens.weight"] = _random((config.vocab_size, d), False, generator)
    tensors["norm.weight"] = _random((d,), True, generator)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = _random((config.vocab_size, d), False, generator)
    return tensors


def _random(shape, is_gain: bool, generator: torch.Generator) -> torch.Tensor:
    if is_gain:
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    return 0.02 * torch.randn(shape, generator=generator)


def random_model_setup(num_positions: int, shape: dict = RANDOM_8B, seed: int = 0):
    from transformers import LlamaConfig

    from infemeral.cloak.basis import random_orthogonal

    config = LlamaConfig(**shape, rope_theta=500000.0, rms_norm_eps=1e-5)
    tensors = random_client_tensors(config, seed)
    basis = random_orthogonal(config.hidden_size, bytes(32)).float()
    reference = ClientModel.from_tensors(config, 1, tensors, basis, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (num_positions + 1,), generator=g).tolist()
    sequences = [Sequence(ids[:1], ids[1:])]
    candidates = {label: (lambda kw=kw: ClientModel.from_tensors(config, 1, tensors, basis, device="cpu", **kw))
                  for label, kw in MODES.items()}
    return reference, candidates, IdentityServer(), sequences


# -- report ---------------------------------------------------------------------------------------------

def table(results: list[ClientComparison]) -> str:
    lines = ["| client | positions | top-1 agreement | first divergence | max logit error | mean logit error | "
             "median top-2 gap (fp32) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        a = r.agreement
        first = "none" if a.first_divergence is None else str(a.first_divergence)
        lines.append(f"| {r.label} | {a.positions} | {a.top1_rate:.4f} | {first} | {r.max_logit_error:.3f} | "
                     f"{r.mean_logit_error:.4f} | {r.median_top2_gap:.3f} |")
    return "\n".join(lines)


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace (or append) the block for `heading` between this module's markers."""
    start, end = MARKER.format("start", heading), MARKER.format("end", heading)
    block = f"{start}\n{body}\n{end}"
    text = path.read_text() if path.exists() else "# Client agreement with float32\n"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + f"\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["default", "random-8b"], default="default")
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--write", type=Path, help="markdown file to put the table in")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        if args.model == "default":
            setup = default_model_setup(args.positions, Path(work))
            what = (f"Default model (SmolLM2-135M-Instruct), real split with float32 server layers; "
                    "float32 greedy continuations of chat prompts")
        else:
            setup = random_model_setup(args.positions)
            what = ("Llama-3-8B-shaped client half with random weights, identity stand-in for the server; "
                    "a fixed random token sequence")
        reference, candidates, server, sequences = setup
        results = measure(reference, candidates, server, sequences)
    count = sum(len(s.continuation) for s in sequences)
    body = f"{what}: {count} positions in {len(sequences)} sequence{'s' if len(sequences) > 1 else ''}.\n\n"
    body += table(results)
    print(body)
    for r in results:
        print(asdict(r), file=sys.stderr)
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.write:
        write_section(args.write, args.model, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
