"""Attention sinks + a sliding window over cache-relative positions (StreamingLLM).

The window keeps the first `sink_tokens` positions and the most recent tokens,
at most `max_context` in all. When a step would overflow it, whole pages of the
oldest non-sink tokens are evicted, the survivors move down, and their keys are
re-rotated by the shift: RoPE is a rotation, R(p - e) = R(-e)·R(p), applied with
pure angles (inv_freq only — never the attention scaling some RoPE variants
fold into cos/sin, which the stored keys already carry).

The client's local layers and the server's layers both call `apply_window`
with the same policy before the same step, so both caches always agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from infemeral.errors import FailedPrecondition, OutOfRange
from infemeral.kvcache.cache import KVCache

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# rope types whose frequencies do not depend on position (or only beyond the original context)
SHIFTABLE = {"default", "linear", "llama3", "yarn"}
LENGTH_DEPENDENT = {"dynamic", "longrope"}


@dataclass(frozen=True)
class WindowPolicy:
    max_context: int
    sink_tokens: int = 4
    page_size: int = 16
    enabled: bool = True
    rerotate: bool = True  # False only for experiments: shows why re-rotation is needed

    def __post_init__(self):
        if self.enabled and self.max_context < self.sink_tokens + 2 * self.page_size:
            raise ValueError(f"max_context ({self.max_context}) must hold the {self.sink_tokens} sink tokens "
                             f"and at least two pages of {self.page_size}")

    @property
    def max_step(self) -> int:
        """Most tokens one step may add (the window must still hold the sinks)."""
        return self.max_context - self.sink_tokens if self.enabled else self.max_context

    def tokens_to_evict(self, length: int, incoming: int) -> int:
        """How many tokens after the sinks to drop before adding `incoming`: whole pages, oldest first."""
        overflow = length + incoming - self.max_context
        if overflow <= 0:
            return 0
        if not self.enabled:
            raise OutOfRange(f"this step would grow the session to {length + incoming} tokens, over the "
                             f"server's max_context of {self.max_context} (its window is off): send a shorter "
                             "message, or start a new conversation if this one has grown long")
        if incoming > self.max_step:
            raise OutOfRange(f"a step of {incoming} tokens cannot fit a window of {self.max_context} tokens "
                             f"with {self.sink_tokens} sinks; send at most {self.max_step} per step")
        pages = -(-overflow // self.page_size)
        return min(pages * self.page_size, length - self.sink_tokens)


def rope_shift_frequencies(rotary: torch.nn.Module, config: PretrainedConfig, max_context: int) -> torch.Tensor:
    """The pure RoPE angles per position (inv_freq) used to re-rotate keys, or a clear refusal."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type in LENGTH_DEPENDENT:
        original = params.get("original_max_position_embeddings") or config.max_position_embeddings
        if max_context > original:
            raise FailedPrecondition(f"{rope_type} RoPE changes its frequencies past {original} positions, so keys "
                                     f"cannot be shifted exactly; set max_context <= {original}")
    elif rope_type not in SHIFTABLE:
        raise FailedPrecondition(f"RoPE type {rope_type!r} cannot be shifted exactly; the sliding window is not "
                                 "supported for this model")
    return rotary.inv_freq.detach().to(torch.float64).cpu()


def rerotate(keys: torch.Tensor, shift: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [..., T, head_dim] with RoPE at positions p, returned at positions p + shift."""
    angles = shift * inv_freq
    work = keys.float()  # rotate in fp32 even for half-precision caches
    cos = torch.cat([angles.cos(), angles.cos()]).to(keys.device, work.dtype)
    sin = torch.cat([angles.sin(), angles.sin()]).to(keys.device, work.dtype)
    half = keys.shape[-1] // 2
    rotated_half = torch.cat([-work[..., half:], work[..., :half]], dim=-1)
    return (work * cos + rotated_half * sin).to(keys.dtype)


def unchanged(keys: torch.Tensor) -> torch.Tensor:
    return keys


def apply_window(cache: KVCache, policy: WindowPolicy, incoming: int, inv_freq: torch.Tensor) -> int:
    """Make room for `incoming` tokens; return how many tokens were evicted (0 if none).

    The re-keying is a plain function of the keys (picklable: a tensor-parallel server sends it to every
    rank, each of which re-keys its own KV heads)."""
    evict = policy.tokens_to_evict(cache.length, incoming)
    if evict:
        rekey = partial(rerotate, shift=-evict, inv_freq=inv_freq) if policy.rerotate else unchanged
        cache.evict(policy.sink_tokens, evict, rekey)
    return evict
