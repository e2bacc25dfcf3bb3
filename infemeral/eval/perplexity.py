"""Perplexity of the plain (unsplit) model over a long text under each KV-window mode.

Reproduces, in kind, the StreamingLLM result (Xiao et al., 2023): a sliding
window that keeps a few attention-sink tokens stays close to dense attention,
while a window that drops the first tokens, or one that does not re-rotate the
surviving keys after an eviction, does much worse.

The model's own decoder layers run through `LayerStack` over our `KVCache`, and
`apply_window(cache, policy, 1, inv_freq)` is called before every step, exactly
as the client and the server do. The window modes feed the text one token at a
time (after a prefill that fits in the window without evicting); dense attention
never evicts, so it is run in larger chunks, which is the same computation.

The study that writes docs/window_perplexity.md is scripts/studies/perplexity.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from infemeral.eval.metrics import perplexity
from infemeral.kvcache.window import WindowPolicy, apply_window, rope_shift_frequencies
from infemeral.layers import architecture
from infemeral.layers.stack import LayerStack

DENSE = "dense"
SINKS = "sinks + window"
NO_SINKS = "window, no sinks"
NO_REROTATE = "sinks + window, no re-rotation"
MODES = (DENSE, SINKS, NO_SINKS, NO_REROTATE)


def policies(window: int, sink_tokens: int = 4, page_size: int = 16,
             length: int | None = None) -> dict[str, WindowPolicy]:
    """The four policies compared, for a window of `window` tokens (dense holds `length` tokens)."""
    return {
        DENSE: WindowPolicy(max(length or 0, window), sink_tokens, page_size, enabled=False),
        SINKS: WindowPolicy(window, sink_tokens, page_size),
        NO_SINKS: WindowPolicy(window, 0, page_size),
        NO_REROTATE: WindowPolicy(window, sink_tokens, page_size, rerotate=False),
    }


class PlainModel:
    """Embedding, every decoder layer (one LayerStack), final norm and LM head of one model."""

    def __init__(self, config: PretrainedConfig, state_dict: Mapping[str, torch.Tensor],
                 dtype: torch.dtype = torch.float32):
        self.config = config
        prefix = "model." if any(k.startswith("model.layers.") for k in state_dict) else ""
        per_layer = []
        for i in range(config.num_hidden_layers):
            head = f"{prefix}layers.{i}."
            per_layer.append({k[len(head):]: v for k, v in state_dict.items() if k.startswith(head)})
        self.layers = LayerStack(config, 0, per_layer, dtype=dtype)
        self.embed = state_dict[f"{prefix}embed_tokens.weight"].to(dtype)
        self.lm_head = state_dict.get("lm_head.weight", state_dict[f"{prefix}embed_tokens.weight"]).to(dtype)
        self.norm = architecture.norm_class(config)(config.hidden_size, eps=config.rms_norm_eps)
        self.norm.weight.data = state_dict[f"{prefix}norm.weight"].to(dtype)
        self.norm.requires_grad_(False)

    @classmethod
    def from_transformers(cls, model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> "PlainModel":
        return cls(model.config, model.state_dict(), dtype)

    def inv_freq(self, max_context: int) -> torch.Tensor:
        return rope_shift_frequencies(self.layers.rotary, self.config, max_context)

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """Append tokens `ids` [n] to `cache`; logits of the next token at each: [n, vocab], float32."""
        hidden = self.layers(self.embed[ids], cache)
        return (self.norm(hidden.unsqueeze(0))[0] @ self.lm_head.T).float()

    def step(self, ids: torch.Tensor, cache) -> torch.Tensor:
        """As `logits`, as log-probabilities."""
        return torch.log_softmax(self.logits(ids, cache), dim=-1)


class Windowed:
    """`model` as an evaluation system (`infemeral.eval.metrics`) whose cache keeps `policy`'s window: the window
    is applied before every part fed, as the client and the server apply it before every step."""

    def __init__(self, model: PlainModel, policy: WindowPolicy, capacity: int):
        self.model, self.policy, self.capacity = model, policy, capacity
        self.inv_freq = model.inv_freq(policy.max_context)
        self.evictions = 0  # parts that evicted

    def new_cache(self):
        return self.model.layers.new_cache(capacity=self.capacity)

    def logits(self, ids: list[int], cache) -> torch.Tensor:
        self.evictions += bool(apply_window(cache, self.policy, len(ids), self.inv_freq))
        return self.model.logits(torch.tensor(ids, dtype=torch.long), cache)


@dataclass
class Result:
    mode: str
    policy: WindowPolicy
    tokens: int  # tokens whose probability was scored (len(ids) - 1)
    nll: float  # mean negative log-likelihood, nats per token
    evictions: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@torch.inference_mode()
def score_window(model: PlainModel, ids: list[int] | torch.Tensor, policy: WindowPolicy, prefill: int = 16,
                 dense_chunk: int = 512, mode: str = "") -> Result:
    """Score every token after the first: NLL of ids[t + 1] given ids[: t + 1] as the window keeps them.

    The first `prefill` tokens (at most what fits without evicting) go in one step, then one token per step,
    each step preceded by `apply_window(cache, policy, 1, inv_freq)`. A disabled policy (dense) never evicts,
    so it runs in chunks of `dense_chunk`, which gives the same numbers as token by token.
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    n = ids.shape[0]
    if n < 2:
        raise ValueError("need at least two tokens")
    if not policy.enabled and policy.max_context < n:
        raise ValueError(f"dense attention needs max_context >= {n} tokens, got {policy.max_context}")
    system = Windowed(model, policy, capacity=min(n, policy.max_context) + 1)
    first = max(1, min(prefill, policy.max_context - 1 if policy.enabled else n))
    start = time.perf_counter()
    ppl = perplexity(system, ids.tolist(), chunk=1 if policy.enabled else max(1, dense_chunk), first=first)
    return Result(mode, policy, n - 1, math.log(ppl), system.evictions, time.perf_counter() - start)


def compare(model: PlainModel, ids: list[int] | torch.Tensor, window: int, sink_tokens: int = 4,
            page_size: int = 16, modes: tuple[str, ...] = MODES, prefill: int = 16,
            progress: Callable[[Result], None] | None = None) -> dict[str, Result]:
    """Perplexity of the same tokens under each mode for one window size."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    chosen = policies(window, sink_tokens, page_size, length=ids.shape[0])
    results = {}
    for mode in modes:
        results[mode] = score_window(model, ids, chosen[mode], prefill=prefill, mode=mode)
        if progress:
            progress(results[mode])
    return results


def tokenize(tokenizer, text: str, limit: int | None = None) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[:limit] if limit else ids
