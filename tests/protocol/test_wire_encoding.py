"""The wire encodings of hidden states: the 8-bit wires' per-token scale (int8 and e4m3), their checks, and the client's
choice."""

from __future__ import annotations

import typing

import pytest
import torch

from infemeral.client.settings import ClientSettings
from infemeral.errors import InvalidArgument
from infemeral.protocol import pb
from infemeral.protocol.tensors import E4M3, EIGHT_BIT, INT8, WIRE_DTYPES, Wire, from_proto, to_proto

D = 64


def hidden_like(rows: int = 6, seed: int = 0) -> torch.Tensor:
    """Rows with an outlier channel and very different magnitudes, as residual streams have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=gen) * torch.logspace(-2, 2, rows).unsqueeze(1)
    x[:, 3] *= 30
    return x


def test_e4m3_is_a_byte_per_element_and_a_scale_per_row_within_e4m3s_rounding():
    x = hidden_like()
    msg = to_proto(x, E4M3)
    assert msg.dtype == E4M3 and list(msg.shape) == [6, D]
    assert len(msg.data) == 6 * D and len(msg.scale) == 6  # against 2 * 6 * D in bfloat16
    y = from_proto(msg, D, 16)
    assert y.dtype == torch.float32
    scale = torch.tensor(msg.scale).unsqueeze(1)
    # 3 mantissa bits: half an ulp is 1/16 of a normal value; e4m3's subnormals step by 2^-9 of the scale
    assert ((y - x).abs() <= x.abs() / 16 + scale * 2**-10).all()
    assert (y.abs().amax(dim=1) == x.abs().amax(dim=1)).all()  # each row's largest element is exact: it is 448
    assert (y - x).abs().max() > 0  # and it is not a lossless copy


def test_e4m3_rows_of_zeros_and_of_extreme_magnitudes_stay_finite():
    x = hidden_like(4)
    x[0] = 0.0
    x[1] *= 1e30
    x[2] *= 1e-35  # below float32's normal range over 448: the scale stops at the smallest normal float32
    msg = to_proto(x, E4M3)
    scale = torch.tensor(msg.scale)
    assert bool((torch.isfinite(scale) & (scale > 0)).all())
    y = from_proto(msg, D, 16)
    assert (y[0] == 0).all() and torch.isfinite(y).all()
    torch.testing.assert_close(y[1], x[1], rtol=1 / 16, atol=0)


def test_e4m3_takes_bfloat16_and_plain_dtypes_are_cast():
    x = hidden_like().to(torch.bfloat16)
    assert len(to_proto(x, E4M3).data) == x.numel()
    plain = to_proto(hidden_like(), "bfloat16")
    assert plain.dtype == "bfloat16" and len(plain.scale) == 0 and len(plain.data) == 2 * 6 * D
    assert to_proto(x).dtype == "bfloat16"  # no dtype: the tensor's own, as before


def test_int8_is_a_byte_per_element_and_a_scale_per_row_within_half_a_level():
    x = hidden_like()
    msg = to_proto(x, INT8)
    assert msg.dtype == INT8 and list(msg.shape) == [6, D]
    assert len(msg.data) == 6 * D and len(msg.scale) == 6
    y = from_proto(msg, D, 16)
    assert y.dtype == torch.float32
    scale = torch.tensor(msg.scale).unsqueeze(1)
    torch.testing.assert_close(scale.squeeze(1), x.abs().amax(dim=1) / 127)  # the row's largest element is 127
    # 255 even levels, rounded to the nearest: no element further than half a level (float32's rounding aside)
    assert ((y - x).abs() <= scale * (0.5 + 1e-4)).all()
    assert (y - x).abs().max() > scale.min() / 100  # and it is not a lossless copy


def test_on_rows_in_a_random_basis_int8_is_closer_than_e4m3():
    """No outlier channel survives a random orthogonal basis, so a row's largest element is a few times its RMS:
    int8's even levels then round closer than e4m3's 3-bit mantissa (why int8 is offered)."""
    rotation, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(1)))
    x = hidden_like(32) @ rotation

    def error(name: str) -> float:
        return float((from_proto(to_proto(x, name), D, 32) - x).norm() / x.norm())

    assert error(INT8) < error(E4M3) / 2


def test_int8_rows_of_zeros_and_of_extreme_magnitudes_stay_finite():
    x = hidden_like(4)
    x[0] = 0.0
    x[1] *= 1e30
    x[2] *= 1e-35
    msg = to_proto(x, INT8)
    y = from_proto(msg, D, 16)
    assert (y[0] == 0).all() and torch.isfinite(y).all()
    torch.testing.assert_close(y[1], x[1], rtol=0, atol=float(msg.scale[1]) * 0.51)


def malformed(name: str) -> dict:
    """Tensors of the 8-bit dtype `name` that a peer must refuse, and a fragment of each refusal."""
    def tensor(data: bytes, rows: int, scale: list[float]) -> pb.Tensor:
        return pb.Tensor(data=data, dtype=name, shape=[rows, D], scale=scale)

    return {
        "one scale for two rows": (tensor(bytes(2 * D), 2, [1.0]), f"{name} needs one scale per row: 1 scales for 2"),
        "no scales": (tensor(bytes(D), 1, []), "0 scales for 1 rows"),
        "NaN scale": (tensor(bytes(D), 1, [float("nan")]), "finite and positive"),
        "infinite scale": (tensor(bytes(D), 1, [float("inf")]), "finite and positive"),
        "zero scale": (tensor(bytes(D), 1, [0.0]), "finite and positive"),
        "negative scale": (tensor(bytes(D), 1, [-1.0]), "finite and positive"),
        "bytes short of the shape": (tensor(bytes(D - 1), 1, [1.0]),
                                     f"{D - 1} bytes do not match shape [1, {D}] of {name} ({D} bytes expected)"),
        "two bytes an element": (tensor(bytes(2 * D), 1, [1.0]), f"{2 * D} bytes do not match shape"),
        "overflow past float32": (tensor(bytes([0x7E]) * D, 1, [1e38]), "NaN or infinite"),  # 448 or 126, x 1e38
    }


NAN_E4M3 = bytes([0x7F])  # e4m3fn has no infinity; 0x7F is NaN
BAD = {(name, case): bad for name in EIGHT_BIT for case, bad in malformed(name).items()} | {
    (E4M3, "NaN element"): (pb.Tensor(data=NAN_E4M3 + bytes(D - 1), dtype=E4M3, shape=[1, D], scale=[1.0]),
                            "NaN or infinite"),
    ("bfloat16", "scales on bfloat16"): (pb.Tensor(data=bytes(2 * D), dtype="bfloat16", shape=[1, D], scale=[1.0]),
                                         "bfloat16 carries no scales"),
}


@pytest.mark.parametrize("case", BAD, ids=[f"{name} {case}" for name, case in BAD])
def test_a_malformed_8bit_tensor_is_refused_with_what_is_wrong(case):
    msg, fragment = BAD[case]
    with pytest.raises(InvalidArgument) as info:
        from_proto(msg, D, 16)
    assert fragment in str(info.value)


def test_the_client_setting_chooses_the_wire():
    assert Wire.choose("server", "bfloat16") == Wire("bfloat16")  # today's: the server's dtype both ways
    assert Wire.choose("server", "float32") == Wire("float32")     # the exact path
    assert Wire.choose("e4m3", "bfloat16") == Wire(E4M3)            # answers in the dtype sent
    assert Wire.choose("e4m3-up", "bfloat16") == Wire(E4M3, "bfloat16")
    assert Wire.choose("int8", "bfloat16") == Wire(INT8)
    assert Wire.choose("int8-up", "float32") == Wire(INT8, "float32")
    assert Wire.choose("server", "float64") == Wire("float32")     # a dtype the wire has not: float32
    with pytest.raises(ValueError, match="wire must be one of server, int8, int8-up, e4m3, e4m3-up"):
        Wire.choose("int4", "bfloat16")
    # every value the setting accepts is a wire, and the default is today's
    modes = typing.get_args(ClientSettings.model_fields["wire"].annotation)
    assert all(Wire.choose(mode, "bfloat16").upload in (*WIRE_DTYPES, *EIGHT_BIT) for mode in modes)
    assert ClientSettings().wire == "server"


def test_the_wire_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("INFEMERAL_WIRE", "e4m3-up")
    assert ClientSettings().wire == "e4m3-up"
    monkeypatch.setenv("INFEMERAL_WIRE", "fp8")
    with pytest.raises(ValueError, match="wire"):
        ClientSettings()


@pytest.mark.parametrize("command", ["chat", "generate", "serve"])
def test_the_commands_that_run_turns_take_the_wire_flag(command):
    from infemeral.cli.main import build_parser
    from infemeral.settings_flags import settings_from_args

    args = build_parser().parse_args([command, "--wire", "e4m3-up"] + (["hi"] if command == "generate" else []))
    assert settings_from_args(ClientSettings, args).wire == "e4m3-up"
