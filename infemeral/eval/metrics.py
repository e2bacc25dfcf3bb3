"""The measures every evaluation holds a system to: perplexity, greedy answers, teacher-forced top-1 agreement.

A system is anything with `new_cache()` and `logits(ids, cache)` ([len(ids), vocab], appending `ids` to the
cache): the plain model, the split in float32, a user's bundles (`infemeral.eval.systems`), or a windowed
model (`infemeral.eval.perplexity`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from importlib import resources
from importlib.resources.abc import Traversable
from typing import NamedTuple, Protocol

import torch

from infemeral.quant.agreement import Agreement

# Held text for perplexity, shipped as package data and never calibrated on: Genesis 37-40 (King James Version,
# public domain; its provenance in data/README.md).
DEFAULT_TEXT: Traversable = resources.files("infemeral.eval") / "data" / "kjv_genesis_37-40.txt"
CHUNK = 256  # tokens fed at a time when scoring (dense attention: the same numbers as one at a time)


class Sequence(NamedTuple):
    """A prompt and a continuation of it: what teacher-forced measures compare systems on."""

    prompt: list[int]
    continuation: list[int]


class System(Protocol):
    def new_cache(self): ...

    def logits(self, ids: list[int], cache) -> torch.Tensor: ...


def perplexity(system: System, ids: list[int], chunk: int = CHUNK, first: int | None = None,
               advance: Callable[[int], object] = lambda n: None) -> float:
    """exp(mean NLL) of ids[1:] given the ids before each, fed `first` tokens (default: `chunk`) and then `chunk`
    at a time; `advance(n)` after each part of n tokens (a progress bar's update)."""
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise ValueError("need at least two tokens")
    cache, total, start = system.new_cache(), 0.0, 0
    while start < len(ids) - 1:
        part = ids[start:min(start + (first if start == 0 and first else chunk), len(ids) - 1)]
        logp = torch.log_softmax(system.logits(part, cache).float(), dim=-1)
        targets = torch.tensor(ids[start + 1:start + 1 + len(part)], device=logp.device)
        total -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        start += len(part)
        advance(len(part))
    return math.exp(total / (len(ids) - 1))


@torch.inference_mode()
def greedy_sequences(system: System, prompts: list[list[int]], positions: int, stop: set[int],
                     per_prompt: int | None = None,
                     advance: Callable[[int], object] = lambda n: None) -> list[Sequence]:
    """Greedy continuations from `system`, up to `per_prompt` tokens each, until `positions` tokens in all;
    `advance(1)` after each token. A continuation that stops at once is left out (nothing to compare on), and if
    the prompts run out first they are asked again for continuations twice as long."""
    per_prompt = per_prompt or -(-positions // len(prompts))
    out, total = [], 0
    while total < positions:
        for prompt in prompts:
            cache, ids, generated = system.new_cache(), list(prompt), []
            while len(generated) < per_prompt:
                token = int(system.logits(ids, cache)[-1].argmax())
                if token in stop:
                    break
                generated.append(token)
                ids = [token]
                advance(1)
            if generated:
                out.append(Sequence(list(prompt), generated))
                total += len(generated)
            if total >= positions:
                break
        per_prompt *= 2  # answers that stop early: ask the prompts again for longer ones
        if not out:
            raise ValueError("the reference stops at once on every prompt")
    return out


@torch.inference_mode()
def teacher_forced_logits(system: System, prompt: list[int], continuation: list[int],
                          chunk: int | None = CHUNK) -> torch.Tensor:
    """Logits [len(continuation), vocab]: row i predicts continuation[i] from the prompt and the tokens before it
    (fed `chunk` tokens at a time; None: in one pass)."""
    if not continuation:
        raise ValueError("nothing to compare: the continuation is empty")
    cache = system.new_cache()
    ids = list(prompt) + list(continuation[:-1])
    chunk = chunk or len(ids)
    rows = [system.logits(ids[s:s + chunk], cache) for s in range(0, len(ids), chunk)]
    return torch.cat(rows)[len(prompt) - 1:]


def agreement(candidate: System, sequences: list[Sequence],
              advance: Callable[[int], object] = lambda n: None) -> Agreement:
    """Top-1 of `candidate` against the reference's own greedy continuations; `advance(n)` after each."""
    same = []
    for prompt, continuation in sequences:
        top1 = teacher_forced_logits(candidate, prompt, continuation).argmax(-1).cpu()
        same.append(top1 == torch.tensor(continuation))
        advance(len(continuation))
    return Agreement.from_matches(same)


def chat_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user turn, chat-templated, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])
