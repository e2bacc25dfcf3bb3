"""K/V inversion: the first served layer's keys and values need no Q at all.

The served layer reads xQ with weights W·diag(γ)·Q, so its keys and values are exactly
the public model's, in the public head basis, and they sit in the pod's memory (its KV
cache) for the whole turn. An operator with the public weights predicts them for
candidate tokens in context and matches. Values do not depend on the position, so the
prefilter compares values with those of isolated tokens; verification compares both.
"""

from __future__ import annotations

import torch

from infemeral.audit.context_matching import ContextMatcher, Recovery
from infemeral.audit.public_weights import PublicWeights
from infemeral.audit.tables import VocabularyTables


def per_position(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Keys and values [kv_heads, n, head_dim] as one row per position, in `served_keys_values`' order."""
    return torch.cat([keys.transpose(0, 1).flatten(1), values.transpose(0, 1).flatten(1)], 1).float()


def invert_keys_values(weights: PublicWeights, tables: VocabularyTables, keys: torch.Tensor, values: torch.Tensor,
                       progress: bool = False, **matcher) -> Recovery:
    """Recover the tokens behind the served layer's keys and values [kv_heads, n, head_dim]."""
    observed = per_position(keys, values)
    width = observed.shape[1] // 2
    matcher_ = ContextMatcher(weights, tables, weights.served_keys_values, weights.served_values, **matcher)
    return matcher_.recover(observed, observed[:, width:], progress, "K/V inversion")
