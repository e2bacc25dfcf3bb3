"""HQQ (half-quadratic quantisation, Badri & Shaji 2023): a data-free fit of each group's zero point.

Round-to-nearest puts each group's grid on its min..max range; one outlier column then stretches the
grid of every row's group it falls in. HQQ keeps the min-max scale and moves the zero point to
minimise an lp-norm (p < 1) of the rounding error, which lets a few outliers be badly represented
so that the many ordinary weights are well represented. It needs no data, runs in seconds per layer,
and its result is an ordinary scale-and-zero grid (int4.py's format, the kernels' format).

The solver is the `hqq` package's own (`optimize_weights_proximal_legacy`, what its quantiser runs by
default), called on the groups of one weight at a time.
"""

from __future__ import annotations

import torch

from infemeral.quant import int4

# hqq's defaults for its proximal solver
OPT_PARAMS = {"lp_norm": 0.7, "beta": 1e1, "kappa": 1.01, "iters": 20}


def hqq_params(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros (int4.py's convention: w ≈ (q - 8)·s + z) fitted by HQQ to groups [..., g]."""
    try:
        from hqq.core.optimize import optimize_weights_proximal_legacy
    except ImportError:
        raise ValueError("the hqq method needs the hqq package: pip install 'infemeral[quant]'") from None

    shape = groups.shape[:-1]
    w = groups.reshape(-1, groups.shape[-1]).float()
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    inv_scale = (15 / (hi - lo)).clamp(max=2e4)  # hqq's parametrisation: q = round(w · inv_scale + zero)
    zero = -lo * inv_scale
    _, inv_scale, zero = optimize_weights_proximal_legacy(w, inv_scale, zero, min_max=[0, 15], axis=1,
                                                          device="cpu", opt_params=dict(OPT_PARAMS))
    scale = 1 / inv_scale
    return scale.reshape(shape), ((int4.MID - zero) * scale).reshape(shape)


def quantize_hqq(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Int4 codes of one weight [N, K] on HQQ-fitted grids: {"qweight", "scales", "zeros"}."""
    w = weight.float()
    scales, zeros = int4.round_params(*hqq_params(int4.group_view(w, group_size)))
    return int4.stored(int4.codes_for(w, scales, zeros), scales, zeros)
