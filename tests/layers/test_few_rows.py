"""Float32 CPU products of a few rows as weight @ xᵀ (`infemeral.layers.few_rows`): which products take that
form, that they give F.linear's numbers, and that the layers of both halves use it."""

import pytest
import torch
import torch.nn.functional as F

from infemeral.layers import few_rows
from infemeral.layers.few_rows import FEW_ROWS, FewRowsLinear, use_few_rows


def _weights(rows: int, bias: bool = True):
    g = torch.Generator().manual_seed(rows)
    return (torch.randn(rows, 384, generator=g), torch.randn(48, 384, generator=g),
            torch.randn(48, generator=g) if bias else None)


@pytest.mark.parametrize("rows", [1, 2, 3, FEW_ROWS, FEW_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_a_few_rows_take_the_tall_form_and_give_the_linears_numbers(rows, bias):
    x, weight, b = _weights(rows, bias)
    got = few_rows.linear(x.reshape(1, rows, 384), weight, b)
    assert got.shape == (1, rows, 48)
    if 2 <= rows <= FEW_ROWS:
        tall = (weight @ x.T).T + (b if bias else 0)
        assert torch.equal(got[0], tall)
    else:  # one row (a decode step) and a prompt: transformers' own kernel, bit for bit
        assert torch.equal(got[0], F.linear(x, weight, b))
    torch.testing.assert_close(got[0], F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_a_wide_table_passes_a_limit_of_its_own():
    x, weight, _ = _weights(12)
    assert torch.equal(few_rows.linear(x, weight, most=16), (weight @ x.T).T)
    assert torch.equal(few_rows.linear(x, weight), F.linear(x, weight))


def test_only_float32_cpu_weights_take_the_tall_form():
    x, weight, _ = _weights(4)
    half = weight.bfloat16()
    assert torch.equal(few_rows.linear(x.bfloat16(), half), F.linear(x.bfloat16(), half))
    assert not few_rows.takes_few_rows(half)
    assert few_rows.takes_few_rows(weight)


def test_use_few_rows_swaps_plain_float32_linears_over_the_same_tensors():
    from infemeral.quant.int8 import Int8Linear

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False)),
                                torch.nn.Linear(4, 4).bfloat16(), Int8Linear(8, 8, False))
    weights = [model[0].weight, model[1][0].weight]
    assert use_few_rows(model) == 2
    assert isinstance(model[0], FewRowsLinear) and isinstance(model[1][0], FewRowsLinear)
    assert model[0].weight is weights[0] and model[1][0].weight is weights[1] and model[1][0].bias is None
    assert type(model[2]) is torch.nn.Linear and type(model[3]) is Int8Linear
    assert use_few_rows(model) == 0  # already swapped


@pytest.mark.parametrize("plain", [False, True])
def test_layer_stacks_run_a_few_positions_as_one_position_at_a_time(plain):
    """Both halves' LayerStack in float32 on a CPU: every linear is a FewRowsLinear, and a step of 4 positions
    gives, up to float32 rounding, what 4 steps of one position give."""
    from transformers import LlamaConfig

    from infemeral.layers import architecture
    from infemeral.layers.stack import LayerStack

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=100)
    g = torch.Generator().manual_seed(0)
    layer = architecture.decoder_layer_class(config)(config, 0)
    weights = {k: torch.randn(v.shape, generator=g) * 0.05 if v.dim() > 1 else torch.ones(v.shape)
               for k, v in layer.state_dict().items()}
    stack = LayerStack(config, 0, [weights, weights], plain=plain)
    linears = [m for m in stack.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 14 and all(type(m) is FewRowsLinear for m in linears)
    x = torch.randn(8, 128, generator=g)
    together, apart = stack.new_cache(), stack.new_cache()
    stack(x[:4], together)
    stack(x[:4], apart)
    out = stack(x[4:], together)
    one_at_a_time = torch.cat([stack(x[i:i + 1], apart) for i in range(4, 8)])
    torch.testing.assert_close(out, one_at_a_time, rtol=1e-5, atol=1e-5)
