"""A draft tree as a step's layers read it: rows in an order where every parent precedes its children, each
with its parent row (docs/design.md §9).

Row 0 is the root (the token sampled last; parent -1). Row i sits at position base + depth(i), so a node's
RoPE position is the one it would have in a chain of its own ancestors, and it attends the cache before the
step, its ancestors and itself: what decoding its branch one token at a time would read. A chain is the
tree where each row's parent is the row before it (`chain_parents`), which is causal attention. The client's
first layer, the torch paged backend and FlashInfer's custom mask all read these helpers, and the server
checks what a client sends with `check_parents` before anything runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infemeral.errors import InvalidArgument

MAX_TREE_DEPTH = 64  # deepest node a step may carry (a chain of 64 drafts is far past what pays)


def chain_parents(n: int) -> list[int]:
    """A chain of `n` rows as a tree: row i's parent is row i - 1."""
    return list(range(-1, n - 1))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def check_parents(parents: Sequence[int], num_rows: int, max_depth: int = MAX_TREE_DEPTH) -> None:
    """Refuse a malformed tree (InvalidArgument, saying what is wrong): one parent per row, the root first,
    every other parent an earlier row, no node deeper than `max_depth`."""
    if len(parents) != num_rows:
        raise InvalidArgument(f"a draft tree needs one parent per row: {len(parents)} parents for {num_rows} rows")
    if not parents or parents[0] != -1:
        raise InvalidArgument("a draft tree's first row is its root: parents[0] must be -1")
    depths = [0]
    for i in range(1, num_rows):
        p = parents[i]
        if not 0 <= p < i:
            raise InvalidArgument(f"parents[{i}] = {p}: every row's parent must be an earlier row (0 <= parent < {i})")
        depths.append(depths[p] + 1)
        if depths[i] > max_depth:
            raise InvalidArgument(f"row {i} of the draft tree is {depths[i]} deep; at most {max_depth}")


def depths(parents: Sequence[int]) -> list[int]:
    """Each row's depth below the root (the root: 0)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_mask(parents: Sequence[int], device=None) -> torch.Tensor:
    """[n, n] bool: row i may read row j iff j is i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask.to(device) if device is not None else mask


def tree_attention_mask(parents: Sequence[int], prefix: int, device=None) -> torch.Tensor:
    """[n, prefix + n] bool: the step's rows read all `prefix` cached positions, then their ancestors and
    themselves among the step's own (which follow the cache in row order)."""
    n = len(parents)
    mask = torch.ones(n, prefix + n, dtype=torch.bool)
    mask[:, prefix:] = ancestor_mask(parents)
    return mask.to(device) if device is not None else mask


def tree_positions(parents: Sequence[int], base: int, device=None) -> torch.Tensor:
    """[1, n] long: row i's RoPE position, base + its depth."""
    return (torch.tensor(depths(parents), dtype=torch.long) + base).to(device).unsqueeze(0)


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The rows from the root down to `node`, in order."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
