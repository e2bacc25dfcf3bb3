"""GPTQ (Frantar et al., 2022): quantise a weight column by column, letting the columns not yet
quantised absorb each rounding error as the calibration inputs' Hessian says.

For a linear y = x Wᵀ and calibration inputs X (rows: tokens), the output error of a quantised W is
tr((W - Ŵ) H (W - Ŵ)ᵀ) with H = XᵀX. GPTQ rounds one input column at a time and spreads its error
over the remaining columns through the inverse Hessian (via its Cholesky factor), in blocks so the
updates stay matrix products. A group's scale and zero are chosen when its first column comes up,
from the group's columns as updated so far; then its columns are rounded onto that grid.

Here X is whatever the served layer reads: hidden states in the secret basis, after the gain-free
norm (the gains are in the weights). The Hessian is computed on the laptop at prepare time from
calibration text (calibration.py); nothing of it is stored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infemeral.quant import int4
from infemeral.threads import one_thread

DAMP = 0.01   # added to H's diagonal, as a share of its mean: keeps the Cholesky factorisation stable
BLOCK = 128   # columns updated together (a multiple of the group size is used, so groups never straddle)


class Int4Grid:
    """Group-wise asymmetric int4 (int4.py's format). A group's grid is fitted when its first column comes up
    (from the columns as updated so far) or, with `fix_groups` (needed when the columns are not taken in
    order), for every group at once from the weight before any update."""

    def __init__(self, rows: int, cols: int, group_size: int, fit: Callable | None = None):
        self.group_size = group_size
        self.fit = fit or int4.minmax_params
        groups = cols // group_size
        self.scales = torch.empty(rows, groups, dtype=int4.PARAMS_DTYPE)
        self.zeros = torch.empty(rows, groups, dtype=int4.PARAMS_DTYPE)
        self.codes = torch.empty(rows, cols, dtype=torch.uint8)
        self.is_fixed = False

    def fix_groups(self, weight: torch.Tensor) -> None:
        self.scales[:], self.zeros[:] = int4.round_params(*self.fit(int4.group_view(weight.float(),
                                                                                     self.group_size)))
        self._fixed = (self.scales.float(), self.zeros.float())
        self.is_fixed = True

    def begin_group(self, column: int, columns: torch.Tensor) -> None:
        if self.is_fixed:
            return
        g = column // self.group_size
        s, z = int4.round_params(*self.fit(columns.float()))
        self.scales[:, g], self.zeros[:, g] = s, z
        self._s, self._z = s.float(), z.float()

    def round(self, column: int, w: torch.Tensor) -> torch.Tensor:
        if self.is_fixed:
            g = column // self.group_size
            self._s, self._z = self._fixed[0][:, g], self._fixed[1][:, g]
        q = torch.round((w - self._z) / self._s + int4.MID).clamp_(0, 15)
        self.codes[:, column] = q.to(torch.uint8)
        return (q - int4.MID) * self._s + self._z

    def result(self) -> dict[str, torch.Tensor]:
        return int4.stored(self.codes, self.scales, self.zeros)


class Int8RowGrid:
    """Symmetric int8 with one scale per output row (int8.py's format), fixed from the whole row up front."""

    group_size = None

    def __init__(self, weight: torch.Tensor):
        from infemeral.quant.int8 import quantize_rows

        _, self.scales = quantize_rows(weight)  # bfloat16-valued scales, as the round-to-nearest int8 uses
        self._s = self.scales.float()
        self.codes = torch.empty(weight.shape, dtype=torch.int8)

    def fix_groups(self, weight: torch.Tensor) -> None:
        pass  # one grid per row, fixed from the start

    def begin_group(self, column: int, columns: torch.Tensor) -> None:
        pass

    def round(self, column: int, w: torch.Tensor) -> torch.Tensor:
        q = torch.round(w / self._s).clamp_(-127, 127)
        self.codes[:, column] = q.to(torch.int8)
        return q * self._s

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes, self.scales


# A weight at most this big (elements) is quantised on one thread from start to end: its Cholesky factors and block
# products are too small to gain from threads. Measured on 2 busy shared cores, a 1536 x 576 weight took 1.6 s on
# one thread and 12 s with only the column loop on one (the factorisations and block updates on two). Calibration
# runs layers this small on one thread too (calibration.py).
ONE_THREAD_ELEMENTS = 1 << 24


@torch.no_grad()
def gptq(weight: torch.Tensor, hessian: torch.Tensor, grid, damp: float | None = None, act_order: bool = False):
    """Quantise weight [N, K] onto `grid` (Int4Grid or Int8RowGrid) given H [K, K]; returns grid.result().

    `act_order` takes the columns in order of falling H diagonal (the inputs with the most energy first, while
    the most columns remain to absorb their error), with every group's grid fixed up front so the stored
    groups stay in the kernels' column order."""
    with one_thread(weight.numel() <= ONE_THREAD_ELEMENTS):
        return _gptq(weight, hessian, grid, DAMP if damp is None else damp, act_order)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, grid, damp: float, act_order: bool = False):
    w = weight.to(torch.float32).clone()
    h = hessian.to(torch.float64).clone()
    n, k = w.shape
    dead = torch.diagonal(h) == 0  # inputs that were always zero: their weights do not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    order = torch.arange(k)
    if act_order:
        grid.fix_groups(w)
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, order], h[order][:, order]
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    columns = order.tolist()  # the original index of each column as taken
    group = grid.group_size
    block = BLOCK if group is None else group * max(1, BLOCK // group)
    for start in range(0, k, block):
        end = min(start + block, k)
        w1, errors, h1 = w[:, start:end], torch.zeros(n, end - start), h_inv[start:end, start:end]
        with one_thread():
            for i in range(end - start):
                column = start + i
                if group is not None and column % group == 0:
                    grid.begin_group(column, w1[:, i:i + group])
                q = grid.round(columns[column], w1[:, i])
                err = (w1[:, i] - q) / h1[i, i]
                w1[:, i:] -= err.unsqueeze(1) * h1[i, i:].unsqueeze(0)
                errors[:, i] = err
        w[:, end:] -= errors @ h_inv[start:end, end:]  # one big product: all threads
    return grid.result()


def quantize_gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int,
                       fit: Callable | None = None, act_order: bool = True) -> dict[str, torch.Tensor]:
    """Int4 codes of `weight`; by default in activation order with clipped grids (`int4.clipped_params`): on the
    default model's rotated layers (int4 g=64, k/v int8, same basis) that took the output error GPTQ minimises
    down by a tenth and perplexity from 1.114x/1.247x to 1.159x/1.173x of float32 on the two held texts, and at
    g=32 from 1.026x/1.197x to 1.075x/1.124x: better where the plain order was worst (docs/server_quant.md)."""
    return gptq(weight, hessian, Int4Grid(*weight.shape, group_size, fit or int4.clipped_params),
                act_order=act_order)


def quantize_gptq_int8(weight: torch.Tensor, hessian: torch.Tensor,
                       act_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return gptq(weight, hessian, Int8RowGrid(weight), act_order=act_order)
