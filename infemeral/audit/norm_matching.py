"""Norm matching: orthogonal Q keeps vector norms, so a state's norm can be looked up in the public embedding table.

This is the leak of rotating raw embeddings (docs/design.md §2): embedding rows have almost
all-distinct norms. It needs no weights beyond the embedding table and no knowledge of Q,
and it is why the client runs the first decoder layer(s) before rotating.
"""

from __future__ import annotations

import torch


def match_norms(states: torch.Tensor, embed: torch.Tensor) -> list[int]:
    """For each state [n, d], the token whose embedding row's norm is nearest to the state's norm."""
    norms, order = embed.double().norm(dim=1).sort()
    wanted = states.double().norm(dim=1)
    right = torch.searchsorted(norms, wanted).clamp(max=len(norms) - 1)
    left = (right - 1).clamp(min=0)
    take_left = (wanted - norms[left]).abs() < (norms[right] - wanted).abs()
    return order[torch.where(take_left, left, right)].tolist()
