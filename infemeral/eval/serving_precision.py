"""How closely the split system serving in bfloat16/float16 follows plain transformers in the same dtype.

In bfloat16 or float16 the rotated weights round differently from the plain ones, so greedy outputs
may part ways at near-ties (docs/design.md §1). This measures that without letting one early divergence
spoil the rest: the split system's own greedy tokens are teacher-forced through the plain model, and
at every position the plain model's top-1 is compared with the token the split system chose.

* `top1_rate`: share of positions where they agree;
* `first_divergence`: the first position where they do not (None: nowhere);
* `max_margin`: at the disagreeing positions, the largest gap between the plain model's logit for its
  own top-1 and for the split system's token. Small means the split system only ever chose differently
  where the plain model was itself nearly tied; a real fault (a wrong basis, a wrong cache) shows as
  large margins and a low top-1 rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Lower bounds measured on the default model (see tests/test_reduced_precision.py), with margin.
MIN_TOP1_RATE = {"bfloat16": 0.90, "float16": 0.95}
MAX_MARGIN = {"bfloat16": 1.0, "float16": 0.5}


@dataclass
class Agreement:
    positions: int
    top1_matches: int
    first_divergence: int | None
    max_margin: float

    @property
    def top1_rate(self) -> float:
        return self.top1_matches / self.positions if self.positions else float("nan")

    def describe(self) -> str:
        first = "none" if self.first_divergence is None else f"at token {self.first_divergence}"
        return (f"top-1 {self.top1_matches}/{self.positions} ({self.top1_rate:.1%}), first divergence {first}, "
                f"largest margin at a divergence {self.max_margin:.3f}")


@torch.inference_mode()
def teacher_forced_agreement(model: torch.nn.Module, prompt_ids: list[int], generated: list[int]) -> Agreement:
    """Score `generated` (tokens chosen by the system under test after `prompt_ids`) with plain `model`."""
    if not generated:
        raise ValueError("nothing generated to compare")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + generated[:-1]], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:].float()  # row i predicts generated[i]
    chosen = torch.tensor(generated, device=device)
    top1 = logits.argmax(-1)
    differs = (top1 != chosen).nonzero().flatten().tolist()
    margins = [float(logits[i, top1[i]] - logits[i, chosen[i]]) for i in differs]
    return Agreement(len(generated), len(generated) - len(differs), differs[0] if differs else None,
                     max(margins, default=0.0))
