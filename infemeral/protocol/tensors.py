"""Tensors on the wire: raw bytes + dtype + shape, validated before use.

Only floating-point hidden states may cross the wire. Everything a peer sends
is checked (allowed dtype, rank 2, width = hidden size, bounded length, byte
length matching the shape, finite values) and refused with a message naming
the problem.

Besides the plain dtypes there is an 8-bit wire, float8_e4m3fn with one
float32 scale per row (token): each row is divided by its largest magnitude
over e4m3's largest value (448), so no row overflows and every row keeps e4m3's
3-bit mantissa; it halves the bytes of a bfloat16 upload. Which wire a turn
uses is the client's choice (`Wire.choose`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infemeral.errors import InvalidArgument
from infemeral.protocol import pb

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
E4M3 = "float8_e4m3fn"  # one byte per element, a float32 scale per row
WIRE_NAMES = (*WIRE_DTYPES, E4M3)
_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
_SMALLEST_SCALE = torch.finfo(torch.float32).tiny  # a row of zeros (or nearly) still gets a positive scale


@dataclass(frozen=True)
class Wire:
    """How one turn's hidden states travel: `upload`, the dtype the client sends (a WIRE_NAMES entry), and
    `answer`, the dtype it asks the server to answer in ('' : the dtype sent; Step.answer_dtype)."""

    upload: str
    answer: str = ""

    @classmethod
    def choose(cls, mode: str, server_dtype: str) -> "Wire":
        """The wire of a client setting (`ClientSettings.wire`) against a server computing in `server_dtype`:
        server: that dtype both ways (float32, the exact path, on a float32 server); e4m3: 8-bit both ways;
        e4m3-up: 8-bit uploads, answers in the server's dtype."""
        plain = server_dtype if server_dtype in WIRE_DTYPES else "float32"
        wires = {"server": cls(plain), "e4m3": cls(E4M3), "e4m3-up": cls(E4M3, plain)}
        if mode not in wires:
            raise ValueError(f"wire must be one of {', '.join(wires)}, not {mode!r}")
        return wires[mode]

    def describe(self) -> str:
        return self.upload if self.answer in ("", self.upload) else f"{self.upload} up, {self.answer} down"


def to_proto(t: torch.Tensor, dtype: str | None = None) -> pb.Tensor:
    """`t` as a wire tensor in `dtype` (a WIRE_NAMES entry; None: t's own dtype)."""
    t = t.detach().cpu()
    if dtype == E4M3:
        return _to_e4m3(t)
    if dtype is not None:
        t = t.to(WIRE_DTYPES[dtype])
    t = t.contiguous()
    if t.dtype not in _NAMES:
        raise TypeError(f"only {', '.join(WIRE_DTYPES)} tensors may be sent, not {t.dtype}")
    raw = t.view(torch.uint8) if t.numel() else t
    return pb.Tensor(data=raw.numpy().tobytes(), dtype=_NAMES[t.dtype], shape=list(t.shape))


def _to_e4m3(t: torch.Tensor) -> pb.Tensor:
    if t.dim() != 2:
        raise TypeError(f"only [rows, width] tensors may be sent in {E4M3}, not shape {list(t.shape)}")
    rows = t.float()
    scale = (rows.abs().amax(dim=1) / _E4M3_MAX).clamp(min=_SMALLEST_SCALE) if rows.numel() else rows.new_ones(0)
    q = (rows / scale[:, None]).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
    return pb.Tensor(data=q.view(torch.uint8).numpy().tobytes(), dtype=E4M3, shape=list(t.shape),
                     scale=scale.tolist())


def from_proto(msg: pb.Tensor, hidden_size: int, max_rows: int, what: str = "hidden") -> torch.Tensor:
    """Decode and validate a [rows, hidden_size] tensor (in its wire dtype; float8_e4m3fn as float32)."""
    if msg.dtype not in WIRE_NAMES:
        raise InvalidArgument(f"{what}: dtype {msg.dtype!r} is not allowed; use one of {', '.join(WIRE_NAMES)}")
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
    dtype = torch.float8_e4m3fn if msg.dtype == E4M3 else WIRE_DTYPES[msg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(f"{what}: {len(msg.data)} bytes do not match shape {shape} of {msg.dtype} "
                              f"({expected} bytes expected)")
    t = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(shape)
    if msg.dtype == E4M3:
        t = t.float() * _scales(msg, rows, what)[:, None]
    elif len(msg.scale):
        raise InvalidArgument(f"{what}: {msg.dtype} carries no scales (only {E4M3} does), got {len(msg.scale)}")
    if not torch.isfinite(t).all():
        raise InvalidArgument(f"{what}: contains NaN or infinite values")
    return t


def _scales(msg: pb.Tensor, rows: int, what: str) -> torch.Tensor:
    if len(msg.scale) != rows:
        raise InvalidArgument(f"{what}: {E4M3} needs one scale per row: {len(msg.scale)} scales for {rows} rows")
    scale = torch.tensor(msg.scale, dtype=torch.float32)
    if not (torch.isfinite(scale) & (scale > 0)).all():
        raise InvalidArgument(f"{what}: {E4M3} scales must be finite and positive")
    return scale
