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


def accept_tree(draw: Draw, logits: torch.Tensor, context_ids: Sequence[int], tokens: Sequence[int],
                parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """The accepted path through a draft tree and one token of the model's own: (tokens, rows).

    `tokens[i]`/`parents[i]` are the step's rows (layers/draft_tree.py): row 0 is the step's first token (the
    root, already sampled; `context_ids` ends with it), every other row a draft whose parent row precedes it.
    `logits` [len(tokens), vocab]: row i is the model's output after row i's ancestors and itself. The walk
    starts at the root; at each row it draws one token from that row's logits, and if the draw equals one
    of the row's children it moves to that child (children hold distinct tokens), else the draw is the
    next token and the walk ends. `rows` are the rows walked (the root, then each accepted child): what the
    caches keep, in order.

    This is `accept_drafts` with several candidates per position, and exact for the same reasons. With
    greedy decoding the draw is the argmax, so the tokens are those of decoding one at a time. With sampling
    the draw x ~ p is made whatever the children are: it is kept (as a child, or as the next token) either
    way, so every emitted token has the target distribution — SpecInfer's multi-candidate rule for
    point-mass drafts, where a rejected child's residual is p with the children drawn so far removed, which
    is what "x is none of them" leaves. Each position consumes exactly one draw, in order, so a fixed seed
    gives the same output with trees, chains or no drafts at all."""
    if logits.shape[0] != len(tokens) or len(parents) != len(tokens):
        raise ValueError(f"a tree of {len(tokens)} rows needs as many parents and rows of logits, got "
                         f"{len(parents)} and {logits.shape[0]}")
    children: dict[int, dict[int, int]] = {}
    for row in range(1, len(tokens)):
        children.setdefault(parents[row], {}).setdefault(tokens[row], row)
    context = list(context_ids)
    out, rows, row = [], [0], 0
    while True:
        token = draw(logits[row], context)
        out.append(token)
        child = children.get(row, {}).get(token)
        if child is None:
            return out, rows
        context.append(token)
        rows.append(child)
        row = child
