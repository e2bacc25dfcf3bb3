"""Products of a few rows by a float32 weight on a CPU, as weight @ xᵀ.

A step that verifies drafts sends a few positions through every layer. MKL's kernel for a product of
a few rows by a weight (`F.linear`, as transformers computes it) costs nearly as much per row as one
row does, while the same product written as weight @ xᵀ streams the weight once for all of them. The
default model's 29 served layers on 2 AVX2 cores: one position 50 ms either way; 2 / 3 / 4 positions
85 / 99 / 88 ms with `F.linear` against 70 / 85 / 74 ms with weight @ xᵀ; from 5 positions on
`F.linear` is the faster again (8 positions: 79 against 100 ms), hence `FEW_ROWS`. A wide table read
by a few rows (the LM head) gains up to more rows and passes its own limit.

One row (a plain decode step) and more rows than the limit (a prompt) stay on `F.linear`, bit for bit
what transformers computes; in between the numbers are the same up to float32 rounding, as a product
of several rows already is against one row at a time. Small weights that stay in the cache (a draft
head's) gain nothing: they keep `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FEW_ROWS = 4


def takes_few_rows(weight: torch.Tensor) -> bool:
    """Whether products with `weight` take the weight @ xᵀ form: a dense float32 weight on a CPU."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and not weight.is_mkldnn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           most: int = FEW_ROWS) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; for 2..`most` rows of a float32 CPU weight, as weight @ xᵀ."""
    flat = x.reshape(-1, x.shape[-1])
    if not 2 <= len(flat) <= most or not takes_few_rows(weight):
        return F.linear(x, weight, bias)
    y = (weight @ flat.T).T
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class FewRowsLinear(torch.nn.Linear):
    """An nn.Linear whose products of a few rows take the weight @ xᵀ form (`linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_few_rows(module: torch.nn.Module) -> int:
    """Every plain nn.Linear under `module` holding a float32 CPU weight becomes a FewRowsLinear over the same
    tensors (quantised and packed linears are left alone); returns how many."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and takes_few_rows(child.weight):
                few = FewRowsLinear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                few.weight, few.bias = child.weight, child.bias
                setattr(parent, name, few.train(child.training))
                swapped += 1
    return swapped
