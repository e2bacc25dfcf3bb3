"""Tensors on the wire: raw bytes + dtype + shape, validated before use.

Only floating-point hidden states may cross the wire. Everything a peer sends
is checked (allowed dtype, rank 2, width = hidden size, bounded length, byte
length matching the shape, finite values) and refused with a message naming
the problem.
"""

from __future__ import annotations

import math

import torch

from infemeral.errors import InvalidArgument
from infemeral.protocol import pb

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}


def to_proto(t: torch.Tensor) -> pb.Tensor:
    t = t.detach().contiguous().cpu()
    if t.dtype not in _NAMES:
        raise TypeError(f"only {', '.join(WIRE_DTYPES)} tensors may be sent, not {t.dtype}")
    raw = t.view(torch.uint8) if t.numel() else t
    return pb.Tensor(data=raw.numpy().tobytes(), dtype=_NAMES[t.dtype], shape=list(t.shape))


def from_proto(msg: pb.Tensor, hidden_size: int, max_rows: int, what: str = "hidden") -> torch.Tensor:
    """Decode and validate a [rows, hidden_size] tensor."""
    if msg.dtype not in WIRE_DTYPES:
        raise InvalidArgument(f"{what}: dtype {msg.dtype!r} is not allowed; use one of {', '.join(WIRE_DTYPES)}")
    shape = list(msg.shape)
    if len(shape) != 2:
        raise InvalidArgument(f"{what}: expected a 2-D tensor [tokens, {hidden_size}], got shape {shape}")
    rows, width = shape
    if width != hidden_size:
        raise InvalidArgument(f"{what}: last dimension is {width}, but this server's hidden size is {hidden_size}; "
                              "was the client bundle prepared for another model?")
    if rows < 1:
        raise InvalidArgument(f"{what}: a step must carry at least one token, got {rows}")
    if rows > max_rows:
        raise InvalidArgument(f"{what}: {rows} tokens in one step exceed this server's limit of {max_rows}; "
                              "send the prompt in smaller steps")
    dtype = WIRE_DTYPES[msg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(f"{what}: {len(msg.data)} bytes do not match shape {shape} of {msg.dtype} "
                              f"({expected} bytes expected)")
    t = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(shape)
    if not torch.isfinite(t).all():
        raise InvalidArgument(f"{what}: contains NaN or infinite values")
    return t
