"""The server's shared page pool and each session's view of it (a block table).

All active sessions' keys/values live in one pool per layer, shaped
[num_pages, page_size, kv_heads, head_dim] (FlashInfer's NHD layout). A session
owns a list of pages (its block table); its token t lives in page
pages[t // page_size] at offset t % page_size. Pages are zeroed when they are
returned, so no plaintext outlives its session, and never shared between
sessions (no prefix sharing: deduplication would tell the server that two
sessions hold the same text).

Quotas keep an admitted turn from being starved half-way through its answer:
when a turn opens it is *granted* the pages it may still need, and the pool
admits a new grant only while its free pages, less every page promised to a
grant but not yet taken, cover it. A turn draws on its own grant first, so it
never waits for pages within it; pages it frees (a truncation, an eviction)
go back to its grant. Growth past the grant comes only from pages nobody was
promised, and may be refused.
"""

from __future__ import annotations

import heapq
import threading
import time

import torch

from infemeral.errors import ResourceExhausted


class PoolExhausted(ResourceExhausted):
    """No free pages; the message carries a retry hint."""

    def __init__(self, message: str, retry_after: float = 2.0):
        super().__init__(message)
        self.retry_after = retry_after


class PagePool:
    def __init__(self, num_pages: int, page_size: int, first_layer: int, num_layers: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_pages, self.page_size = num_pages, page_size
        self.first_layer, self.num_layers = first_layer, num_layers
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_pages, page_size, kv_heads, head_dim)
        # torch.empty: memory is only touched as pages are used; attention never reads past a sequence's length.
        self.k = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._free = list(range(num_pages))  # a heap: lowest ids first keeps sequences mostly contiguous
        self._promised = 0  # free pages set aside for grants (invariant: never more than the free pages)
        self._cond = threading.Condition()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def promised_pages(self) -> int:
        """Free pages that belong to the grants of open turns."""
        return self._promised

    @property
    def spare_pages(self) -> int:
        """Free pages nobody was promised: what a new grant, or growth past a grant, may take."""
        with self._cond:
            return len(self._free) - self._promised

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def grant(self, n: int, wait: float = 0.0) -> None:
        """Promise n pages to one turn, waiting up to `wait` seconds for other turns to give some back."""
        if n > self.num_pages:
            raise PoolExhausted(f"a turn needs up to {n} KV pages but the whole pool has {self.num_pages}; "
                                "raise kv_pool_tokens or lower max_context", retry_after=0)
        deadline = time.monotonic() + wait
        with self._cond:
            while len(self._free) - self._promised < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PoolExhausted(f"the server's KV cache pool is full (its {self.num_pages} pages are in use "
                                        "or reserved by running turns); retry in a few seconds")
                self._cond.wait(left)
            self._promised += n

    def take(self, n: int, granted: int = 0) -> list[int]:
        """Take n pages, `granted` of them from the caller's grant; the rest only from spare pages."""
        with self._cond:
            if n - granted > len(self._free) - self._promised:
                raise PoolExhausted("the server's KV cache pool has no spare pages for this growth; "
                                    "retry in a few seconds")
            self._promised -= granted
            return [heapq.heappop(self._free) for _ in range(n)]

    def release(self, pages: list[int], regrant: int = 0) -> None:
        """Wipe pages and return them to the pool; `regrant` of them stay promised to their turn's grant
        (negative: also cancel that many unused promised pages)."""
        if pages:
            index = torch.tensor(pages, device=self.device)
            for store in (self.k, self.v):
                for t in store:
                    t.index_fill_(0, index, 0)
        with self._cond:
            for p in pages:
                heapq.heappush(self._free, p)
            self._promised += regrant
            self._cond.notify_all()


class PagedSequence:
    """One session's KV in the pool; a `KVSequence` like the contiguous KVCache, for the store and the window."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.first_layer, self.num_layers = pool.first_layer, pool.num_layers
        self.kv_heads, self.head_dim, self.dtype = pool.kv_heads, pool.head_dim, pool.dtype
        self.pages: list[int] = []
        self.quota_pages = 0  # pages this sequence was granted: it can always hold this many
        self.length = 0
        self.committed_length = 0

    # -- pages ------------------------------------------------------------------------------------
    @property
    def quota_tokens(self) -> int:
        return self.quota_pages * self.pool.page_size

    @property
    def unused_quota(self) -> int:
        """Pages of the grant not taken yet (promised to this sequence in the pool)."""
        return max(0, self.quota_pages - len(self.pages))

    def grant(self, tokens: int, wait: float = 0.0) -> None:
        """Reserve room for `tokens` positions in the pool, waiting up to `wait` seconds (at most once)."""
        if self.quota_pages or self.pages:
            raise RuntimeError("a sequence is granted its quota once, before it takes pages")
        pages = self.pool.pages_for(tokens)
        self.pool.grant(pages, wait)
        self.quota_pages = pages

    def reserve(self, tokens: int) -> None:
        """Make sure pages exist for `tokens` positions: from the grant first, then from spare pages."""
        missing = self.pool.pages_for(tokens) - len(self.pages)
        if missing > 0:
            self.pages += self.pool.take(missing, granted=min(missing, self.unused_quota))

    def _trim(self) -> None:
        keep = self.pool.pages_for(self.length)
        if len(self.pages) > keep:
            before = self.unused_quota
            extra, self.pages = self.pages[keep:], self.pages[:keep]
            self.pool.release(extra, regrant=self.unused_quota - before)

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, offsets) of positions [start, end)."""
        pos = torch.arange(start, end)
        table = torch.tensor(self.pages, dtype=torch.long)
        return table[pos // self.pool.page_size].to(self.pool.device), (pos % self.pool.page_size).to(self.pool.device)

    def page_table(self) -> torch.Tensor:
        return torch.tensor(self.pages[: self.pool.pages_for(self.length)], dtype=torch.long, device=self.pool.device)

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write [kv_heads, n, head_dim] keys/values at positions start.. (pages must be reserved)."""
        pages, offsets = self.slots(start, start + keys.shape[1])
        self.pool.k[slot][pages, offsets] = keys.transpose(0, 1).to(self.dtype)
        self.pool.v[slot][pages, offsets] = values.transpose(0, 1).to(self.dtype)

    # -- the KVSequence interface used by the store, the window and the engine ----------------------------
    def layer_tensors(self, slot: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length if end is None else end
        pages, offsets = self.slots(start, end)
        return (self.pool.k[slot][pages, offsets].transpose(0, 1),
                self.pool.v[slot][pages, offsets].transpose(0, 1))

    def load_layer(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.reserve(keys.shape[1])
        self.write(slot, 0, keys.to(self.pool.device), values.to(self.pool.device))

    def set_length(self, length: int) -> None:
        self.length = self.committed_length = length

    def truncate(self, tokens: int) -> None:
        if tokens > self.length:
            raise ValueError(f"cannot drop {tokens} tokens from a cache of {self.length}")
        self.length -= tokens
        self.committed_length = min(self.committed_length, self.length)
        self._trim()

    def evict(self, start: int, count: int, rekey) -> None:
        """Drop positions [start, start + count), move later ones down (re-keyed), free whole pages."""
        if start + count > self.length:
            raise ValueError(f"cannot evict {count} tokens from {start} in a cache of {self.length}")
        end = self.length
        for slot in range(self.num_layers):
            k, v = self.layer_tensors(slot, start + count, end)
            self.write(slot, start, rekey(k.clone()), v.clone())
        self.length -= count
        self.committed_length = min(self.committed_length, start)
        self._trim()

    def commit(self) -> None:
        self.committed_length = self.length

    def wipe(self) -> None:
        """Return every page (zeroed) to the pool, and whatever is left of the grant."""
        unused, pages = self.unused_quota, self.pages
        self.pages, self.quota_pages = [], 0
        self.length = self.committed_length = 0
        self.pool.release(pages, regrant=-unused)


class PagedBatch:
    """One forward pass over new tokens of several sessions: where they are written, what they read.

    Passed to the model's attention modules both as the cache (`update` writes
    the new keys/values into each session's own pages) and as `paged=` (the
    attention function reads back through the backend with the CSR arrays).
    `kv_sums` lets the model runner screen everything written for inf/NaN
    without a device sync per layer.
    """

    def __init__(self, pool: PagePool, sequences: list[PagedSequence], new_tokens: list[int], backend):
        self.pool, self.sequences, self.new_tokens, self.backend = pool, sequences, new_tokens, backend
        page = pool.page_size
        qo, kvp, indices, last, pages, offsets, positions = [0], [0], [], [], [], [], []
        for seq, n in zip(sequences, new_tokens):
            total = seq.length + n
            used = pool.pages_for(total)
            if used > len(seq.pages):
                raise RuntimeError("pages must be reserved before a sequence joins a batch")
            indices += seq.pages[:used]
            kvp.append(kvp[-1] + used)
            last.append(total - (used - 1) * page)
            qo.append(qo[-1] + n)
            pages += [seq.pages[t // page] for t in range(seq.length, total)]
            offsets += [t % page for t in range(seq.length, total)]
            positions += range(seq.length, total)
        # The CSR description stays on the host (int32, as FlashInfer's plan() reads it there); only what the
        # layers index with goes to the device, in one transfer each.
        self.qo_indptr = torch.tensor(qo, dtype=torch.int32)
        self.kv_indptr = torch.tensor(kvp, dtype=torch.int32)
        self.kv_indices = torch.tensor(indices, dtype=torch.int32)
        self.kv_last_page_len = torch.tensor(last, dtype=torch.int32)
        dev = pool.device
        self.write_pages = torch.tensor(pages, dtype=torch.long).to(dev)
        self.write_offsets = torch.tensor(offsets, dtype=torch.long).to(dev)
        self.positions = torch.tensor(positions, dtype=torch.long).to(dev).unsqueeze(0)
        backend.plan(self)
        self.kv_sums: list[torch.Tensor] = []  # per layer, in float32: inf/NaN in anything written shows here

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        slot = layer_idx - self.pool.first_layer
        self.pool.k[slot][self.write_pages, self.write_offsets] = key_states[0].transpose(0, 1)
        self.pool.v[slot][self.write_pages, self.write_offsets] = value_states[0].transpose(0, 1)
        self.kv_sums += [key_states.sum(dtype=torch.float32), value_states.sum(dtype=torch.float32)]
        return key_states, value_states

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float, sliding_window=None) -> torch.Tensor:
        slot = layer_idx - self.pool.first_layer
        out = self.backend.run(query[0].transpose(0, 1).contiguous(), self.pool.k[slot], self.pool.v[slot], self,
                               scaling, sliding_window)
        return out.unsqueeze(0)

    def finish(self) -> None:
        for seq, n in zip(self.sequences, self.new_tokens):
            seq.length += n
