"""A session's in-memory KV cache for a contiguous range of decoder layers.

It speaks the one method transformers' attention modules call on a cache,
`update(key, value, layer_idx)`, so the model's own layers run unchanged and
write their keys and values here. A turn appends to it; `commit()` marks the
current length as durable and `rollback()` returns to the last commit, which is
how a turn stays atomic on both the client and the server. It is a
`KVSequence` (kvcache/sequence.py), like the server's paged sequences.
"""

from __future__ import annotations

import torch


def check_kept(span: int, offsets: list[int]) -> None:
    """Offsets kept among the last `span` positions must ascend and lie inside them."""
    if any(b <= a for a, b in zip(offsets, offsets[1:])) or (offsets and not 0 <= offsets[0] <= offsets[-1] < span):
        raise ValueError(f"positions to keep {offsets} must ascend within the last {span}")


def unmoved(offsets: list[int]) -> int:
    """How many kept positions stay where they are (the leading offsets 0, 1, …)."""
    n = 0
    while n < len(offsets) and offsets[n] == n:
        n += 1
    return n


class KVCache:
    """Keys/values for layers [first_layer, first_layer + num_layers), shape [1, kv_heads, T, head_dim]."""

    def __init__(self, first_layer: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", capacity: int = 256):
        self.first_layer = first_layer
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.length = 0
        self.committed_length = 0
        self._pending: list[int] = [0] * num_layers  # tokens written this step, per layer
        cap = max(capacity, 1)
        self._k = [self._alloc(cap) for _ in range(num_layers)]
        self._v = [self._alloc(cap) for _ in range(num_layers)]

    def _alloc(self, cap: int) -> torch.Tensor:
        # Always a normal tensor, even when the cache grows inside torch.inference_mode() (the layers' forward):
        # an inference tensor cannot be updated in place outside that mode, so wipe() and load_layer() would fail.
        with torch.inference_mode(False):
            return torch.zeros(1, self.kv_heads, cap, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self._k[0].shape[2]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = self.capacity
        while cap < needed:
            cap *= 2
        for store in (self._k, self._v):
            for i, old in enumerate(store):
                new = self._alloc(cap)
                new[:, :, : self.length] = old[:, :, : self.length]
                store[i] = new

    # -- what transformers' attention calls -------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append this step's keys/values for one layer; return all keys/values of that layer."""
        slot = layer_idx - self.first_layer
        n = key_states.shape[2]
        end = self.length + n
        self._reserve(end)
        self._k[slot][:, :, self.length:end] = key_states
        self._v[slot][:, :, self.length:end] = value_states
        self._pending[slot] = n
        return self._k[slot][:, :, :end], self._v[slot][:, :, :end]

    def begin_step(self) -> None:
        self._pending = [0] * self.num_layers

    def finish_step(self, n: int) -> None:
        """Called once every layer has written its n new positions."""
        if any(p != n for p in self._pending):
            raise RuntimeError("not every layer wrote this step's keys and values")
        self._pending = [0] * self.num_layers
        self.length += n

    # -- turn lifecycle -------------------------------------------------------------------
    def truncate(self, tokens: int) -> None:
        if tokens > self.length:
            raise ValueError(f"cannot drop {tokens} tokens from a cache of {self.length}")
        self.length -= tokens
        self.committed_length = min(self.committed_length, self.length)

    def keep_positions(self, start: int, offsets: list[int]) -> None:
        """Of the positions from `start` on, keep those at `offsets` (ascending) and drop the rest: the kept ones
        move down to start, start + 1, … (a draft tree's accepted path; their keys were rotated for those
        positions already, so they move as they are)."""
        check_kept(self.length - start, offsets)
        index = torch.tensor([start + o for o in offsets], dtype=torch.long, device=self.device)
        end = start + len(offsets)
        for store in (self._k, self._v):
            for t in store:
                t[:, :, start:end] = t.index_select(2, index)
        self.length = end
        self.committed_length = min(self.committed_length, start + unmoved(offsets))

    def evict(self, start: int, count: int, rekey) -> None:
        """Drop positions [start, start + count) and move later ones down; `rekey` re-positions moved keys."""
        if start + count > self.length:
            raise ValueError(f"cannot evict {count} tokens from {start} in a cache of {self.length}")
        end = self.length
        for slot in range(self.num_layers):
            k, v = self._k[slot], self._v[slot]
            k[:, :, start:end - count] = rekey(k[:, :, start + count:end].clone())
            v[:, :, start:end - count] = v[:, :, start + count:end].clone()
        self.length -= count
        self.committed_length = min(self.committed_length, start)

    def commit(self) -> None:
        self.committed_length = self.length

    def rollback(self) -> None:
        self.length = self.committed_length

    # -- export / import (store, session files) ---------------------------------------------
    def layer_tensors(self, slot: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length if end is None else end
        return self._k[slot][0, :, start:end], self._v[slot][0, :, start:end]

    def load_layer(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill one layer from stored [kv_heads, T, head_dim] tensors (all layers must get the same T)."""
        t = keys.shape[1]
        self._reserve(t)
        self._k[slot][0, :, :t] = keys.to(self.device, self.dtype)
        self._v[slot][0, :, :t] = values.to(self.device, self.dtype)

    def set_length(self, length: int) -> None:
        self.length = self.committed_length = length

    def clone(self) -> "KVCache":
        """A deep copy up to the current length (used to undo a truncation if a turn fails)."""
        other = KVCache(self.first_layer, self.num_layers, self.kv_heads, self.head_dim, self.dtype,
                        self.device, max(self.length, 1))
        for slot in range(self.num_layers):
            other.load_layer(slot, *self.layer_tensors(slot))
        other.length, other.committed_length = self.length, self.committed_length
        return other

    def wipe(self) -> None:
        """Overwrite the buffers so no plaintext keys/values linger after a turn."""
        for store in (self._k, self._v):
            for t in store:
                t.zero_()
        self.length = self.committed_length = 0
