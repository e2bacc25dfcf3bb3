"""Attention over an infemeral KV cache: the attention function transformers' layers call (registered as
`NAME` by transformers_modeling.py) and plain_decoder.py's layers call directly.

The model's own attention modules do the projections, q/k norms and RoPE and
then call this function with the full keys/values the cache returned. Queries
are the *last* n positions of the cache, so causality is offset by T - n
(torch's `is_causal` would align top-left, which is wrong with a cache).
On the server, `paged` carries a batch of sessions whose keys/values live in
the page pool (see attention_backends/). Layers with a native sliding window (Mistral v0.1, Qwen2/3 sliding layers) pass
`sliding_window`; a query then sees only the last `sliding_window` keys up to
itself, as transformers' own sliding-window mask does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "infemeral_cache"


def attend(query, key, value, scaling, sliding_window=None, mask=None):
    """query [B, H, n, D] = the last n positions of key/value [B, KVH, t, D]; returns [B, n, H, D].

    `mask` [n, t] (True: the query may read the key) replaces causality where the keys are not one
    sequence in order (a draft head's unrolled training passes). With grouped-query attention the
    G = H / KVH query heads that share a KV head are folded into the query rows, so each KV head is
    read once (no repeat of keys/values)."""
    b, h, n, d = query.shape
    kvh, t = key.shape[1], key.shape[2]
    windowed = sliding_window is not None and t > sliding_window
    if mask is not None:
        if windowed:
            raise ValueError("an explicit attention mask and a sliding window do not combine")
    elif n == t and not windowed:  # prefill of an empty cache: plain causal attention
        out = F.scaled_dot_product_attention(query, key, value, is_causal=n > 1, scale=scaling,
                                             enable_gqa=kvh != h)
        return out.transpose(1, 2)
    elif n > 1:
        mask = torch.ones(n, t, dtype=torch.bool, device=query.device).tril(t - n)
    if windowed:
        if mask is None:
            mask = torch.ones(n, t, dtype=torch.bool, device=query.device)
        mask = mask.triu(t - n - sliding_window + 1)  # key j visible to query i iff j > (t - n + i) - window
    g = h // kvh
    folded = query.reshape(b, kvh, g * n, d)  # head kvh*j + i uses KV head j, as in repeat_interleave
    if mask is not None and g > 1:
        mask = mask.repeat(g, 1)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, n, d).transpose(1, 2)


def cache_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                    sliding_window=None, paged=None, **kwargs):
    if paged is not None:  # a batch of sessions on the server's page pool
        return paged.attend(module.layer_idx, query, scaling, sliding_window), None
    mask = attention_mask if attention_mask is not None and attention_mask.dtype == torch.bool else None
    return attend(query, key, value, scaling, sliding_window, mask).contiguous(), None

