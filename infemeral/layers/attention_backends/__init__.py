"""Paged attention over the server's pages, for a ragged batch of several sessions: one module per backend.

Backends share FlashInfer's CSR description of a batch (`batch_shape.BatchShape`): `qo_indptr` splits the
batch's query rows by sequence, `kv_indptr`/`kv_indices` list each sequence's
pages, `kv_last_page_len` (1..page_size) says how full its last page is. Each
sequence's queries are its newest positions, so causality is offset by
(kv_len - q_len). A sequence only ever reads the pages its own block table names.
Every backend plans once per batch (on the host, from int32 CPU index arrays) and
reuses the plan in every layer.

* `torch_backend`: plain PyTorch, runs everywhere;
* `flashinfer_backend`: FlashInfer's paged kernels on CUDA in bf16 or fp16;
* `selector.select_backend`: which one a server runs.
"""
