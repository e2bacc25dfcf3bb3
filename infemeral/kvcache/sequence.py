"""What every per-session KV cache offers, on the client (contiguous) and on the server (paged).

The store, the window and the engine only need this much of a cache: its
shape, its length, how much of it still equals the last commit, and a few
operations over token ranges. `KVCache` (contiguous, the client's) and
`PagedSequence` (a block table in the server's page pool) both provide it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class KVSequence(Protocol):
    """Keys/values of layers [first_layer, first_layer + num_layers) for positions [0, length)."""

    first_layer: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    length: int
    # Leading positions that still hold exactly what the last commit (or load) left there. A truncation
    # lowers it to the new length; an eviction, which moves every position from its start on, lowers it
    # to that start. The store rewrites everything from here on at the next commit.
    committed_length: int

    def layer_tensors(self, slot: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, end - start, head_dim] of layer `first_layer + slot`."""

    def load_layer(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill one layer from positions 0.. of stored [kv_heads, T, head_dim] tensors."""

    def set_length(self, length: int) -> None:
        """Declare `length` positions loaded and committed."""

    def truncate(self, tokens: int) -> None:
        """Drop the last `tokens` positions."""

    def evict(self, start: int, count: int, rekey: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Drop positions [start, start + count) and move later ones down, re-keyed by `rekey`."""

    def commit(self) -> None:
        """Mark the current contents as the committed state."""
