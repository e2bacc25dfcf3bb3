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

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from infemeral.quant import int4

DAMP = 0.01   # added to H's diagonal, as a share of its mean: keeps the Cholesky factorisation stable
BLOCK = 128   # columns updated together (a multiple of the group size is used, so groups never straddle)


class Int4Grid:
    """Group-wise asymmetric int4 (int4.py's format); a group's grid is fitted when its first column comes up."""

    def __init__(self, rows: int, cols: int, group_size: int, fit: Callable | None = None):
        self.group_size = group_size
        self.fit = fit or int4.minmax_params
        groups = cols // group_size
        self.scales = torch.empty(rows, groups, dtype=int4.PARAMS_DTYPE)
        self.zeros = torch.empty(rows, groups, dtype=int4.PARAMS_DTYPE)
        self.codes = torch.empty(rows, cols, dtype=torch.uint8)

    def begin_group(self, column: int, columns: torch.Tensor) -> None:
        g = column // self.group_size
        s, z = int4.round_params(*self.fit(columns.float()))
        self.scales[:, g], self.zeros[:, g] = s, z
        self._s, self._z = s.float(), z.float()

    def round(self, column: int, w: torch.Tensor) -> torch.Tensor:
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


@contextmanager
def one_thread(active: bool = True) -> Iterator[None]:
    """The column loop is thousands of small operations: on a busy CPU, splitting each over threads costs more
    than it saves (measured on 2 shared cores: a 576 x 1536 weight in 1.7 s on one thread, 28 s on two)."""
    threads = torch.get_num_threads()
    if active:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def gptq(weight: torch.Tensor, hessian: torch.Tensor, grid, damp: float | None = None):
    """Quantise weight [N, K] onto `grid` (Int4Grid or Int8RowGrid) given H [K, K]; returns grid.result()."""
    with one_thread(weight.numel() <= ONE_THREAD_ELEMENTS):
        return _gptq(weight, hessian, grid, DAMP if damp is None else damp)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, grid, damp: float):
    w = weight.to(torch.float32).clone()
    h = hessian.to(torch.float64).clone()
    n, k = w.shape
    dead = torch.diagonal(h) == 0  # inputs that were always zero: their weights do not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
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
                q = grid.round(column, w1[:, i])
                err = (w1[:, i] - q) / h1[i, i]
                w1[:, i:] -= err.unsqueeze(1) * h1[i, i:].unsqueeze(0)
                errors[:, i] = err
        w[:, end:] -= errors @ h_inv[start:end, end:]  # one big product: all threads
    return grid.result()


def quantize_gptq_int4(weight: torch.Tensor, hessian: torch.Tensor, group_size: int,
                       fit: Callable | None = None) -> dict[str, torch.Tensor]:
    return gptq(weight, hessian, Int4Grid(*weight.shape, group_size, fit))


def quantize_gptq_int8(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gptq(weight, hessian, Int8RowGrid(weight))
