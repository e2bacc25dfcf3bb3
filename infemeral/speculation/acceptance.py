"""Which drafts to keep: the acceptance rule of speculative decoding.

A step sends the last sampled token plus k drafted tokens and gets the model's
output at all k+1 positions back in one round trip. Position i's output is the
target distribution p_i of the token after draft i, so the drafts can be
checked in order:

    keep draft d_i while the token the sampler draws from p_i equals d_i;
    the first draw that differs (or the draw after the last draft) is the next token.

With greedy decoding the draw is the argmax, so this keeps exactly the tokens
that decoding one at a time would produce. With sampling it is the
speculative-sampling rule for a point-mass draft: the draw x ~ p_i equals d_i
with probability p_i(d_i) (accept), and given x != d_i it is distributed as p_i
with d_i removed and renormalised (the residual) — so every emitted token has
the target distribution. Because each position consumes exactly one draw from
the sampler's generator, in order, a fixed seed reproduces the same output
whatever was drafted (the logits of a k+1-position step can differ from
one-at-a-time ones in the last bits, like any change of matmul shape).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Draw = Callable[[torch.Tensor, list[int]], int]  # (logits [vocab], context ids) -> token, e.g. a Sampler


def accept_drafts(draw: Draw, logits: torch.Tensor, context_ids: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The accepted drafts followed by one token of the model's own.

    `logits` [len(drafts) + 1, vocab]: row i is the model's output after the step's first token
    and drafts[:i]; `context_ids` ends with the step's first token. The sampler sees the context
    including every accepted draft (repetition penalty)."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} rows of logits, got {logits.shape[0]}")
    context = list(context_ids)
    out: list[int] = []
    for i, row in enumerate(logits):
        token = draw(row, context)
        out.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
        context.append(token)
    return out
