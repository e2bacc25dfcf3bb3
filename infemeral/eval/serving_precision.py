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

from dataclasses import replace

import torch

from infemeral.eval.metrics import teacher_forced_logits
from infemeral.eval.systems import PlainReference
from infemeral.quant.agreement import Agreement

# Lower bounds measured on the default model (see tests/eval/test_reduced_precision.py), with margin.
MIN_TOP1_RATE = {"bfloat16": 0.90, "float16": 0.95}
MAX_MARGIN = {"bfloat16": 1.0, "float16": 0.5}


@torch.inference_mode()
def teacher_forced_agreement(model: torch.nn.Module, prompt_ids: list[int], generated: list[int]) -> Agreement:
    """Score `generated` (tokens chosen by the system under test after `prompt_ids`) with plain `model`, in one
    pass."""
    logits = teacher_forced_logits(PlainReference(model), prompt_ids, generated, chunk=None)
    chosen = torch.tensor(generated, device=logits.device)
    top1 = logits.argmax(-1)
    margins = [float(logits[i, top1[i]] - logits[i, chosen[i]]) for i in (top1 != chosen).nonzero().flatten()]
    return replace(Agreement.from_matches([(top1 == chosen).cpu()]), max_margin=max(margins, default=0.0))
