"""Attention over an infemeral KV cache, registered with transformers.

The model's own attention modules do the projections, q/k norms and RoPE and
then call this function with the full keys/values the cache returned. Queries
are the *last* n positions of the cache, so causality is offset by T - n
(torch's `is_causal` would align top-left, which is wrong with a cache).
On the server, `paged` carries a batch of sessions whose keys/values live in
the page pool (see paged_attention.py). Layers with a native sliding window (Mistral v0.1, Qwen2/3 sliding layers) pass
`sliding_window`; a query then sees only the last `sliding_window` keys up to
itself, as transformers' own sliding-window mask does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "infemeral_cache"


def attend(query, key, value, scaling, sliding_window=None):
    """query [B, H, n, D] = the last n positions of key/value [B, KVH, t, D]; returns [B, n, H, D]."""
    n, t = query.shape[2], key.shape[2]
    mask = None
    if n > 1:
        mask = torch.ones(n, t, dtype=torch.bool, device=query.device).tril(t - n)
    if sliding_window is not None and t > sliding_window:
        if mask is None:
            mask = torch.ones(n, t, dtype=torch.bool, device=query.device)
        mask = mask.triu(t - n - sliding_window + 1)  # key j visible to query i iff j > (t - n + i) - window
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2)


def cache_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                    sliding_window=None, paged=None, **kwargs):
    if paged is not None:  # a batch of sessions on the server's page pool
        return paged.attend(module.layer_idx, query, scaling, sliding_window), None
    return attend(query, key, value, scaling, sliding_window).contiguous(), None


AttentionInterface.register(NAME, cache_attention)
