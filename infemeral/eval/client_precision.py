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

The study that writes docs/benchmarks/client_agreement.md (on the default model and on an 8B-shaped
random client half) is scripts/studies/client_precision.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infemeral.client_half.half import ClientModel
from infemeral.eval.metrics import Sequence, teacher_forced_logits
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
