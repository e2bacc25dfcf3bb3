"""Int4 weight-only quantisation in groups along the input: the stored format and the linear that runs it.

A weight [N, K] is cut into groups of `group_size` input columns; each group of each output row has a
scale s and a zero z, and its codes q are 0..15:

    w ≈ (q - 8) · s + z

which is exactly what torch's int4 kernels compute (`aten._weight_int4pack_mm_for_cpu` on x86 CPUs,
`aten._weight_int4pack_mm`, the "tinygemm" kernel, on CUDA GPUs from Ampere on; both run bf16 activations
only here: tinygemm takes nothing else, and the CPU kernel is vectorised for bf16 alone, float32 and
float16 taking a scalar loop hundreds of times slower than dequantising, docs/server_quant.md):
z is a float offset, so symmetric and asymmetric grids and the fitted ones of HQQ and GPTQ all fit the
same format.

Stored per linear, everything indexed by output row first (so a range of output rows, or of whole
groups of input columns, is a plain slice; tensor parallelism can shard either way):

* `<linear>.qweight`: uint8 [N, K/2], two codes per byte, column 2j in the low nibble, 2j+1 in the high;
* `<linear>.scales`, `<linear>.zeros`: bfloat16 [N, K/group_size].

Scales and zeros are rounded to bfloat16 before the codes are chosen, so the codes fit exactly the grid
the kernel multiplies by. At load, `Int4Linear` repacks the codes into the kernel's own layout for its
device. Where no kernel runs (another device, activations the kernel does not take, a shape it does
not support) it dequantises the weight on every call instead, and says so once in the log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what both int4 kernels accept
QWEIGHT, SCALES, ZEROS = ".qweight", ".scales", ".zeros"
PARAMS_DTYPE = torch.bfloat16
MID = 8  # the kernels subtract 8 from every code


# -- the stored format ------------------------------------------------------------------------------
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [N, K] -> uint8 [N, K/2] (column 2j low nibble, 2j+1 high)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 codes [N, K]."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8, device=packed.device)
    out[:, 0::2] = packed & 15
    out[:, 1::2] = packed >> 4
    return out


def group_view(t: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = t.shape
    if k % group_size:
        raise ValueError(f"group size {group_size} does not divide the {k} input columns of a weight")
    return t.reshape(n, k // group_size, group_size)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight [N, K] the stored codes stand for, made in `dtype` itself: a layer without a kernel does this
    on every call, and a float32 [N, K] copy on the way to bf16 would cost it twice the memory and traffic.
    (q - 8) · s is exact, and torch computes z + (q - 8) · s for bf16 and fp16 in float32 with one rounding,
    so the result is the float32 weight rounded to `dtype` (bit for bit on the CPU)."""
    codes = unpack_nibbles(qweight)
    group_size = codes.shape[1] // scales.shape[1]
    steps = group_view(codes, group_size).to(dtype) - MID
    w = torch.addcmul(zeros.to(dtype).unsqueeze(-1), steps, scales.to(dtype).unsqueeze(-1))
    return w.reshape(codes.shape)


def codes_for(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest codes [N, K] of `weight` on a given grid (scales, zeros [N, K/g])."""
    g = weight.shape[1] // scales.shape[1]
    s, z = scales.float().unsqueeze(-1), zeros.float().unsqueeze(-1)
    q = torch.round((group_view(weight.float(), g) - z) / s + MID).clamp_(0, 15)
    return q.reshape(weight.shape).to(torch.uint8)


def round_params(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros as the bfloat16 values they are stored as (a zero scale becomes a tiny one)."""
    scales = scales.to(PARAMS_DTYPE)
    scales = torch.where(scales == 0, torch.full_like(scales, 1e-8), scales)
    return scales, zeros.to(PARAMS_DTYPE)


def minmax_params(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric grid over each group's range: [..., g] -> scales, zeros [...]."""
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = (hi - lo) / 15
    return scale, lo + MID * scale


CLIP_STEPS = 20      # shrink factors tried per group by `clipped_params`: 1, 0.99, ... down to 1 - (steps - 1)/100
CLIP_NORM = 2.4      # the error norm the search minimises (GPTQ's reference code uses 2.4: between mean and max)


def clipped_params(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric grid over each group's range shrunk towards its middle by the factor, of those tried, that
    rounds the group with the least error: a lone outlier stretches a min..max grid over 16 levels that the
    other weights then share coarsely; giving it up (clipped) spends the levels where most weights are."""
    lo, hi = groups.amin(-1), groups.amax(-1)
    best_scale, best_zero = torch.zeros_like(lo), torch.zeros_like(lo)  # the first factor (1: min..max) fills them
    best_err = torch.full_like(lo, float("inf"))
    for step in range(CLIP_STEPS):
        span = (hi - lo) * (1 - step / 100)
        low = (lo + hi - span) / 2
        scale, zero = round_params(span / 15, low + MID * span / 15)
        s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
        q = torch.round((groups - z) / s + MID).clamp_(0, 15)
        err = ((q - MID) * s + z - groups).abs_().pow_(CLIP_NORM).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale.float(), best_scale)
        best_zero = torch.where(better, zero.float(), best_zero)
    return best_scale, best_zero


def symmetric_params(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric grid (codes -7..7 around zero), the textbook round-to-nearest baseline."""
    scale = groups.abs().amax(-1) / 7
    return scale, torch.zeros_like(scale)


def quantize_rtn(weight: torch.Tensor, group_size: int, symmetric: bool = False) -> dict[str, torch.Tensor]:
    """Round-to-nearest int4: {"qweight", "scales", "zeros"} of one weight [N, K]."""
    w = weight.float()
    params = symmetric_params if symmetric else minmax_params
    scales, zeros = round_params(*params(group_view(w, group_size)))
    return stored(codes_for(w, scales, zeros), scales, zeros)


def stored(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"qweight": pack_nibbles(codes), "scales": scales.to(PARAMS_DTYPE).contiguous(),
            "zeros": zeros.to(PARAMS_DTYPE).contiguous()}


def group_size_of(tensors: Mapping[str, torch.Tensor], prefix: str) -> int:
    return tensors[prefix + QWEIGHT].shape[1] * 2 // tensors[prefix + SCALES].shape[1]


# -- kernels ----------------------------------------------------------------------------------------
def _cuda_inner_k_tiles(k: int) -> int | None:
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def kernel_for(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
               group_size: int) -> tuple[str | None, str]:
    """Which kernel runs this shape here ("cpu", "cuda" or None), and why not when None."""
    device = torch.device(device)
    if group_size not in KERNEL_GROUP_SIZES or in_features % group_size:
        return None, f"group size {group_size} with {in_features} input columns (kernels take 32, 64, 128, 256)"
    if device.type == "cpu":
        if out_features % 16 or in_features % 2:
            return None, f"{out_features} output rows (the CPU kernel needs a multiple of 16)"
        if dtype != torch.bfloat16:
            return None, (f"{dtype} activations: the CPU int4 kernel is fast in bfloat16 only "
                          "(serve with --dtype bfloat16 to use it)")
        return ("cpu", "") if _probe("cpu", dtype) else (None, f"no int4 CPU kernel for {dtype} activations")
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return None, f"{dtype} activations: tinygemm, the CUDA int4 kernel, takes bfloat16 only"
        if out_features % 8 or _cuda_inner_k_tiles(in_features) is None:
            return None, f"shape [{out_features}, {in_features}] (the CUDA kernel needs N % 8 and K % 32 == 0)"
        return ("cuda", "") if _probe(str(device), dtype) else (None, f"no int4 CUDA kernel for {dtype} here")
    return None, f"no int4 kernel on {device.type}"


@functools.cache
def _probe(device: str, dtype: torch.dtype) -> bool:
    """Whether the int4 kernel runs here with these activations and gives the dequantised result (once)."""
    try:
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=g)
        scales, zeros = round_params(torch.rand(32, 2, generator=g) / 10 + 0.01, torch.randn(32, 2, generator=g) / 10)
        x = torch.randn(3, 64, generator=g).to(dtype)
        kind = torch.device(device).type
        packed, params = _pack_for(kind, codes.to(device), scales.to(device, dtype), zeros.to(device, dtype))
        got = _kernel_mm(kind, x.to(device), packed, 32, params).float().cpu()
        want = x.float() @ dequantize(pack_nibbles(codes), scales, zeros).T
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max())))
    except (RuntimeError, NotImplementedError):
        return False


def _pack_for(kind: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """Codes [N, K] and params [N, G] (already in the activation dtype) -> the kernel's weight and params."""
    params = torch.stack([scales.T, zeros.T], dim=-1).contiguous()  # [G, N, 2]
    if kind == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2), params
    packed = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()  # tinygemm: even column high
    return torch.ops.aten._convert_weight_to_int4pack(packed, _cuda_inner_k_tiles(codes.shape[1])), params


def _kernel_mm(kind: str, x: torch.Tensor, packed: torch.Tensor, group_size: int, params: torch.Tensor):
    if kind == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group_size, params)
    return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group_size, params)


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("int4 weights without a kernel (%s): dequantising them on every call, which is slow", reason)


class Int4Linear(torch.nn.Module):
    """Drop-in for a decoder layer's nn.Linear holding int4 codes in groups (see the module docstring).

    Loads the stored tensors (`qweight`, `scales`, `zeros`, optional `bias`); right after loading it
    repacks them for the kernel of the device they were loaded onto, in the dtype the scales were cast
    to (the activation dtype). `kernel` says which one runs: "cpu", "cuda", or "dequantize" (no kernel
    here, or `use_kernel=False`, e.g. after the kernel failed a start-up self-check).
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool, use_kernel: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.use_kernel = use_kernel
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=PARAMS_DTYPE))
        self.register_buffer("zeros", torch.empty(out_features, groups, dtype=PARAMS_DTYPE))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.register_buffer("packed", None, persistent=False)  # the kernel's layouts, once loaded
        self.register_buffer("params", None, persistent=False)
        self.kernel = "dequantize"

    @classmethod
    def like(cls, linear: torch.nn.Linear, group_size: int, use_kernel: bool = True) -> "Int4Linear":
        return cls(linear.in_features, linear.out_features, group_size, linear.bias is not None, use_kernel)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.qweight is not None and self.qweight.device.type != "meta":
            self.prepare_kernel()

    def prepare_kernel(self) -> None:
        """Repack the loaded codes for this device's kernel (or keep them for dequantising on each call)."""
        kind, reason = kernel_for(self.qweight.device, self.scales.dtype, self.out_features, self.in_features,
                                  self.group_size)
        if not self.use_kernel:
            kind, reason = None, "kernels turned off"
        if kind is None:
            _warn_once(reason)
            self.kernel = "dequantize"
            return
        self.packed, self.params = _pack_for(kind, unpack_nibbles(self.qweight), self.scales, self.zeros)
        self.qweight = self.scales = self.zeros = None  # only the kernel's copy is kept
        self.kernel = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "dequantize":
            y = F.linear(rows, dequantize(self.qweight, self.scales, self.zeros, x.dtype))
        else:  # the kernel takes activations in its params' dtype only (others are read wrong, or crash)
            y = _kernel_mm(self.kernel, rows.to(self.params.dtype), self.packed, self.group_size, self.params)
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

