"""Paged attention in plain PyTorch: runs everywhere.

Sequences with few new tokens (decode, speculative verification) and short caches
run together: one gather of their pages into a padded [B, KVH, L, D] block,
positions past each sequence's length zeroed, one SDPA with a
length/causal/window mask. Prefills and long caches (where the attention itself
outweighs a call's overhead) run one SDPA each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from infemeral.layers.attention import attend
from infemeral.layers.attention_backends.batch_shape import BatchShape
from infemeral.layers.draft_tree import tree_attention_mask

MAX_PADDED_QUERY = 16       # sequences with at most this many new tokens share padded SDPAs...
IN_PLACE_MIN_TOKENS = 256   # ...unless their cache is this long: then one SDPA each, over their exact length


@dataclass
class PaddedGroup:
    """Sequences of the same padded length and the same number of new tokens, attended in one SDPA.

    Each sequence's page list is padded with its *own* last page (so no other session's
    page is ever read); positions at or past its length are zeroed after the gather (the
    pool is uninitialised memory, so even a sequence's own last page may hold NaN there)
    and masked out of the scores. The padded length depends only on the sequence's own
    length, and SDPA's math kernel on contiguous inputs computes each batch row the same way
    whatever the batch size, so a session gets bit for bit the same result whichever sessions
    share its batch (or none). Neither half of that is free: measured with 2 threads on an
    AVX-512 CPU, the fused CPU kernel splits its work by batch size, and the math kernel's
    matmuls take another path for strided inputs; either way rows differ by ~1e-7 between a
    batch of 3 and the same row alone. Groups hold short caches (below IN_PLACE_MIN_TOKENS),
    where the math kernel and the copies cost little."""

    members: list[int]             # sequence indices in the batch
    table: torch.Tensor            # [B, padded_pages] page ids
    kv_lens: torch.Tensor          # [B]
    min_kv_len: int
    q_len: int                     # new tokens of every member
    q_rows: torch.Tensor | None    # [B * q_len] rows of q (None: the whole batch, in order, one token each)
    masks: dict = field(default_factory=dict)  # (window, group size) -> bool mask [B, 1, G * q_len, L]

    def mask(self, window: int | None, group: int, length: int) -> torch.Tensor:
        key = (window, group)
        if key not in self.masks:
            dev = self.kv_lens.device
            key_pos = torch.arange(length, device=dev)                                            # [L]
            query_pos = (self.kv_lens - self.q_len)[:, None] + torch.arange(self.q_len, device=dev)  # [B, n]
            allowed = key_pos[None, None, :] <= query_pos[:, :, None]                             # causal, < length
            if window is not None:
                allowed &= key_pos[None, None, :] > query_pos[:, :, None] - window
            self.masks[key] = allowed.repeat(1, group, 1).unsqueeze(1)                            # rows g * n + i
        return self.masks[key]

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, sm_scale: float,
            window: int | None) -> torch.Tensor:
        """q [T, H, D] -> the members' output rows [B * q_len, H, D], in member order."""
        b, num_pages = self.table.shape
        page, kvh, d = k_pages.shape[1:]
        h, n = q.shape[1], self.q_len
        g, length = h // kvh, num_pages * page
        flat = self.table.flatten()
        keys = k_pages.index_select(0, flat).view(b, length, kvh, d)
        values = v_pages.index_select(0, flat).view(b, length, kvh, d)
        if self.min_kv_len < length:  # zero everything past each sequence's length: garbage must not reach SDPA
            pad = torch.arange(self.min_kv_len, length, device=flat.device)[None, :] >= self.kv_lens[:, None]
            keys[:, self.min_kv_len:].masked_fill_(pad[:, :, None, None], 0)
            values[:, self.min_kv_len:].masked_fill_(pad[:, :, None, None], 0)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)                               # [B, KVH, L, D]
        rows = q if self.q_rows is None else q.index_select(0, self.q_rows)                      # [B * n, H, D]
        query = rows.view(b, n, h, d).transpose(1, 2).reshape(b, kvh, g * n, d)  # head kvh*g+j, row j*n+i
        with sdpa_kernel(SDPBackend.MATH):  # batch-invariant only so: see the class docstring
            o = F.scaled_dot_product_attention(query.contiguous(), keys.contiguous(), values.contiguous(),
                                               attn_mask=self.mask(window, g, length), scale=sm_scale)
        return o.view(b, h, n, d).transpose(1, 2).reshape(b * n, h, d)


class TorchPlan:
    """How one batch is attended, worked out once and reused by every layer.

    Where a sequence goes depends only on the sequence itself (never on who shares the
    batch), which keeps batched outputs identical to solo ones: sequences with more than
    MAX_PADDED_QUERY new tokens, or at least IN_PLACE_MIN_TOKENS of cache, get an SDPA of
    their own over exactly their length (their pages read in place when contiguous); the
    others are grouped by (padded length, new tokens) into padded batches. A sequence whose new tokens are a
    draft tree (`trees[i]`, its parents) gets an SDPA of its own with the tree's mask."""

    def __init__(self, shape: BatchShape, device: torch.device, trees: list[list[int] | None] | None = None):
        self.shape, self.device = shape, device
        n = shape.num_sequences
        self.trees = list(trees) if trees is not None else [None] * n
        self.singles = [i for i in range(n) if shape.q_len(i) > MAX_PADDED_QUERY
                        or shape.kv_len(i) >= IN_PLACE_MIN_TOKENS or self.trees[i] is not None]
        keyed: dict[tuple[int, int], list[int]] = {}
        single = set(self.singles)
        for i in range(n):
            if i not in single:
                keyed.setdefault((self.padded_pages(shape.num_pages(i)), shape.q_len(i)), []).append(i)
        self.groups = [self._group(members, pages) for (pages, _), members in sorted(keyed.items())]
        self.whole_batch_is_one_group = (len(self.groups) == 1 and not self.singles
                                         and self.groups[0].q_rows is None)

    def padded_pages(self, num_pages: int) -> int:
        """Round a sequence's page count up to a multiple of 32 tokens' worth: few distinct group shapes."""
        step = max(1, 32 // self.shape.page_size)
        return -(-num_pages // step) * step

    def _group(self, members: list[int], num_pages: int) -> PaddedGroup:
        s, dev = self.shape, self.device
        table = [s.pages(i) + [s.pages(i)[-1]] * (num_pages - s.num_pages(i)) for i in members]
        kv_lens = [s.kv_len(i) for i in members]
        q_len = s.q_len(members[0])
        q_rows = None
        if not (members == list(range(s.num_sequences)) and q_len == 1):
            q_rows = torch.tensor([s.qo_indptr[i] + j for i in members for j in range(q_len)], dtype=torch.long,
                                  device=dev)
        return PaddedGroup(members, torch.tensor(table, dtype=torch.long, device=dev),
                           torch.tensor(kv_lens, dtype=torch.long, device=dev), min(kv_lens), q_len, q_rows)

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, sm_scale: float,
            sliding_window: int | None = None) -> torch.Tensor:
        """q [T, H, D], pages [P, page_size, KVH, D] -> [T, H, D]."""
        if self.whole_batch_is_one_group:
            return self.groups[0].run(q, k_pages, v_pages, sm_scale, sliding_window)
        out = torch.empty_like(q)
        for group in self.groups:
            out.index_copy_(0, group.q_rows, group.run(q, k_pages, v_pages, sm_scale, sliding_window))
        for i in self.singles:
            rows = slice(self.shape.qo_indptr[i], self.shape.qo_indptr[i + 1])
            out[rows] = self._single(i, q[rows], k_pages, v_pages, sm_scale, sliding_window)
        return out

    def _single(self, i: int, q: torch.Tensor, k_pages, v_pages, sm_scale, sliding_window) -> torch.Tensor:
        pages, kv_len = self.shape.pages(i), self.shape.kv_len(i)
        first = pages[0]
        if self.shape.is_contiguous(i):
            k_run, v_run = k_pages[first:first + len(pages)], v_pages[first:first + len(pages)]  # a view, no copy
        else:
            index = torch.tensor(pages, dtype=torch.long, device=k_pages.device)
            k_run, v_run = k_pages.index_select(0, index), v_pages.index_select(0, index)
        k = k_run.flatten(0, 1)[:kv_len].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = v_run.flatten(0, 1)[:kv_len].transpose(0, 1).unsqueeze(0)
        tree = self.trees[i]
        mask = None if tree is None else tree_attention_mask(tree, kv_len - len(tree), k.device)
        return attend(q.transpose(0, 1).unsqueeze(0), k, v, sm_scale, sliding_window, mask)[0]


def torch_paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, qo_indptr: torch.Tensor,
                          kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                          sm_scale: float, sliding_window: int | None = None,
                          trees: list[list[int] | None] | None = None) -> torch.Tensor:
    """q [T, H, D], pages [P, page_size, KVH, D] -> [T, H, D] (plans and runs one batch; `trees`: each
    sequence's draft tree parents, or None for a chain)."""
    shape = BatchShape.from_csr(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, k_pages.shape[1])
    return TorchPlan(shape, k_pages.device, trees).run(q, k_pages, v_pages, sm_scale, sliding_window)


class TorchBackend:
    name = "torch"
    draft_trees = True  # takes a tree mask per sequence

    def __init__(self):
        self._batch = self._plan = None

    def plan(self, batch) -> None:
        """Planned at the first layer's call, where the pool's page size and device are at hand."""
        self._batch, self._plan = batch, None

    def run(self, q, k_pages, v_pages, batch, sm_scale, sliding_window=None):
        if batch is not self._batch:
            raise RuntimeError("attention ran on a batch that was not planned")
        if self._plan is None:
            shape = BatchShape.from_csr(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
                                        k_pages.shape[1])
            self._plan = TorchPlan(shape, k_pages.device, getattr(batch, "trees", None))
        return self._plan.run(q, k_pages, v_pages, sm_scale, sliding_window)
