"""The client's packed bf16/fp16 weights: same numbers as the dense forms, float32 never packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infemeral.client_half import packed

PACKS = packed.packs("cpu", torch.bfloat16)
needs_packing = pytest.mark.skipif(not PACKS, reason="this CPU's oneDNN has no native bf16 kernels")


def test_float32_and_other_devices_are_never_packed():
    assert not packed.packs("cpu", torch.float32)
    assert not packed.packs("cuda", torch.bfloat16)
    assert not packed.packs("mps", torch.float16)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_the_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(256, 320, bias=bias).to(torch.bfloat16)
    x = torch.randn(1, rows, 256, generator=g).to(torch.bfloat16)
    swapped = torch.nn.Sequential(torch.nn.Linear(256, 320, bias=bias).to(torch.bfloat16))
    swapped[0].load_state_dict(linear.state_dict())
    assert packed.pack_linears(swapped) == 1 and isinstance(swapped[0], packed.PackedLinear)
    with torch.inference_mode():
        want, got = linear(x), swapped(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # the same bf16 products, summed in another order: within a few bf16 steps of the output
    assert (got.float() - want.float()).abs().max() <= 4 * 2 ** -8 * want.float().abs().max()
    assert not torch.equal(swapped[0].weight.to_dense(), torch.zeros_like(linear.weight))


@needs_packing
def test_projection_packs_bf16_and_gives_its_matrix_back():
    q = torch.linalg.qr(torch.randn(128, 128))[0]
    plain = packed.Projection(q)
    assert plain.packed is None and plain.matrix() is q
    x = torch.randn(2, 128)
    assert torch.equal(plain(x), x @ q)  # float32: the plain product, bit for bit

    qb = q.to(torch.bfloat16)
    proj = packed.Projection(qb)
    assert proj.plain is None and torch.equal(proj.matrix(), qb)
    xb = x.to(torch.bfloat16)
    assert torch.allclose(proj(xb).float(), (xb @ qb).float(), atol=3e-2)
    assert torch.allclose(packed.PackedHead(qb).project(xb).float(), F.linear(xb, qb).float(), atol=3e-2)


@needs_packing
def test_packed_weights_take_the_dense_bytes_at_real_widths():
    for shape in [(4096, 4096), (1024, 4096), (14336, 4096), (49152, 960)]:
        w = torch.zeros(shape, dtype=torch.bfloat16)
        assert packed.nbytes(packed.pack(w)) == w.nbytes


@pytest.mark.parametrize("shape", [(1, 576), (2, 576), (1, 5, 576), (2, 3, 576), (17, 576)])
def test_the_float32_head_gives_the_linears_logits_for_any_number_of_rows(shape):
    """A few float32 rows are multiplied as weight @ hiddenᵀ (the faster kernel there), more as F.linear: the
    same logits either way, in the hidden's shape."""
    from infemeral.client_half.tables import HEAD_FEW_ROWS, DenseTokenTable

    g = torch.Generator().manual_seed(len(shape))
    weight, hidden = torch.randn(3000, 576, generator=g), torch.randn(*shape, generator=g)
    logits = DenseTokenTable(weight).project(hidden)
    assert logits.shape == (*shape[:-1], 3000)
    torch.testing.assert_close(logits, F.linear(hidden, weight), rtol=1e-5, atol=1e-4)
    assert torch.equal(logits.argmax(-1), F.linear(hidden, weight).argmax(-1))
    assert (hidden.numel() // 576 <= HEAD_FEW_ROWS) == (shape != (17, 576))
