"""Paged attention and the page pool: exact against a naive per-sequence reference, and isolated."""

from __future__ import annotations

import pytest
import torch

from infemeral.kvcache.paged import PagedBatch, PagedSequence, PagePool, PoolExhausted
from infemeral.model.attention import attend
from infemeral.model.paged_attention import TorchBackend, select_backend, torch_paged_attention

PAGE, KVH, H, D = 16, 2, 6, 8


def naive(q, k, v, scale):
    """q [n, H, D] are the last n positions of k/v [L, KVH, D]; plain softmax attention, causal."""
    n, L = q.shape[0], k.shape[0]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
    allowed = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def scattered_pages(lengths, num_pages=64, seed=0):
    """Random K/V per sequence, written to randomly chosen (non-contiguous) pages of a pool."""
    g = torch.Generator().manual_seed(seed)
    k_pages = torch.randn(num_pages, PAGE, KVH, D, generator=g) * 100  # junk everywhere else
    v_pages = torch.randn(num_pages, PAGE, KVH, D, generator=g) * 100
    order = torch.randperm(num_pages, generator=g).tolist()
    seqs, indptr, indices, last = [], [0], [], []
    for L in lengths:
        n_pages = -(-L // PAGE)
        pages, order = order[:n_pages], order[n_pages:]
        k, v = torch.randn(L, KVH, D, generator=g), torch.randn(L, KVH, D, generator=g)
        for i, p in enumerate(pages):
            chunk = slice(i * PAGE, min(L, (i + 1) * PAGE))
            k_pages[p, : chunk.stop - chunk.start] = k[chunk]
            v_pages[p, : chunk.stop - chunk.start] = v[chunk]
        seqs.append((k, v))
        indices += pages
        indptr.append(indptr[-1] + n_pages)
        last.append(L - (n_pages - 1) * PAGE)
    csr = (torch.tensor(indptr), torch.tensor(indices), torch.tensor(last))
    return seqs, k_pages, v_pages, csr


CASES = {
    "shorter than a page, decode": ([5], [1]),
    "shorter than a page, prefill": ([5], [5]),
    "20 and 180 tokens, decode": ([20, 180], [1, 1]),
    "20 and 180 tokens, prefill + decode": ([20, 180], [20, 1]),
    "exactly one page": ([PAGE], [PAGE]),
    "one page + 1": ([PAGE + 1], [3]),
    "mixed batch": ([1, PAGE, PAGE + 1, 77, 180], [1, 7, PAGE + 1, 1, 40]),
}


@pytest.mark.parametrize("case", CASES)
def test_torch_paged_attention_matches_naive_reference(case):
    lengths, queries = CASES[case]
    seqs, k_pages, v_pages, (kv_indptr, kv_indices, last) = scattered_pages(lengths)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(queries), H, D, generator=g)
    qo_indptr = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    scale = D ** -0.5
    out = torch_paged_attention(q, k_pages, v_pages, qo_indptr, kv_indptr, kv_indices, last, scale)
    for i, (k, v) in enumerate(seqs):
        rows = slice(qo_indptr[i], qo_indptr[i + 1])
        assert (out[rows] - naive(q[rows], k, v, scale)).abs().max() < 1e-4, (case, i)


def test_contiguous_attention_matches_naive_reference():
    g = torch.Generator().manual_seed(2)
    k, v, q = torch.randn(40, KVH, D, generator=g), torch.randn(40, KVH, D, generator=g), torch.randn(7, H, D, generator=g)
    out = attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], D ** -0.5)[0]
    assert (out - naive(q, k, v, D ** -0.5)).abs().max() < 1e-4


def make_pool(pages=32):
    return PagePool(pages, PAGE, first_layer=3, num_layers=2, kv_heads=KVH, head_dim=D, dtype=torch.float32)


def run_batch(pool, seqs, new, seed):
    """Write new K/V for each sequence through a PagedBatch (as the model's layers do) and attend."""
    g = torch.Generator().manual_seed(seed)
    for s, n in zip(seqs, new):
        s.reserve(s.length + n)
    batch = PagedBatch(pool, seqs, new, TorchBackend())
    total = sum(new)
    k, v = torch.randn(1, KVH, total, D, generator=g), torch.randn(1, KVH, total, D, generator=g)
    q = torch.randn(1, H, total, D, generator=g)
    out = []
    for layer in (3, 4):
        batch.update(k, v, layer)
        out.append(batch.attend(layer, q, D ** -0.5))
    batch.finish()
    return torch.stack(out)


def test_isolation_other_sessions_pages_cannot_leak_in():
    pool = make_pool()
    a, b, c = (PagedSequence(pool) for _ in range(3))
    run_batch(pool, [a, b, c], [20, 35, 3], seed=0)
    reference = run_batch(pool, [a], [1], seed=5)
    a.truncate(1)  # undo the decode step and redo it with poisoned neighbours
    for store in (pool.k, pool.v):
        for t in store:
            t[b.pages] = 1e30
            t[c.pages[0]] = float("nan")
            free = sorted(set(range(pool.num_pages)) - set(a.pages) - set(b.pages) - set(c.pages))
            t[free] = float("nan")
    poisoned = run_batch(pool, [a], [1], seed=5)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, reference)


def test_writes_land_only_in_the_sessions_own_pages():
    pool = make_pool()
    a, b = PagedSequence(pool), PagedSequence(pool)
    run_batch(pool, [a, b], [9, 30], seed=0)
    before = [t.clone() for t in pool.k + pool.v]
    run_batch(pool, [a, b], [PAGE, 1], seed=1)
    owned = set(a.pages) | set(b.pages)
    for old, new in zip(before, pool.k + pool.v):
        differs = old.view(torch.int32) != new.view(torch.int32)  # bitwise: untouched pool memory may hold NaN
        changed = {int(p) for p in differs.flatten(1).any(1).nonzero().flatten()}
        assert changed <= owned
        # and inside owned pages, only the new positions changed
        for seq, start, n in ((a, 9, PAGE), (b, 30, 1)):
            pages, offsets = seq.slots(0, start)
            assert torch.equal(old[pages, offsets], new[pages, offsets])


def test_pool_allocation_release_and_exhaustion():
    pool = make_pool(pages=4)
    a = PagedSequence(pool)
    a.reserve(3 * PAGE)
    assert pool.free_pages == 1
    b = PagedSequence(pool)
    with pytest.raises(PoolExhausted, match="retry"):
        b.reserve(2 * PAGE)
    assert b.pages == [] and pool.free_pages == 1  # a failed reservation takes nothing
    pool.k[0][a.pages] = 7.0
    a.wipe()
    assert pool.free_pages == 4
    assert (pool.k[0] == 7.0).sum() == 0  # freed pages were zeroed
    b.reserve(4 * PAGE)
    assert sorted(b.pages) == [0, 1, 2, 3]


def test_backend_selection():
    assert select_backend("auto", torch.device("cpu"), H, KVH, D, PAGE, torch.float32).name == "torch"
    assert select_backend("torch", torch.device("cpu"), H, KVH, D, PAGE, torch.float32).name == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("flashinfer", torch.device("cpu"), H, KVH, D, PAGE, torch.float32)
    with pytest.raises(ValueError):
        select_backend("magic", torch.device("cpu"), H, KVH, D, PAGE, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer runs on CUDA only")
def test_flashinfer_matches_torch_backend():
    pytest.importorskip("flashinfer")
    dev = torch.device("cuda")
    lengths, queries = CASES["mixed batch"]
    seqs, k_pages, v_pages, (kv_indptr, kv_indices, last) = scattered_pages(lengths)
    q = torch.randn(sum(queries), H, D)
    qo = torch.tensor([0] + torch.tensor(queries).cumsum(0).tolist())
    ref = torch_paged_attention(q, k_pages, v_pages, qo, kv_indptr, kv_indices, last, D ** -0.5)
    backend = select_backend("flashinfer", dev, H, KVH, D, PAGE, torch.float16)

    class Batch:
        qo_indptr, kv_indptr, kv_indices, kv_last_page_len = qo.to(dev), kv_indptr.to(dev), kv_indices.to(dev), last.to(dev)

    out = backend.run(q.half().to(dev), k_pages.half().to(dev), v_pages.half().to(dev), Batch, D ** -0.5)
    assert (out.float().cpu() - ref).abs().max() < 2e-2


@pytest.mark.parametrize("table", [[3, 4, 5, 6], [3, 5, 4, 6], [6, 5, 4, 3], [0, 2, 1, 3]])
def test_block_table_order_is_respected(table):
    """A table whose first and last pages look like a contiguous run ([3, 5, 4, 6]) must still be read in
    table order: only a truly contiguous run may be read as one slice of the pool. (Every position is a
    query, so the causal mask makes the order of the keys matter.)"""
    g = torch.Generator().manual_seed(3)
    length = 3 * PAGE + 5
    k, v = torch.randn(length, KVH, D, generator=g), torch.randn(length, KVH, D, generator=g)
    k_pages, v_pages = torch.randn(8, PAGE, KVH, D, generator=g), torch.randn(8, PAGE, KVH, D, generator=g)
    for i, p in enumerate(table):
        chunk = slice(i * PAGE, min(length, (i + 1) * PAGE))
        k_pages[p, : chunk.stop - chunk.start] = k[chunk]
        v_pages[p, : chunk.stop - chunk.start] = v[chunk]

    class Batch:  # the CSR fields a PagedBatch carries, for one sequence prefilled in one step
        qo_indptr = torch.tensor([0, length], dtype=torch.int32)
        kv_indptr = torch.tensor([0, len(table)], dtype=torch.int32)
        kv_indices = torch.tensor(table, dtype=torch.long)
        kv_last_page_len = torch.tensor([length - 3 * PAGE], dtype=torch.int32)

    q = torch.randn(length, H, D, generator=g)
    backend = TorchBackend()
    backend.plan(Batch)
    out = backend.run(q, k_pages, v_pages, Batch, D ** -0.5)
    assert (out - naive(q, k, v, D ** -0.5)).abs().max() < 1e-4
