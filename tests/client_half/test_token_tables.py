"""A token table keeps only some of its rows on request (a draft head's reduced vocabulary, `rows(ids)`): exactly
those rows, held as the table holds its own (int8 stays int8; a dense copy is packed where its dtype packs, since
it serves no lookups), giving the full table's logits for those tokens."""

from __future__ import annotations

import pytest
import torch

from infemeral.client_half import packed
from infemeral.client_half.tables import DenseTokenTable, Int8TokenTable
from infemeral.quant.int8 import quantize_rows

VOCAB, D = 96, 64
IDS = torch.tensor([5, 0, 95, 17, 40, 63, 2, 88])  # any order


def table_weight() -> torch.Tensor:
    return torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(0))


def hidden(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(3, D, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dense_tables_rows_are_its_rows(dtype):
    full = DenseTokenTable(table_weight().to(dtype))
    part = full.rows(IDS)
    if packed.packs("cpu", dtype):
        assert isinstance(part, packed.PackedHead) and torch.equal(part.weight.to_dense(), full.weight[IDS])
    else:
        assert isinstance(part, DenseTokenTable) and torch.equal(part.weight, full.weight[IDS])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(part.project(hidden(dtype)).float(), full.project(hidden(dtype))[:, IDS].float(),
                          atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_tables_rows_are_its_codes_and_scales(dtype):
    codes, scales = quantize_rows(table_weight())
    full = Int8TokenTable(codes, scales, dtype, torch.device("cpu"))
    part = full.rows(IDS)
    assert isinstance(part, Int8TokenTable) and part.dtype == dtype
    for kept, whole in zip(part.tensors(), full.tensors()):  # codes, scales, the kernel's scales
        assert kept.dtype == whole.dtype and torch.equal(kept, whole[IDS])
    assert torch.equal(part.lookup(torch.arange(len(IDS))), full.lookup(IDS))
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(part.project(hidden(dtype)).float(), full.project(hidden(dtype))[:, IDS].float(),
                          atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(not packed.packs("cpu", torch.bfloat16), reason="this CPU's oneDNN has no native bf16 kernels")
def test_a_packed_heads_rows_stay_packed():
    weight = table_weight().bfloat16()
    part = packed.PackedHead(weight).rows(IDS)
    assert isinstance(part, packed.PackedHead) and torch.equal(part.weight.to_dense(), weight[IDS])
