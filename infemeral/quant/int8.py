"""Int8 weight-only quantisation: one scale per output row, torch's own kernel.

Shared by the laptop's half (its LM head, token table and local layers) and the server's layers. Per
decode token the laptop reads every weight of its LM head and local layers once; at a real vocabulary
(128,256 rows) that read is the client's cost (docs/design.md §10). Int8 codes with a scale per
output row halve the read against bf16 and quarter it against fp32. The matmul is torch's
`aten._weight_int8pack_mm` (activations in the compute dtype, int8 weights [N, K], scales [N]), fast on
x86 CPUs with bf16 activations. Its CUDA version uses no tensor cores and reads the whole weight again for
every activation row, so on CUDA it runs only a few rows (a decode step) and a longer input multiplies
the weights dequantised into its dtype. The CPU version is vectorised for bf16 alone: float32 and float16
activations take a scalar loop there, so beyond a few rows they too multiply the dequantised weights.
Where the kernel cannot run (no kernel for the device, or a width that is not a multiple of 16, which the
CPU kernel reads in blocks of 16 without checking) the weights are dequantised for the call too: slower,
same numbers.

Scales are rounded to bfloat16 before the codes are chosen, so the codes fit exactly the scale the
kernel multiplies by when activations are bf16, and a bundle stores each scale once, losslessly.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F

# The decoder-layer linears the client quantises (every nn.Linear of a supported layer).
QUANTIZED_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
QUANT_MODES = ("none", "int8")
SCALE_SUFFIX = ".scale"  # bundle name of a quantised weight's scales: "<module>.scale" next to "<module>.weight"
_ROWS_PER_CHUNK = 8192  # quantise big tables in slices, so a 128k-row head needs no full-size float copy
_ALIGN = 64
# Most activation rows CUDA's `_weight_int8pack_mm` multiplies; longer inputs dequantise once and use F.linear.
# Chosen from a reading of the kernel (no tensor cores, one pass over the weight per row), not measured yet:
# to be measured on a GPU.
CUDA_KERNEL_MAX_ROWS = 4
# Most float32 or float16 activation rows the CPU kernel multiplies (bf16 takes any number): its scalar loop
# costs as much per row as dequantising the weight does once (measured in docs/server_quant.md).
CPU_UNVECTORISED_MAX_ROWS = 8
KERNEL = "_weight_int8pack_mm"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, K] and a float32 scale per row [N] (a bfloat16 value): w ≈ codes * scale."""
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scales = torch.empty(weight.shape[0], dtype=torch.float32)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        w = weight[start:start + _ROWS_PER_CHUNK].to("cpu", torch.float32)
        amax = w.abs().amax(dim=1)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax)).to(torch.bfloat16).float()
        codes[start:start + len(w)] = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[start:start + len(w)] = scale
    return codes, scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scales.float().unsqueeze(-1)).to(dtype)


def quantize_layer(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A decoder layer's state dict with every linear weight replaced by int8 codes + `.scale`."""
    out = dict(weights)
    for name in QUANTIZED_LINEARS:
        out[f"{name}.weight"], out[f"{name}{SCALE_SUFFIX}"] = quantize_rows(weights[f"{name}.weight"])
    return out


@functools.cache
def has_int8_kernel(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `_weight_int8pack_mm` runs on this device with these activations (probed once)."""
    try:
        x = torch.ones(1, 32, dtype=dtype, device=device_type)
        w = torch.ones(16, 32, dtype=torch.int8, device=device_type)
        out = torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(16, dtype=dtype, device=device_type))
        return bool((out == 32).all())
    except (NotImplementedError, RuntimeError):
        return False


def aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous with a 64-byte aligned start: the CPU kernel uses aligned vector loads on both operands."""
    t = t.contiguous()
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def uses_int8_kernel(device_type: str, dtype: torch.dtype, rows: int, in_features: int) -> bool:
    """Whether `int8_matmul` multiplies `rows` activations through the kernel (else: the dequantised weight)."""
    max_rows = kernel_max_rows(device_type, dtype)
    if in_features % 16 or (max_rows is not None and rows > max_rows):
        return False
    return has_int8_kernel(device_type, dtype)


def kernel_max_rows(device_type: str, dtype: torch.dtype) -> int | None:
    """Most activation rows the kernel multiplies on this device in this dtype (None: any number)."""
    if device_type == "cuda":
        return CUDA_KERNEL_MAX_ROWS
    if device_type == "cpu" and dtype != torch.bfloat16:
        return CPU_UNVECTORISED_MAX_ROWS
    return None


def kernel_in_use(device_type: str, dtype: torch.dtype, in_features: int) -> str:
    """What multiplies an Int8Linear's inputs here, in words (for the log and `served.kernels_in_use`)."""
    if not uses_int8_kernel(device_type, dtype, 1, in_features):
        return "dequantize"
    max_rows = kernel_max_rows(device_type, dtype)
    return KERNEL if max_rows is None else f"{KERNEL} up to {max_rows} rows, dequantize above"


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (codes * scales)ᵀ -> [M, N] in x's dtype. The kernel reads `scales` as x's dtype without
    checking (other activations than the weights were loaded for crash it), so they are cast when they differ."""
    if scales.dtype != x.dtype:
        scales = scales.to(x.dtype)
    if uses_int8_kernel(x.device.type, x.dtype, x.shape[0], codes.shape[1]):
        return torch.ops.aten._weight_int8pack_mm(aligned(x), aligned(codes), scales)
    return dequantized_matmul(x, codes, scales)


def dequantized_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of x with the weight dequantised straight into x's dtype: the numbers of dequantising through
    float32 (with bf16-valued scales each code * scale is exact in float32 before its one rounding to x's
    dtype), without a float32 copy of the weight."""
    if scales.dtype != x.dtype:
        scales = scales.to(x.dtype)
    return F.linear(x, codes.to(x.dtype) * scales.unsqueeze(-1), bias)


class Int8Linear(torch.nn.Module):
    """Drop-in for a decoder layer's nn.Linear: int8 `weight` [out, in], `scale` [out], optional `bias`."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    @classmethod
    def like(cls, linear: torch.nn.Linear) -> "Int8Linear":
        return cls(linear.in_features, linear.out_features, linear.bias is not None)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.weight.device.type != "meta":  # codes read in place from a file may start anywhere
            self.weight = aligned(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x.reshape(-1, self.in_features), self.weight, self.scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_int8_linears(layer: torch.nn.Module) -> None:
    """Swap a (meta-device) decoder layer's linears for Int8Linear before its weights are loaded."""
    for name in QUANTIZED_LINEARS:
        parent_name, attr = name.rsplit(".", 1)
        parent = layer.get_submodule(parent_name)
        with torch.device("meta"):
            setattr(parent, attr, Int8Linear.like(getattr(parent, attr)))
