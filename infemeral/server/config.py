"""The engine's configuration: one frozen object, built from `ServerSettings.engine_config()`."""

from __future__ import annotations

from dataclasses import dataclass, field

from infemeral.kvcache.window import WindowPolicy


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"                 # cpu, cuda, cuda:N or auto
    dtype: str = "auto"                  # float32, bfloat16, float16 or auto
    max_step_tokens: int = 2048          # most tokens one step may carry
    max_sessions: int = 64               # most turns open at once
    window: WindowPolicy = field(default_factory=lambda: WindowPolicy(8192))
    kv_pool_tokens: int = 65536          # the page pool, shared by all open turns
    max_batch_tokens: int = 8192         # most tokens one forward pass carries (at least one step)
    admission_wait: float = 10.0         # seconds a turn waits for KV pages before RESOURCE_EXHAUSTED
    attention_backend: str = "auto"      # auto, torch or flashinfer
    max_batch_hold: float = 0.0          # seconds a batch may wait for sessions about to send a step (0: never)

    def __post_init__(self):
        if self.num_pages < -(-self.window.max_context // self.window.page_size):
            raise ValueError(f"kv_pool_tokens ({self.kv_pool_tokens}) must hold at least one full session of "
                             f"max_context ({self.window.max_context}) tokens")

    @property
    def num_pages(self) -> int:
        return max(1, self.kv_pool_tokens // self.window.page_size)

    @property
    def batch_token_budget(self) -> int:
        return max(self.max_batch_tokens, self.max_step_tokens)
