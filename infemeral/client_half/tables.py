"""Token tables: one [vocab, d] table serves the embedding lookup and, for a tied model, the LM head.

Dense in the compute dtype, or int8 codes with a scale per row (`infemeral.quant.int8`): the lookup
dequantises only the rows it reads, the head multiplies by the whole table through the int8 kernel.
"""

from __future__ import annotations

import torch

from infemeral.client_half import packed
from infemeral.layers import few_rows
from infemeral.quant.int8 import aligned, dequantize_rows, int8_matmul

HEAD_FEW_ROWS = 16  # a wide table gains from the weight @ hiddenᵀ form up to more rows than a layer does


class DenseTokenTable:
    """A [vocab, d] table in the compute dtype; a tied model uses one for its embedding and its head."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of `hidden` [..., d], as transformers' LM head computes them, except that in float32 on a CPU
        a few rows (a step with drafts to verify) are multiplied as weight @ hiddenᵀ (`few_rows`; for the default
        model's 49152-token head on 2 AVX2 cores, 2 rows 20.6 ms as `F.linear` against 8.0; 3 rows 31.5 against
        8.9; one row 9.3 either way)."""
        return few_rows.linear(hidden, self.weight, most=HEAD_FEW_ROWS)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def rows(self, ids: torch.Tensor):
        """A table of only `ids`' rows (a draft head's reduced vocabulary), in this one's dtype and device: packed
        where they pack, since the copy serves no lookups."""
        weight = self.weight[ids].contiguous()
        if packed.packs(weight.device.type, weight.dtype):
            return packed.PackedHead(weight)
        return DenseTokenTable(weight)

    def dense(self) -> torch.Tensor:
        """The whole table in float32 (for analysis, e.g. the privacy audit's norm matching)."""
        return self.weight.float()


class Int8TokenTable:
    """An int8 [vocab, d] table with per-row scales serving both the embedding lookup and the LM head.

    A tied model keeps one table for both: the lookup dequantises only the rows it reads, the head
    multiplies by the whole table through the int8 kernel.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, device: torch.device):
        self.codes = aligned(codes.to(device))
        self.scales = scales.to(device, torch.float32)
        self.kernel_scales = scales.to(device, dtype)
        self.dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(self.codes[ids], self.scales[ids], self.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return int8_matmul(hidden, self.codes, self.kernel_scales)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales, self.kernel_scales]

    def rows(self, ids: torch.Tensor) -> "Int8TokenTable":
        """A table of only `ids`' rows (a draft head's reduced vocabulary), int8 as this one."""
        return Int8TokenTable(self.codes[ids], self.scales[ids], self.dtype, self.codes.device)

    def dense(self) -> torch.Tensor:
        """The whole table dequantised to float32 (for analysis, e.g. the privacy audit's norm matching)."""
        return dequantize_rows(self.codes, self.scales, torch.float32)
