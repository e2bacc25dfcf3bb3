"""Solving the secret basis from the server bundle, for an operator who has the public weights.

A layer that writes the residual stream is stored as W_rot = Qᵀ·W (docs/design.md §1). Then
W·W_rotᵀ = (W·Wᵀ)·Q, a symmetric positive definite matrix times Q, whose orthogonal polar
factor is Q itself: the orthogonal Procrustes solution. o_proj needs no norm gains, so one
matrix of the first served layer is enough. Singular values do not change under rotation,
so the same matrices also identify which public model the bundle came from.
"""

from __future__ import annotations

import torch


def solve_basis(public: torch.Tensor, rotated: torch.Tensor) -> torch.Tensor:
    """Q̂ [d, d] (float64) from a public residual-writing weight W [d, k] and its rotated copy Qᵀ·W."""
    u, _, vh = torch.linalg.svd(public.double() @ rotated.double().T)
    return u @ vh


def spectrum_difference(public: torch.Tensor, rotated: torch.Tensor) -> float:
    """Largest relative difference between the two matrices' singular values (≈ 0: the same model)."""
    a = torch.linalg.svdvals(public.double())
    b = torch.linalg.svdvals(rotated.double())
    return float(((a - b).abs() / a.max()).max())
