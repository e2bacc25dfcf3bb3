"""Edges of the served-layer quantisation that the format and method tests pass over: GPTQ across more than
one block of columns, where clipped grids shrink to, the group-size check on the MLP's width, and where int8
codes loaded from anywhere in memory end up."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from infemeral.quant import gptq, int4, int8
from infemeral.quant.served import ServerQuant


def correlated_hessian(k: int, n: int = 1024, seed: int = 1) -> torch.Tensor:
    """XᵀX of inputs whose columns are mixed together (a few loud ones): rounding errors have somewhere to go."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    scale = torch.ones(k)
    scale[:8] = 6.0
    x = (torch.randn(n, k, generator=g) * scale) @ mix
    return x.T @ x


def unblocked_gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """GPTQ as the paper writes it, in float64: one column at a time, each rounding error spread over every
    later column at once (no blocks); each group's min..max grid fitted when its first column comes up."""
    w = weight.double().clone()
    k = w.shape[1]
    h = hessian.double() + gptq.DAMP * torch.diagonal(hessian.double()).mean() * torch.eye(k, dtype=torch.float64)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.empty(w.shape, dtype=torch.uint8)
    for c in range(k):
        if c % group_size == 0:
            scale, zero = (p.double() for p in int4.round_params(*int4.minmax_params(w[:, c:c + group_size].float())))
        q = torch.round((w[:, c] - zero) / scale + int4.MID).clamp(0, 15)
        codes[:, c] = q.to(torch.uint8)
        error = (w[:, c] - ((q - int4.MID) * scale + zero)) / h_inv[c, c]
        w[:, c:] -= error[:, None] * h_inv[c, c:][None]
    return codes


def test_gptq_over_several_blocks_of_columns_matches_the_unblocked_algorithm():
    """With 256 input columns the columns are quantised in two blocks of BLOCK: the second block must have
    absorbed the first block's rounding errors (the update after each block), as GPTQ column by column does."""
    k = 2 * gptq.BLOCK
    weight = 0.02 * torch.randn(32, k, generator=torch.Generator().manual_seed(0))
    hessian = correlated_hessian(k)
    got = int4.unpack_nibbles(gptq.quantize_gptq_int4(weight, hessian, 32, fit=int4.minmax_params,
                                                      act_order=False)["qweight"])
    want = unblocked_gptq_int4(weight, hessian, 32)
    differ = (got != want).float()
    assert float(differ[:, :gptq.BLOCK].mean()) < 0.005  # the first block never depends on the update
    assert float(differ[:, gptq.BLOCK:].mean()) < 0.005  # (without it: 36 % of the second block's codes differ)


@pytest.mark.parametrize("outlier_at", ["min", "max"])
def test_a_clipped_grid_gives_up_a_lone_outlier_at_either_end(outlier_at):
    """A group spread evenly over -1..1 but for one weight at -2 (or 2): the chosen grid shrinks towards the
    group's middle, so the end the outlier stretched is clipped and the grid stays centred on the range."""
    group = torch.linspace(-1, 1, 64)
    group[17] = -2.0 if outlier_at == "min" else 2.0
    groups = group.reshape(1, 1, 64)
    scale, zero = (p.float() for p in int4.round_params(*int4.clipped_params(groups)))
    low, high = float(zero - int4.MID * scale), float(zero + (15 - int4.MID) * scale)  # codes 0 and 15
    lo, hi = float(group.min()), float(group.max())
    margin = 0.02 * (hi - lo)  # well past the bfloat16 rounding of the grid's scale and zero
    assert lo + margin < low and high < hi - margin, (low, high)  # shrunk at both ends: the outlier is clipped
    assert abs((low + high) / 2 - (lo + hi) / 2) < margin  # around the group's middle


def test_an_intermediate_size_the_int4_group_does_not_divide_is_refused():
    """The MLP's width is down_proj's input: groups of 64 do not divide 96 intermediate units."""
    config = LlamaConfig(hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    ServerQuant("int4", "rtn", 32).check_shapes(config)
    with pytest.raises(ValueError, match=r"group size 64 does not divide the layers' input widths 96; this model "
                                         r"takes 32$"):
        ServerQuant("int4", "rtn", 64).check_shapes(config)


@pytest.mark.parametrize("offset", [1, 16, 32])
def test_int8_codes_loaded_at_any_offset_end_up_64_byte_aligned(offset):
    """Codes read in place from a file may start 1, 16 or 32 bytes past a 64-byte boundary: the CPU kernel's
    aligned loads need them moved (16-byte alignment is not enough)."""
    codes, scales = int8.quantize_rows(0.02 * torch.randn(64, 128, generator=torch.Generator().manual_seed(2)))
    backing = torch.empty(codes.numel() + 64, dtype=torch.int8)
    start = (-backing.data_ptr()) % 64 + offset  # elements are bytes: this many bytes past a boundary
    placed = backing[start:start + codes.numel()].view(codes.shape)
    placed.copy_(codes)
    assert placed.data_ptr() % 64 == offset
    with torch.device("meta"):
        linear = int8.Int8Linear(128, 64, bias=False)
    linear.load_state_dict({"weight": placed, "scale": scales.to(torch.bfloat16)}, assign=True)
    assert linear.weight.data_ptr() % 64 == 0 and torch.equal(linear.weight, codes)
