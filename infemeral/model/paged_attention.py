"""Paged attention over the server's page pool, for a ragged batch of several sessions.

Backends share FlashInfer's CSR description of a batch: `qo_indptr` splits the
batch's query rows by sequence, `kv_indptr`/`kv_indices` list each sequence's
pages, `kv_last_page_len` says how full its last page is. Each sequence's
queries are its newest positions, so causality is offset by (kv_len - q_len).
A sequence only ever reads the pages its own block table names.

* `torch`: plain PyTorch (gather the sequence's pages, SDPA); runs everywhere.
* `flashinfer`: FlashInfer's BatchPrefillWithPagedKVCacheWrapper on CUDA.
"""

from __future__ import annotations

import logging

import torch

from infemeral.model.attention import attend

log = logging.getLogger(__name__)


def torch_paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, qo_indptr: torch.Tensor,
                          kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                          sm_scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q [T, H, D], pages [P, page_size, KVH, D] -> [T, H, D]."""
    page_size = k_pages.shape[1]
    out = torch.empty_like(q)
    qo, kvp = qo_indptr.tolist(), kv_indptr.tolist()
    last = kv_last_page_len.tolist()
    for i in range(len(qo) - 1):
        pages = kv_indices[kvp[i]:kvp[i + 1]]
        kv_len = (len(pages) - 1) * page_size + last[i]
        first = int(pages[0])
        if int(pages[-1]) - first == len(pages) - 1 and torch.equal(pages, torch.arange(first, first + len(pages),
                                                                                        device=pages.device)):
            k_run, v_run = k_pages[first:first + len(pages)], v_pages[first:first + len(pages)]  # a view, no copy
        else:
            k_run, v_run = k_pages.index_select(0, pages), v_pages.index_select(0, pages)
        k = k_run.flatten(0, 1)[:kv_len].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = v_run.flatten(0, 1)[:kv_len].transpose(0, 1).unsqueeze(0)
        qi = q[qo[i]:qo[i + 1]].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        out[qo[i]:qo[i + 1]] = attend(qi, k, v, sm_scale, sliding_window)[0]
    return out


class TorchBackend:
    name = "torch"

    def plan(self, batch) -> None:
        pass

    def run(self, q, k_pages, v_pages, batch, sm_scale, sliding_window=None):
        return torch_paged_attention(q, k_pages, v_pages, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                                     batch.kv_last_page_len, sm_scale, sliding_window)


class FlashInferBackend:
    """FlashInfer's batched prefill/append kernel over the paged pool (CUDA only)."""

    name = "flashinfer"

    def __init__(self, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype):
        import flashinfer

        self.workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self.dtype = dtype
        self._planned = None

    def plan(self, batch) -> None:
        self._planned = None  # planned lazily: sm_scale and window come with the first layer's call

    def run(self, q, k_pages, v_pages, batch, sm_scale, sliding_window=None):
        key = (id(batch), sm_scale, sliding_window)
        if self._planned != key:
            h, kvh, d, page = self.shape
            self.wrapper.plan(batch.qo_indptr.int(), batch.kv_indptr.int(), batch.kv_indices.int(),
                              batch.kv_last_page_len.int(), h, kvh, d, page, causal=True, sm_scale=sm_scale,
                              window_left=(sliding_window - 1) if sliding_window else -1,
                              q_data_type=self.dtype, kv_data_type=self.dtype)
            self._planned = key
        return self.wrapper.run(q, (k_pages, v_pages))


def select_backend(name: str, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, dtype: torch.dtype):
    """`auto` picks FlashInfer on CUDA when it is installed, else plain PyTorch."""
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"attention backend must be auto, torch or flashinfer, not {name!r}")
    if name in ("auto", "flashinfer") and device.type == "cuda":
        try:
            return FlashInferBackend(device, num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
        except ImportError:
            if name == "flashinfer":
                raise ValueError("attention backend 'flashinfer' needs `pip install infemeral[cuda]`") from None
            log.info("FlashInfer is not installed; using the PyTorch paged attention")
    elif name == "flashinfer":
        raise ValueError("attention backend 'flashinfer' needs a CUDA device")
    return TorchBackend()
