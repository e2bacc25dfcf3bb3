"""Which attention backend a server runs: FlashInfer where it can, plain PyTorch everywhere else."""

from __future__ import annotations

import logging

import torch

from infemeral.layers.attention_backends.flashinfer_backend import FLASHINFER_DTYPES, FlashInferBackend
from infemeral.layers.attention_backends.torch_backend import TorchBackend

log = logging.getLogger(__name__)


def select_backend(name: str, device: torch.device, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   page_size: int, dtype: torch.dtype):
    """`auto` picks FlashInfer on CUDA in bf16 or fp16 when it imports, else plain PyTorch (saying why)."""
    if name not in ("auto", "torch", "flashinfer"):
        raise ValueError(f"attention backend must be auto, torch or flashinfer, not {name!r}")
    if name == "torch":
        return TorchBackend()
    if device.type != "cuda":
        if name == "flashinfer":
            raise ValueError("attention backend 'flashinfer' needs a CUDA device")
        return TorchBackend()
    if dtype not in FLASHINFER_DTYPES:
        dtype_name = str(dtype).removeprefix("torch.")
        if name == "flashinfer":
            raise ValueError(f"attention backend 'flashinfer' has no {dtype_name} kernels; use --dtype bfloat16 or "
                             "float16, or --attention-backend torch")
        log.info("FlashInfer has no %s kernels; using the PyTorch paged attention", dtype_name)
        return TorchBackend()
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - a broken CUDA toolkit fails the import with OSError, RuntimeError, ...
        cause = f"{type(e).__name__}: {e}"
        missing = isinstance(e, ModuleNotFoundError) and e.name == "flashinfer"  # not one of its own imports
        if name == "flashinfer":
            hint = "`pip install infemeral[cuda]`" if missing else "a working FlashInfer"
            raise ValueError(f"attention backend 'flashinfer' cannot import flashinfer ({cause}); it needs {hint}, "
                             "or use --attention-backend torch") from e
        if missing:
            log.info("FlashInfer is not installed; using the PyTorch paged attention")
        else:
            log.warning("FlashInfer failed to import (%s); using the PyTorch paged attention", cause)
        return TorchBackend()
    return FlashInferBackend(device, num_qo_heads, num_kv_heads, head_dim, page_size, dtype, module=flashinfer)
