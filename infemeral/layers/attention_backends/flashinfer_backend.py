"""FlashInfer's paged kernels on CUDA in bf16 or fp16 (it has no float32 kernels): the decode wrapper for
decode-only batches, the prefill (append) wrapper otherwise, with a custom mask where a sequence's new tokens
are a draft tree."""

from __future__ import annotations

import torch

from infemeral.layers.attention_backends.batch_shape import BatchShape
from infemeral.layers.draft_tree import tree_attention_mask

FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)  # it has no float32 kernels


def zeroed_workspace(nbytes: int, device: torch.device) -> torch.Tensor:
    """FlashInfer's float workspace, which its wrappers require zeroed before their first use (split-k partial
    results live there; uninitialised memory is not a valid start)."""
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def host_int32(values, pin: bool) -> torch.Tensor:
    """An int32 CPU tensor (pinned on a CUDA machine): FlashInfer's plan() reads these on the host anyway,
    so passing device tensors would cost a synchronising copy back every step."""
    t = torch.as_tensor(values, dtype=torch.int32, device="cpu")
    return t.pin_memory() if pin else t


class FlashInferBackend:
    """FlashInfer's paged kernels (CUDA only). One plan per batch (per sliding-window size), reused by every
    layer: the decode wrapper when every sequence adds one token (tensor cores when >= 4 query heads share a
    KV head), the prefill/append wrapper for anything else. A batch holding a draft tree is planned with a custom
    mask (`custom_mask`) for every sequence, causal ones for the chains."""

    name = "flashinfer"
    # The custom-mask plan below verifies draft trees only once the start-up self-check's tree case has matched
    # the torch backend on this GPU (self_check.checked_trees sets it); until then chains only
    # (ServerInfo.draft_trees).
    draft_trees = False
    WORKSPACE_BYTES = 128 << 20
    TENSOR_CORE_GROUP = 4                       # query heads per KV head from which tensor cores pay off
    CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8, 16)  # group sizes the CUDA-core decode kernel is built for

    def __init__(self, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, dtype: torch.dtype, module=None):
        if module is None:
            import flashinfer as module
        self.fi, self.device, self.dtype = module, torch.device(device), dtype
        self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size = (num_qo_heads, num_kv_heads, head_dim,
                                                                               page_size)
        group = num_qo_heads // num_kv_heads
        self.use_tensor_cores = group >= self.TENSOR_CORE_GROUP or group not in self.CUDA_CORE_GROUPS
        self.workspace = zeroed_workspace(self.WORKSPACE_BYTES, self.device)
        self._wrappers: dict = {}  # (kind, window) -> wrapper; each holds its own plan
        self._batch = self._shape = self._host = self._mask = None
        self._planned: set = set()

    def _wrapper(self, kind: str, window: int | None):
        key = (kind, window)
        if key not in self._wrappers:
            if kind == "decode":
                self._wrappers[key] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
            else:
                self._wrappers[key] = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self._wrappers[key]

    def plan(self, batch) -> None:
        """Take the batch's index arrays to the host once; the kernels are planned at the first layer's call,
        when the softmax scale and the layer's sliding window are known."""
        shape = BatchShape.from_csr(batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
                                    self.page_size)
        pin = self.device.type == "cuda"
        self._batch, self._shape, self._planned = batch, shape, set()
        self._host = {name: host_int32(getattr(shape, name), pin)
                      for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")}
        self._mask = custom_mask(shape, getattr(batch, "trees", None), self.device)

    def kind(self) -> str:
        return "decode" if self._shape.is_decode and self._mask is None else "prefill"

    def _plan(self, sm_scale: float, window: int | None):
        kind, h = self.kind(), self._host
        wrapper = self._wrapper(kind, window)
        common = dict(window_left=(window - 1) if window else -1, sm_scale=sm_scale, q_data_type=self.dtype,
                      kv_data_type=self.dtype)
        if kind == "decode":
            wrapper.plan(h["kv_indptr"], h["kv_indices"], h["kv_last_page_len"], self.num_qo_heads,
                         self.num_kv_heads, self.head_dim, self.page_size, **common)
        elif self._mask is not None:  # causal is ignored where a custom mask is given
            if window:
                raise ValueError("a draft tree's mask and a sliding window do not combine")
            wrapper.plan(h["qo_indptr"], h["kv_indptr"], h["kv_indices"], h["kv_last_page_len"], self.num_qo_heads,
                         self.num_kv_heads, self.head_dim, self.page_size, custom_mask=self._mask, causal=False,
                         **common)
        else:
            wrapper.plan(h["qo_indptr"], h["kv_indptr"], h["kv_indices"], h["kv_last_page_len"], self.num_qo_heads,
                         self.num_kv_heads, self.head_dim, self.page_size, causal=True, **common)
        self._planned.add((window, sm_scale))
        return wrapper

    def run(self, q, k_pages, v_pages, batch, sm_scale, sliding_window=None):
        if batch is not self._batch:
            raise RuntimeError("attention ran on a batch that was not planned")
        window = sliding_window or None
        if (window, sm_scale) in self._planned:
            wrapper = self._wrapper(self.kind(), window)
        else:
            wrapper = self._plan(sm_scale, window)
        return wrapper.run(q, (k_pages, v_pages))


def custom_mask(shape: BatchShape, trees, device: torch.device) -> torch.Tensor | None:
    """FlashInfer's flattened custom mask for a batch holding a draft tree: each sequence's [q_len, kv_len] mask
    (True: the query reads the key), row-major, one after another in batch order — a tree's from its parents,
    a chain's causal (its queries are the last q_len positions). None where the batch holds no tree."""
    if not trees or all(t is None for t in trees):
        return None
    parts = []
    for i, tree in enumerate(trees):
        q, kv = shape.q_len(i), shape.kv_len(i)
        mask = (torch.ones(q, kv, dtype=torch.bool).tril(kv - q) if tree is None
                else tree_attention_mask(tree, kv - q))
        parts.append(mask.flatten())
    return torch.cat(parts).to(device)
