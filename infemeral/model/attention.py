"""Attention over an infemeral KV cache, registered with transformers.

The model's own attention modules do the projections, q/k norms and RoPE and
then call this function with the full keys/values the cache returned. Queries
are the *last* n positions of the cache, so causality is offset by T - n
(torch's `is_causal` would align top-left, which is wrong with a cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "infemeral_cache"


def cache_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    n, t = query.shape[2], key.shape[2]
    mask = None
    if n > 1:
        mask = torch.ones(n, t, dtype=torch.bool, device=query.device).tril(t - n)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, cache_attention)
