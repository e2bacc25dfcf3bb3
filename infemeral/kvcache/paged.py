"""The server's shared pages: who holds which (`PagePool`), what is in them (`KVPages`), and each session's
view of both (`PagedSequence`, its block table).

The pool counts pages and holds no tensors (as nano-vllm's block manager);
the keys/values of all active sessions live in `KVPages`, one tensor per layer
shaped [num_pages, page_size, kv_heads, head_dim] (FlashInfer's NHD layout). A
session owns a list of pages (its block table); its token t lives in page
pages[t // page_size] at offset t % page_size. Pages are zeroed before they go
back to the pool, so no plaintext outlives its session, and never shared
between sessions (no prefix sharing: deduplication would tell the server that
two sessions hold the same text).

Quotas keep an admitted turn from being starved half-way through its answer:
when a turn opens it is *granted* the pages it may still need, and the pool
admits a new grant only while its free pages, less every page promised to a
grant but not yet taken, cover it. A turn draws on its own grant first, so it
never waits for pages within it; pages it frees (a truncation, an eviction)
go back to its grant. Growth past the grant comes only from pages nobody was
promised, and may be refused.

A grant that does not fit waits (bounded) in line: pages that come back go to
the oldest waiting grant that fits, so a large grant at the head of the line
holds back nobody whose grant fits beside it, and at most `max_waiting`
grants wait at once (past that a grant that does not fit is refused at once).
With API keys, a `PageShare` caps what the turns of one key may hold at once.
"""

from __future__ import annotations

import heapq
import threading
import time

import torch

from infemeral.errors import ResourceExhausted
from infemeral.kvcache.cache import check_kept, unmoved
from infemeral.kvcache.window import unchanged
from infemeral.layers.draft_tree import depths


class PoolExhausted(ResourceExhausted):
    """No free pages; the message carries a retry hint."""

    def __init__(self, message: str, retry_after: float = 2.0):
        super().__init__(message)
        self.retry_after = retry_after


class ShareExhausted(PoolExhausted):
    """The turns of one API key hold all the pages that key may use."""


class PageShare:
    """The pages the turns of one API key hold — for each turn its grant or the pages it took, whichever is
    more — against the most that key may hold. Grants are claimed on turn threads and growth on the engine's
    worker, so it has a lock of its own."""

    def __init__(self, limit_pages: int):
        self.limit_pages = limit_pages
        self.held_pages = 0
        self._lock = threading.Lock()

    def claim(self, n: int) -> None:
        if n <= 0:
            return
        with self._lock:
            if self.held_pages + n > self.limit_pages:
                raise ShareExhausted(f"the turns of this API key hold {self.held_pages} of the {self.limit_pages} KV "
                                     f"pages one key may use and need {n} more; retry when one of its turns has "
                                     "ended (or declare a smaller reserve_tokens)")
            self.held_pages += n

    def give_back(self, n: int) -> None:
        if n > 0:
            with self._lock:
                self.held_pages -= n


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions."""
    return -(-tokens // page_size)


class PagePool:
    """Which pages are free, promised to a turn's grant, or taken; no tensors (see `KVPages`)."""

    def __init__(self, num_pages: int, page_size: int, max_waiting: int | None = None):
        self.num_pages, self.page_size = num_pages, page_size
        self.max_waiting = max_waiting  # most grants that may wait for pages at once (None: no limit)
        self._free = list(range(num_pages))  # a heap: lowest ids first keeps sequences mostly contiguous
        self._promised = 0  # free pages set aside for grants (invariant: never more than the free pages)
        self._waiting: list[list[int]] = []  # grants in line for pages, oldest first: [pages wanted] each
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
        return pages_for(tokens, self.page_size)

    @property
    def num_waiting(self) -> int:
        """Grants waiting in line for pages."""
        with self._cond:
            return len(self._waiting)

    def grant(self, n: int, wait: float = 0.0) -> None:
        """Promise n pages to one turn, waiting up to `wait` seconds, in line, for other turns to give some back."""
        if n > self.num_pages:
            raise PoolExhausted(f"a turn needs up to {n} KV pages but the whole pool has {self.num_pages}; "
                                "raise kv_pool_tokens or lower max_context", retry_after=0)
        deadline = time.monotonic() + wait
        with self._cond:
            ahead = len(self._waiting)
            place = [n]  # this grant's place in line (a list of its own, so `is` tells places apart)
            self._waiting.append(place)
            try:
                while not self._is_served(place):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise PoolExhausted(f"the server's KV cache pool is full (its {self.num_pages} pages are in "
                                            "use or reserved by running turns); retry in a few seconds")
                    if self.max_waiting is not None and ahead >= self.max_waiting:
                        raise PoolExhausted(f"the server's KV cache pool is full and {ahead} turns already wait for "
                                            "pages; retry in a few seconds")
                    ahead = 0  # the limit is checked when a grant joins the line, not while it waits
                    self._cond.wait(left)
                self._promised += n
            finally:
                self._waiting.remove(place)
                self._cond.notify_all()  # whoever is next in line may fit now

    def _is_served(self, place: list[int]) -> bool:
        """First fit in arrival order: the spare pages go to the grants ahead of `place` that fit, then to it."""
        spare = len(self._free) - self._promised
        for other in self._waiting:
            if other is place:
                return place[0] <= spare
            if other[0] <= spare:
                spare -= other[0]
        raise AssertionError("a grant waits in line")

    def take(self, n: int, granted: int = 0) -> list[int]:
        """Take n pages, `granted` of them from the caller's grant; the rest only from spare pages."""
        with self._cond:
            if n - granted > len(self._free) - self._promised:
                raise PoolExhausted("the server's KV cache pool has no spare pages for this growth; "
                                    "retry in a few seconds")
            self._promised -= granted
            return [heapq.heappop(self._free) for _ in range(n)]

    def release(self, pages: list[int], regrant: int = 0) -> None:
        """Return pages (zeroed by their holder: `PagedSequence`) to the pool; `regrant` of them stay promised to
        their turn's grant (negative: also cancel that many unused promised pages)."""
        with self._cond:
            for p in pages:
                heapq.heappush(self._free, p)
            self._promised += regrant
            self._cond.notify_all()


class KVPages:
    """The keys and values in the pages, per served layer; every read and write of them outside a forward pass
    goes through here (a tensor-parallel server's `ShardedKVPages` sends each to the other ranks, which hold
    the other KV heads of the same pages)."""

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

    @property
    def nbytes(self) -> int:
        """Device memory the keys and values take (this process's share of them)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def slots(self, pages: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, offsets) of positions [start, end) of a sequence whose block table is `pages`."""
        pos = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.long)
        return table[pos // self.page_size].to(self.device), (pos % self.page_size).to(self.device)

    def read(self, slot: int, pages: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, end - start, head_dim] of positions [start, end) (a copy)."""
        return self._read(slot, *self.slots(pages, start, end))

    def write(self, slot: int, pages: list[int], start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [kv_heads, n, head_dim] at positions start.. (the pages must be the sequence's)."""
        self._write(slot, *self.slots(pages, start, start + keys.shape[1]), keys, values)

    def move(self, pages: list[int], start: int, end: int, to: int, rekey) -> None:
        """In every layer, move positions [start, end) to `to`.. with their keys passed through `rekey` (a
        window slide: `to` < `start`, so every position is read before it is overwritten)."""
        source, target = self.slots(pages, start, end), self.slots(pages, to, to + end - start)
        for slot in range(self.num_layers):
            k, v = self._read(slot, *source)
            self._write(slot, *target, rekey(k), v)

    def zero(self, pages: list[int]) -> None:
        """Zero whole pages in every layer (pages going back to the pool)."""
        if pages:
            index = torch.tensor(pages, device=self.device)
            for store in (self.k, self.v):
                for t in store:
                    t.index_fill_(0, index, 0)

    def _read(self, slot: int, pages: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[slot][pages, offsets].transpose(0, 1), self.v[slot][pages, offsets].transpose(0, 1)

    def _write(self, slot: int, pages: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor) -> None:
        self.k[slot][pages, offsets] = keys.transpose(0, 1).to(self.dtype)
        self.v[slot][pages, offsets] = values.transpose(0, 1).to(self.dtype)


class PagedSequence:
    """One session's KV: its pages from the pool, their contents in `kv`; a `KVSequence` like the contiguous
    KVCache, for the store and the window."""

    def __init__(self, pool: PagePool, kv: KVPages, share: PageShare | None = None):
        self.pool, self.kv = pool, kv
        self.share = share  # the pages its API key may hold, if the server limits keys
        self.first_layer, self.num_layers = kv.first_layer, kv.num_layers
        self.kv_heads, self.head_dim, self.dtype = kv.kv_heads, kv.head_dim, kv.dtype
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

    @property
    def held_pages(self) -> int:
        """What this sequence counts against its key's share: its grant, or the pages it took if more."""
        return max(self.quota_pages, len(self.pages))

    def grant(self, tokens: int, wait: float = 0.0) -> None:
        """Reserve room for `tokens` positions in the pool, waiting up to `wait` seconds (at most once). A key
        past its share is refused at once: only its own turns could make room."""
        if self.quota_pages or self.pages:
            raise RuntimeError("a sequence is granted its quota once, before it takes pages")
        pages = self.pool.pages_for(tokens)
        self._claim(pages)
        try:
            self.pool.grant(pages, wait)
        except BaseException:
            self._give_back(pages)
            raise
        self.quota_pages = pages

    def reserve(self, tokens: int) -> None:
        """Make sure pages exist for `tokens` positions: from the grant first, then from spare pages."""
        missing = self.pool.pages_for(tokens) - len(self.pages)
        if missing > 0:
            granted = min(missing, self.unused_quota)
            self._claim(missing - granted)
            try:
                self.pages += self.pool.take(missing, granted=granted)
            except BaseException:
                self._give_back(missing - granted)
                raise

    def _trim(self) -> None:
        keep = self.pool.pages_for(self.length)
        if len(self.pages) > keep:
            before, held = self.unused_quota, self.held_pages
            extra, self.pages = self.pages[keep:], self.pages[:keep]
            self.kv.zero(extra)
            self.pool.release(extra, regrant=self.unused_quota - before)
            self._give_back(held - self.held_pages)

    def _claim(self, n: int) -> None:
        if self.share is not None:
            self.share.claim(n)

    def _give_back(self, n: int) -> None:
        if self.share is not None:
            self.share.give_back(n)

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ids, offsets) of positions [start, end)."""
        return self.kv.slots(self.pages, start, end)

    def page_table(self) -> torch.Tensor:
        return torch.tensor(self.pages[: self.pool.pages_for(self.length)], dtype=torch.long, device=self.kv.device)

    def write(self, slot: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write [kv_heads, n, head_dim] keys/values at positions start.. (pages must be reserved)."""
        self.kv.write(slot, self.pages, start, keys, values)

    # -- the KVSequence interface used by the store, the window and the engine ----------------------------
    def layer_tensors(self, slot: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.read(slot, self.pages, start, self.length if end is None else end)

    def load_layer(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.reserve(keys.shape[1])
        self.write(slot, 0, keys.to(self.kv.device), values.to(self.kv.device))

    def set_length(self, length: int) -> None:
        self.length = self.committed_length = length

    def truncate(self, tokens: int) -> None:
        if tokens > self.length:
            raise ValueError(f"cannot drop {tokens} tokens from a cache of {self.length}")
        self.length -= tokens
        self.committed_length = min(self.committed_length, self.length)
        self._trim()

    def keep_positions(self, start: int, offsets: list[int]) -> None:
        """Of the positions from `start` on, keep those at `offsets` (ascending), moved down to start, start + 1,
        … as they are (a draft tree's accepted path), and free the pages past them. Runs of consecutive offsets
        move together; each run's target lies before its source, so nothing is overwritten before it is read."""
        check_kept(self.length - start, offsets)
        j = 0
        while j < len(offsets):
            run = 1
            while j + run < len(offsets) and offsets[j + run] == offsets[j] + run:
                run += 1
            if offsets[j] != j:
                self.kv.move(self.pages, start + offsets[j], start + offsets[j] + run, start + j, unchanged)
            j += run
        self.length = start + len(offsets)
        self.committed_length = min(self.committed_length, start + unmoved(offsets))
        self._trim()

    def evict(self, start: int, count: int, rekey) -> None:
        """Drop positions [start, start + count), move later ones down (re-keyed), free whole pages."""
        if start + count > self.length:
            raise ValueError(f"cannot evict {count} tokens from {start} in a cache of {self.length}")
        self.kv.move(self.pages, start + count, self.length, start, rekey)
        self.length -= count
        self.committed_length = min(self.committed_length, start)
        self._trim()

    def commit(self) -> None:
        self.committed_length = self.length

    def wipe(self) -> None:
        """Return every page (zeroed) to the pool, and whatever is left of the grant."""
        unused, pages, held = self.unused_quota, self.pages, self.held_pages
        self.pages, self.quota_pages = [], 0
        self.length = self.committed_length = 0
        try:
            self.kv.zero(pages)
            self.pool.release(pages, regrant=-unused)
        finally:
            self._give_back(held)


class PagedBatch:
    """One forward pass over new tokens of several sessions: where they are written, what they read.

    Passed to the model's attention modules both as the cache (`update` writes
    the new keys/values into each session's own pages) and as `paged=` (the
    attention function reads back through the backend with the CSR arrays).
    `kv_sums` lets the model runner screen everything written for inf/NaN
    without a device sync per layer.
    """

    def __init__(self, kv: KVPages, sequences: list[PagedSequence], new_tokens: list[int], backend,
                 trees: list[list[int] | None] | None = None):
        """`trees`: per sequence, the parents of a draft tree its new tokens form (draft_tree.py), or None for
        a chain; a tree's rows sit at the sequence's length + their depth and the backend masks them."""
        self.kv, self.sequences, self.new_tokens, self.backend = kv, sequences, new_tokens, backend
        self.trees = list(trees) if trees is not None else [None] * len(sequences)
        page = kv.page_size
        qo, kvp, indices, last, pages, offsets, positions = [0], [0], [], [], [], [], []
        for seq, n, tree in zip(sequences, new_tokens, self.trees):
            total = seq.length + n
            used = pages_for(total, page)
            if used > len(seq.pages):
                raise RuntimeError("pages must be reserved before a sequence joins a batch")
            indices += seq.pages[:used]
            kvp.append(kvp[-1] + used)
            last.append(total - (used - 1) * page)
            qo.append(qo[-1] + n)
            pages += [seq.pages[t // page] for t in range(seq.length, total)]
            offsets += [t % page for t in range(seq.length, total)]
            positions += range(seq.length, total) if tree is None else [seq.length + d for d in depths(tree)]
        # The CSR description stays on the host (int32, as FlashInfer's plan() reads it there); only what the
        # layers index with goes to the device, in one transfer each.
        self.qo_indptr = torch.tensor(qo, dtype=torch.int32)
        self.kv_indptr = torch.tensor(kvp, dtype=torch.int32)
        self.kv_indices = torch.tensor(indices, dtype=torch.int32)
        self.kv_last_page_len = torch.tensor(last, dtype=torch.int32)
        dev = kv.device
        self.write_pages = torch.tensor(pages, dtype=torch.long).to(dev)
        self.write_offsets = torch.tensor(offsets, dtype=torch.long).to(dev)
        self.positions = torch.tensor(positions, dtype=torch.long).to(dev).unsqueeze(0)
        backend.plan(self)
        self.kv_sums: list[torch.Tensor] = []  # per layer, in float32: inf/NaN in anything written shows here

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        slot = layer_idx - self.kv.first_layer
        self.kv.k[slot][self.write_pages, self.write_offsets] = key_states[0].transpose(0, 1)
        self.kv.v[slot][self.write_pages, self.write_offsets] = value_states[0].transpose(0, 1)
        self.kv_sums += [key_states.sum(dtype=torch.float32), value_states.sum(dtype=torch.float32)]
        return key_states, value_states

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float, sliding_window=None) -> torch.Tensor:
        slot = layer_idx - self.kv.first_layer
        out = self.backend.run(query[0].transpose(0, 1).contiguous(), self.kv.k[slot], self.kv.v[slot], self,
                               scaling, sliding_window)
        return out.unsqueeze(0)

    def finish(self) -> None:
        for seq, n in zip(self.sequences, self.new_tokens):
            seq.length += n
