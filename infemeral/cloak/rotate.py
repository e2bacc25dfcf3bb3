"""Fold RMSNorm gains into the following linears and rotate a layer into the secret basis.

For a pre-norm layer and hidden states x in the secret basis (x' = x Q):
  * weights that read the residual stream (q, k, v, gate, up) become W·diag(γ)·Q,
  * weights that write it (o, down) become Qᵀ·W and their bias b·Q,
  * the norms keep their eps but lose their gain (γ = 1), because rms(xQ) = rms(x).
Then the layer computes f(xQ) = f(x)Q exactly (docs/design.md §1). All arithmetic is
done in float64 and cast once, tensor by tensor (so only one float64 matrix
is alive at a time: a big layer's float64 copy would be 4x its bf16 size).
"""

from __future__ import annotations

import torch

from infemeral.layers.architecture import NORM_FEEDS, WRITES_RESIDUAL


def rotate_layer(weights: dict[str, torch.Tensor], q: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Return the rotated, norm-folded state dict of one decoder layer (names relative to the layer)."""
    q = q.to(torch.float64)
    rotated = {f"{m}.weight" for m in (*WRITES_RESIDUAL, *(r for rs in NORM_FEEDS.values() for r in rs))}
    out = {name: t.to(dtype).contiguous() for name, t in weights.items() if name not in rotated}
    for norm, readers in NORM_FEEDS.items():
        gain = weights[f"{norm}.weight"].to(torch.float64)
        for reader in readers:
            w = weights[f"{reader}.weight"].to(torch.float64)
            out[f"{reader}.weight"] = ((w * gain.unsqueeze(0)) @ q).to(dtype).contiguous()
            del w
        out[f"{norm}.weight"] = torch.ones_like(out[f"{norm}.weight"])
    for writer in WRITES_RESIDUAL:
        out[f"{writer}.weight"] = (q.T @ weights[f"{writer}.weight"].to(torch.float64)).to(dtype).contiguous()
        bias = weights.get(f"{writer}.bias")
        if bias is not None:
            out[f"{writer}.bias"] = (bias.to(torch.float64) @ q).to(dtype).contiguous()
    return out
