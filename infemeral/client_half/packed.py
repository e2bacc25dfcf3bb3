"""oneDNN-packed weights for the client's bf16/fp16 matmuls on a CPU.

A decode step multiplies one row by every weight the laptop holds, so its cost is how fast the
kernel streams those weights. On an x86 CPU with bf16 instructions, torch's plain bf16 matmul does
not stream faster than float32 does (docs/design.md §10's gain does not appear); torch's own oneDNN
linear with the weight reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`,
what inductor's freezing uses) does, and its cost hardly grows with the number of rows, which is
what verifying drafts needs. Float32 is never packed: it stays the exactness reference, the same
kernels as transformers (a product of a few float32 rows takes the weight @ xᵀ form instead,
`infemeral/model/few_rows.py`; one row and a prompt's many are F.linear's, bit for bit).

A packed weight is opaque (no rows to index), so a tied table, which is also the embedding, stays
dense rather than being held twice; `F.linear` is the faster of the dense forms.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from infemeral.devices import native_on_cpu

PACKED_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def packs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch packs weights for `dtype` on `device_type` and its packed linear gives F.linear's
    numbers (probed once): CPUs whose oneDNN has native bf16/fp16 kernels."""
    if device_type != "cpu" or dtype not in PACKED_DTYPES or not native_on_cpu(dtype):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=g).to(dtype)
        x = torch.randn(3, 32, generator=g).to(dtype)
        out = _linear(x, pack(w), None)
        return bool(torch.allclose(out.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2))
    except (AttributeError, NotImplementedError, RuntimeError):
        return False


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered into oneDNN's layout for linear (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def nbytes(t: torch.Tensor) -> int:
    return torch.ops.mkldnn._nbytes(t) if t.is_mkldnn else t.untyped_storage().nbytes()


class PackedLinear(torch.nn.Module):
    """Drop-in for a loaded nn.Linear: same weights, held packed, any number of leading dimensions."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", pack(linear.weight.detach()))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(x.reshape(-1, self.in_features).contiguous(), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def pack_linears(module: torch.nn.Module) -> int:
    """Replace every nn.Linear under `module` by a PackedLinear; returns how many were replaced."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped


class PackedHead:
    """An untied LM head held packed: it projects hidden states onto the vocabulary and nothing else."""

    def __init__(self, weight: torch.Tensor):
        self.weight = pack(weight)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return _linear(hidden.contiguous(), self.weight, None)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def rows(self, ids: torch.Tensor) -> "PackedHead":
        """A head of only `ids`' rows (a draft head's reduced vocabulary), packed as this one."""
        return PackedHead(self.weight.to_dense()[ids].contiguous())

    def dense(self) -> torch.Tensor:
        """The whole head in float32 (as the other token tables give theirs: a draft head trains against it)."""
        return self.weight.to_dense().float()


class Projection:
    """Right-multiplication by a fixed square matrix (the secret basis or its transpose): `x @ matrix`.

    Held packed where `packs` says so (and then only packed); otherwise the plain `@`, so float32
    computes exactly as before.
    """

    def __init__(self, matrix: torch.Tensor):
        is_packed = packs(matrix.device.type, matrix.dtype)
        self.packed = pack(matrix.T) if is_packed else None
        self.plain = None if is_packed else matrix

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None:
            return x @ self.plain
        return _linear(x.contiguous(), self.packed, None)

    def matrix(self) -> torch.Tensor:
        return self.plain if self.plain is not None else self.packed.to_dense().T

    def tensors(self) -> list[torch.Tensor]:
        return [self.plain if self.plain is not None else self.packed]
