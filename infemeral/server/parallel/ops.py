"""What rank 0 tells the other ranks to do: one message per operation, each followed by the collectives it
names. Every rank runs the operations in the order rank 0 sent them; block tables travel as plain page
lists (rank 0 keeps all the bookkeeping: grants, quotas, the free list)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from infemeral.server.config import EngineConfig


@dataclass(frozen=True)
class Setup:
    """Load your shard of the bundle and build your page pool; then report (gather: ok, weight bytes, pool
    bytes)."""

    bundle: str
    config: EngineConfig
    device_kind: str    # cpu or cuda (rank r takes cuda:LOCAL_RANK)
    threads: int        # torch threads (CPU ranks)
    log_level: str
    log_format: str


@dataclass
class SequenceView:
    """A sequence as a forward pass sees it: its block table and its length before the step (which the pass
    moves on)."""

    pages: list[int]
    length: int


@dataclass(frozen=True)
class Forward:
    """Run the served layers over a batch: the new positions' hidden states follow (broadcast,
    [num_tokens, hidden]); an all-reduce after every o_proj and down_proj; then one all-reduce of
    whether any key or value written was not finite."""

    sequences: list[SequenceView]
    new_tokens: list[int]
    trees: list[list[int] | None] | None = None  # per sequence, a draft tree's parents (None: a chain)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)


@dataclass(frozen=True)
class Read:
    """Send positions [start, end) of one layer (gather: [2, your KV heads, n, head_dim])."""

    slot: int
    pages: list[int]
    start: int
    end: int


@dataclass(frozen=True)
class Write:
    """Write positions start.. of one layer (scatter: your KV heads of [2, KV heads, num_tokens, head_dim])."""

    slot: int
    pages: list[int]
    start: int
    num_tokens: int


@dataclass(frozen=True)
class Move:
    """A window slide: move positions [start, end) to `to`.. in every layer, keys through `rekey`."""

    pages: list[int]
    start: int
    end: int
    to: int
    rekey: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Zero:
    """Zero these pages (they went back to the pool)."""

    pages: list[int]


@dataclass(frozen=True)
class Ping:
    """Still there? (an all-reduce of one number)"""


@dataclass(frozen=True)
class Stop:
    """Exit (the server is stopping)."""
