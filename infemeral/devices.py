"""Which torch device and dtype the settings name ("auto" resolved), and what this CPU computes natively, without
the model's code: the server's start-up checks read them before the layers' modules are imported, and the
laptop's half and the head's training choose by the same rules."""

from __future__ import annotations

import functools

import torch

AUTO = ("cuda", "cpu")  # "auto": CUDA where there is one, else the CPU (the laptop's half also tries Apple's MPS)


def is_available(kind: str) -> bool:
    """Whether torch can run on a device of this kind ("cpu", "cuda" or "mps") here."""
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    return False


def resolve_device(device: str, auto: tuple[str, ...] = AUTO) -> torch.device:
    """`device` as a torch device; "auto": the first kind in `auto` (which ends with "cpu") this machine has."""
    if device == "auto":
        return torch.device(next(kind for kind in auto if is_available(kind)))
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, not {dtype!r}") from None


@functools.cache
def native_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` products natively (oneDNN's check: AVX-512 BF16 or AMX for bfloat16,
    AVX-512 FP16 or AMX-FP16 for float16); float32 always. Where it does not, torch emulates them, slower."""
    if dtype == torch.float32:
        return True
    if dtype not in (torch.bfloat16, torch.float16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
