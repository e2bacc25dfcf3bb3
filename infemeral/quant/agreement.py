"""How often quantised served layers pick float32's next token: the measure, and prepare's closing check.

Perplexity hides what a user feels: a bundle at 1.06x can still part from float32 at one token in seven, and
from there the answer is a different answer. Top-1 agreement counts exactly that. `eval server-quant` measures
it over greedy answers; `prepare` checks every quantised bundle it writes on held text, teacher-forced (one
pass through each layer, float and quantised, as the layer is prepared), so the cost is known before the
bundle is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from infemeral.layers import architecture
from infemeral.quant.calibration import Calibration

# Below this share of held positions, prepare warns: between round-to-nearest int8 and int4 on the default model,
# whose measurements are in docs/server_quant.md.
POOR_TOP1_RATE = 0.93
HELD_POSITIONS = 256  # a few hundred: one float and one quantised pass through each layer, seconds on a laptop


@dataclass
class Agreement:
    """How often a candidate's top-1 is the reference's, teacher-forced over the same tokens (every evaluation
    reports this one record: prepare's check, `eval server-quant`, the client's and the server's precision)."""

    positions: int
    top1_matches: int
    first_divergence: int | None  # earliest over the sequences, in tokens of a continuation
    divergences: list = field(default_factory=list)  # per sequence (None: none)
    # at the disagreeing positions, the largest gap between the reference's logit for its own top-1 and for the
    # candidate's token (None: not measured); small means the candidate chose differently only at near-ties
    max_margin: float | None = None

    @property
    def top1_rate(self) -> float:
        return self.top1_matches / self.positions if self.positions else float("nan")

    def describe(self) -> str:
        first = "none" if self.first_divergence is None else f"token {self.first_divergence}"
        margin = "" if self.max_margin is None else f", largest margin at a divergence {self.max_margin:.3f}"
        return f"top-1 {self.top1_matches}/{self.positions} ({self.top1_rate:.1%}), first divergence {first}{margin}"

    def to_manifest(self) -> dict:
        return {"positions": self.positions, "top1_matches": self.top1_matches,
                "first_divergence": self.first_divergence}

    @classmethod
    def from_matches(cls, same: list[torch.Tensor]) -> "Agreement":
        """From one boolean row per sequence: did the candidate's top-1 match the reference's at each position."""
        divergences = [int(row.logical_not().nonzero()[0]) if not bool(row.all()) else None for row in same]
        seen = [d for d in divergences if d is not None]
        return cls(sum(len(row) for row in same), sum(int(row.sum()) for row in same), min(seen) if seen else None,
                   divergences)


def advice(agreement: Agreement, scheme: str, group_size: int | None) -> str | None:
    """What to do about a poor agreement (None: it is not poor)."""
    if agreement.top1_rate >= POOR_TOP1_RATE:
        return None
    fixes = ["--server-quant int8 (round to nearest: close to float32 at half of bf16's size)"]
    if scheme == "int4":
        if group_size and group_size > 32:
            fixes.append("a smaller --group-size (32)")
        fixes.append("another --quant-method (gptq, hqq or rtn)")
    return (f"the quantized served layers pick float32's next token at only {agreement.top1_rate:.0%} of held "
            f"positions ({agreement.describe()}): answers will part from the model's. Small models are far more "
            f"fragile than 8B ones; for closer answers prepare again with " + ", or ".join(fixes))


class HeldCheck:
    """Held text carried through the float and the quantised served layers side by side, one layer at a time."""

    def __init__(self, config: PretrainedConfig, embedding: torch.Tensor, sequences: list[list[int]]):
        self.reference = Calibration.from_tokens(config, embedding, sequences)
        self.candidate: Calibration | None = None  # forks from the reference at the first served layer

    def client_layer(self, index: int, weights: Mapping[str, torch.Tensor]) -> None:
        self.reference.advance(index, weights)

    def served_layer(self, index: int, basis: torch.Tensor, float_weights: Mapping[str, torch.Tensor],
                     quantized_weights: Mapping[str, torch.Tensor]) -> None:
        if self.candidate is None:
            self.reference.rotate(basis)
            self.candidate = Calibration(self.reference.config, [h.clone() for h in self.reference.hidden])
        self.reference.advance(index, float_weights)
        self.candidate.advance(index, quantized_weights)

    @torch.inference_mode()
    def result(self, basis: torch.Tensor, norm_weight: torch.Tensor, head: torch.Tensor) -> Agreement:
        """Teacher-forced top-1 of the candidate against the reference at every held position."""
        config = self.reference.config
        norm = architecture.norm_class(config)(config.hidden_size, eps=config.rms_norm_eps)
        norm.weight.data = norm_weight.to(torch.float32)
        q, head = basis.to(torch.float32), head.to(torch.float32)

        def top1(h: torch.Tensor) -> torch.Tensor:
            return (norm((h @ q.T).unsqueeze(0))[0] @ head.T).argmax(-1)

        return Agreement.from_matches([top1(r) == top1(c) for r, c in zip(self.reference.hidden,
                                                                          self.candidate.hidden)])
