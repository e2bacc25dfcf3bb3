"""Token sampling on the client: greedy, temperature, top-k, top-p, repetition penalty."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infemeral.speculation.source import SPECULATE

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """temperature 0 means greedy decoding."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    # where drafts come from: "auto" (whichever available source is fastest, step by step), "ngram" (the
    # conversation and earlier answers), "draft" (also a local draft model), "head" (a draft head) or "off"
    speculate: str = "auto"
    max_draft: int = 8        # most drafted tokens per step (the adaptive length stays below it)
    draft_trees: bool = True  # a draft head may send a tree of candidates where the server verifies trees

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.speculate not in SPECULATE:
            raise ValueError(f"speculate must be one of {', '.join(SPECULATE)}, not {self.speculate!r}")
        if self.max_draft < 0:
            raise ValueError("max_draft must be >= 0")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be between {SEED_MIN} and {SEED_MAX}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, context_ids: list[int]) -> int:
        """Pick the next token from a [vocab] logits vector."""
        if self.params.temperature == 0:
            return int(torch.argmax(self.penalized(logits, context_ids)))
        probs = self.probabilities(logits, context_ids)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def penalized(self, logits: torch.Tensor, context_ids: list[int]) -> torch.Tensor:
        """The logits after the repetition penalty (a float copy; the input is not modified)."""
        p = self.params
        logits = logits.float().clone()
        if p.repetition_penalty != 1.0 and context_ids:
            ids = torch.tensor(sorted(set(context_ids)), dtype=torch.long)
            seen = logits[ids]
            logits[ids] = torch.where(seen < 0, seen * p.repetition_penalty, seen / p.repetition_penalty)
        return logits

    def probabilities(self, logits: torch.Tensor, context_ids: list[int]) -> torch.Tensor:
        """The distribution a sampled token is drawn from (temperature > 0): penalty, temperature, top-k, top-p."""
        p = self.params
        if p.temperature == 0:
            raise ValueError("greedy decoding has no sampling distribution")
        logits = self.penalized(logits, context_ids)
        # From the top down, and never below float32's smallest normal: a tiny temperature cannot make inf - inf.
        logits = (logits - logits.max()) / max(p.temperature, torch.finfo(logits.dtype).tiny)
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits[logits < kth] = float("-inf")
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= p.top_p  # keep the first token always
            logits[order[drop]] = float("-inf")
        return torch.softmax(logits, dim=-1)


def generation_defaults(generation_config) -> dict:
    """The sampling a model's authors recommend (its generation config), as SamplingParams fields.

    As in transformers, temperature, top-p and top-k apply only when the config samples (`do_sample`);
    a repetition penalty applies to greedy decoding too. Fields the config does not set are left out."""
    defaults = {}
    if getattr(generation_config, "do_sample", None):
        for name in ("temperature", "top_p", "top_k"):
            value = getattr(generation_config, name, None)
            if value is not None:
                defaults[name] = value
    penalty = getattr(generation_config, "repetition_penalty", None)
    if penalty is not None:
        defaults["repetition_penalty"] = penalty
    return defaults


# How `chat` and `generate` sample where the model's generation config does not: SmolLM2's, for one, sets no sampling
# at all, and greedy decoding of a small model falls into loops ("A gentle rain, a gentle rain, ..."). Close to what
# local chat programs use (ollama: temperature 0.8, top-p 0.9, repeat penalty 1.1), a little cooler for fewer made-up
# facts; a penalty of 1.1 only scales down tokens already in the context, enough to break a loop without steering the
# answer away from words it needs. The SDK's own default stays greedy.
CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}


def chat_defaults(generation_config, *, is_greedy: bool = False) -> dict:
    """Sampling defaults for an answer at the command line: the model's generation config where it samples, else
    CHAT_SAMPLING under what the config does set. `is_greedy` (temperature 0 asked for) keeps only what greedy
    decoding reads from the config (its repetition penalty), so greedy decoding stays what `transformers` does with
    it: the exactness reference."""
    model = generation_defaults(generation_config)
    if is_greedy:
        return {k: v for k, v in model.items() if k == "repetition_penalty"}
    if getattr(generation_config, "do_sample", None):
        return model
    return {**CHAT_SAMPLING, **model}
