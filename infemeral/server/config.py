"""The server's frozen configuration and the only home of its defaults: the engine's and the gRPC service's
limits (`ServerSettings.engine_config()`, `.service_limits()` build them from flags; the settings take
their defaults from here). Importing it loads no torch, so `infemeral-server --help` stays quick."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infemeral.kvcache.window import WindowPolicy

DEFAULT_RESERVE_TOKENS = 512  # tokens a turn that declares no reserve_tokens may add within its quota
DEFAULT_MAX_CONTEXT = 8192    # the window's size (its other defaults are WindowPolicy's)
WAITING_SHARE = 0.5           # share of the turn slots that turns waiting for KV pages may hold
STREAMS_PER_TURN_SLOT = 4     # Turn streams per turn slot when max_streams is not set


def default_window() -> WindowPolicy:
    from infemeral.kvcache.window import WindowPolicy  # torch: only once a config is built

    return WindowPolicy(DEFAULT_MAX_CONTEXT)


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"                 # cpu, cuda, cuda:N or auto
    dtype: str = "auto"                  # float32, bfloat16, float16 or auto
    max_step_tokens: int = 2048          # most tokens one step may carry
    max_sessions: int = 64               # most turns open at once
    window: WindowPolicy = field(default_factory=default_window)
    kv_pool_tokens: int = 65536          # the page pool, shared by all open turns
    max_batch_tokens: int = 8192         # most tokens one forward pass carries (at least one step)
    admission_wait: float = 10.0         # seconds a turn waits for KV pages before RESOURCE_EXHAUSTED
    attention_backend: str = "auto"      # auto, torch or flashinfer
    max_batch_hold: float = 0.0          # seconds a batch may wait for sessions about to send a step (0: never)
    default_reserve_tokens: int = DEFAULT_RESERVE_TOKENS  # what a turn that declares nothing may add in its quota
    max_sessions_per_key: int = 0        # most turns one API key may have open (0: no limit per key)
    kv_pool_share_per_key: float = 0.0   # share of the pool the turns of one API key may hold (0 or 1: no limit)
    max_sessions_per_peer: int = 8       # without API keys: most turns one client address may have open (0: none)

    def __post_init__(self):
        if self.num_pages < self.window_pages:
            raise ValueError(f"kv_pool_tokens ({self.kv_pool_tokens}) must hold at least one full session of "
                             f"max_context ({self.window.max_context}) tokens")
        if not 0 <= self.kv_pool_share_per_key <= 1:
            raise ValueError(f"kv_pool_share_per_key must be from 0 to 1, not {self.kv_pool_share_per_key}")

    @property
    def num_pages(self) -> int:
        return max(1, self.kv_pool_tokens // self.window.page_size)

    @property
    def window_pages(self) -> int:
        return -(-self.window.max_context // self.window.page_size)

    @property
    def max_waiting_turns(self) -> int:
        """Most turns that may wait for KV pages at once: the other turn slots stay free for turns that fit."""
        return max(1, int(self.max_sessions * WAITING_SHARE))

    @property
    def pages_per_key(self) -> int:
        """Most pages the turns of one API key may hold (0: no limit); always at least one whole window."""
        if not 0 < self.kv_pool_share_per_key < 1:
            return 0
        return min(self.num_pages, max(self.window_pages, math.ceil(self.kv_pool_share_per_key * self.num_pages)))

    @property
    def batch_token_budget(self) -> int:
        return max(self.max_batch_tokens, self.max_step_tokens)


@dataclass(frozen=True)
class ServiceLimits:
    max_streams: int = 0               # Turn streams open at once, opened or not (0: four per turn slot)
    max_streams_per_key: int = 0       # of those, most with one API key (0: no limit per key)
    max_streams_per_peer: int = 0      # without API keys: most with one client address (0: no limit per address)
    turn_idle_seconds: float = 30.0    # longest wait for a client's next message inside a turn
    max_turn_seconds: float = 3600.0   # longest turn
    delete_threads: int = 8            # threads for session deletes
    max_sessions: int = EngineConfig.max_sessions  # the engine's turn slots, which size max_streams when it is 0

    def __post_init__(self):
        if not self.max_streams:
            object.__setattr__(self, "max_streams", STREAMS_PER_TURN_SLOT * self.max_sessions)
