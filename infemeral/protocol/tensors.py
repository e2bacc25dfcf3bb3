"""Tensors on the wire: raw bytes + dtype + shape, validated before use.

Only floating-point hidden states may cross the wire. Everything a peer sends
is checked (allowed dtype, rank 2, width = hidden size, bounded length, byte
length matching the shape, finite values) and refused with a message naming
the problem.

Besides the plain dtypes there are 8-bit wires, one byte per element and one
float32 scale per row (token), half the bytes of a bfloat16 upload: each row
is divided by its largest magnitude over the code's largest value, so no row
overflows. int8 rounds to the nearest of 255 evenly spaced levels; float8_e4m3fn
keeps a 3-bit mantissa, finer near zero and coarser at the top. The hidden
states are in a random orthogonal basis, which spreads any outlier channel over
all of them, so a row's largest element is a few times its RMS and int8's even
levels are the closer code. A clipped scale (a percentile of the row) would
round finer but clip the row's largest elements, which costs more than it
gains on such rows (docs/benchmarks/upload.md). Which wire a turn uses is the
client's choice (`Wire.choose`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infemeral.errors import InvalidArgument
from infemeral.protocol import pb

WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
E4M3, INT8 = "float8_e4m3fn", "int8"
EIGHT_BIT = {E4M3: torch.float8_e4m3fn, INT8: torch.int8}  # one byte per element, a float32 scale per row
WIRE_NAMES = (*WIRE_DTYPES, *EIGHT_BIT)
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
        server: that dtype both ways (float32, the exact path, on a float32 server); int8, e4m3: that 8-bit
        code both ways; int8-up, e4m3-up: 8-bit uploads, answers in the server's dtype."""
        plain = server_dtype if server_dtype in WIRE_DTYPES else "float32"
        wires = {"server": cls(plain), "int8": cls(INT8), "int8-up": cls(INT8, plain), "e4m3": cls(E4M3),
                 "e4m3-up": cls(E4M3, plain)}
        if mode not in wires:
            raise ValueError(f"wire must be one of {', '.join(wires)}, not {mode!r}")
        return wires[mode]

    def describe(self) -> str:
        return self.upload if self.answer in ("", self.upload) else f"{self.upload} up, {self.answer} down"


def to_proto(t: torch.Tensor, dtype: str | None = None) -> pb.Tensor:
    """`t` as a wire tensor in `dtype` (a WIRE_NAMES entry; None: t's own dtype)."""
    t = t.detach().cpu()
    if dtype in EIGHT_BIT:
        return _to_eight_bit(t, dtype)
    if dtype is not None:
        t = t.to(WIRE_DTYPES[dtype])
    t = t.contiguous()
    if t.dtype not in _NAMES:
        raise TypeError(f"only {', '.join(WIRE_DTYPES)} tensors may be sent, not {t.dtype}")
    raw = t.view(torch.uint8) if t.numel() else t
    return pb.Tensor(data=raw.numpy().tobytes(), dtype=_NAMES[t.dtype], shape=list(t.shape))


def _to_eight_bit(t: torch.Tensor, name: str) -> pb.Tensor:
    """Each row over its own scale (its largest magnitude over the code's largest value), rounded to the nearest
    code: float8's cast rounds to nearest, an integer cast would truncate, so int8 rounds first."""
    if t.dim() != 2:
        raise TypeError(f"only [rows, width] tensors may be sent in {name}, not shape {list(t.shape)}")
    code = EIGHT_BIT[name]
    largest = _largest_code(code)
    rows = t.float()
    scale = (rows.abs().amax(dim=1) / largest).clamp(min=_SMALLEST_SCALE) if rows.numel() else rows.new_ones(0)
    scaled = (rows / scale[:, None]).clamp(-largest, largest)
    q = (scaled if code.is_floating_point else scaled.round()).to(code).contiguous()
    return pb.Tensor(data=q.view(torch.uint8).numpy().tobytes(), dtype=name, shape=list(t.shape),
                     scale=scale.tolist())


def _largest_code(code: torch.dtype) -> float:
    """The largest magnitude of an 8-bit code: 448 for e4m3; 127 for int8, whose -128 is left out so that the
    levels are symmetric about zero."""
    return float(torch.finfo(code).max if code.is_floating_point else torch.iinfo(code).max)


def from_proto(msg: pb.Tensor, hidden_size: int, max_rows: int, what: str = "hidden") -> torch.Tensor:
    """Decode and validate a [rows, hidden_size] tensor (in its wire dtype; an 8-bit one as float32)."""
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
    dtype = EIGHT_BIT.get(msg.dtype) or WIRE_DTYPES[msg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(f"{what}: {len(msg.data)} bytes do not match shape {shape} of {msg.dtype} "
                              f"({expected} bytes expected)")
    t = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(shape)
    if msg.dtype in EIGHT_BIT:
        t = t.float() * _scales(msg, rows, what)[:, None]
    elif len(msg.scale):
        raise InvalidArgument(f"{what}: {msg.dtype} carries no scales (only {' and '.join(EIGHT_BIT)} do), "
                              f"got {len(msg.scale)}")
    if not torch.isfinite(t).all():
        raise InvalidArgument(f"{what}: contains NaN or infinite values")
    return t


def _scales(msg: pb.Tensor, rows: int, what: str) -> torch.Tensor:
    if len(msg.scale) != rows:
        raise InvalidArgument(f"{what}: {msg.dtype} needs one scale per row: {len(msg.scale)} scales for {rows} rows")
    scale = torch.tensor(msg.scale, dtype=torch.float32)
    if not (torch.isfinite(scale) & (scale > 0)).all():
        raise InvalidArgument(f"{what}: {msg.dtype} scales must be finite and positive")
    return scale
