"""The secret basis Q: a Haar-random orthogonal matrix drawn from a CSPRNG.

Gaussian samples come from an AES-256-CTR keystream under a fresh random key
(so the basis is as unpredictable as the OS random source, unlike a 64-bit
torch seed), via Box-Muller; QR with sign correction makes Q Haar-distributed.
Q never leaves the client.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


def _csprng_gaussians(count: int, seed: bytes) -> np.ndarray:
    n_pairs = (count + 1) // 2
    stream = Cipher(algorithms.AES(seed), modes.CTR(b"\0" * 16)).encryptor()
    raw = np.frombuffer(stream.update(b"\0" * (n_pairs * 16)), dtype=np.uint64).reshape(-1, 2)
    # 53-bit uniforms in (0, 1]; never 0 so the log is finite.
    u = ((raw >> np.uint64(11)).astype(np.float64) + 1.0) / float(1 << 53)
    r = np.sqrt(-2.0 * np.log(u[:, 0]))
    theta = 2.0 * np.pi * u[:, 1]
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)])[:count]


def random_orthogonal(d: int, seed: bytes | None = None) -> torch.Tensor:
    """A d x d Haar-random orthogonal matrix in float64."""
    seed = os.urandom(32) if seed is None else seed
    if len(seed) != 32:
        raise ValueError("basis seed must be 32 bytes")
    g = torch.from_numpy(_csprng_gaussians(d * d, seed).reshape(d, d))
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)
