"""A small local model that drafts for the big remote one (`--speculate draft --draft-model PATH`).

For open-ended text the conversation rarely holds the next words, so n-gram
drafts seldom hit; a small model of the same family often guesses them. It
runs entirely on the client (it sees the plain text, like the tokenizer does),
greedily, with its own KV cache kept in step with the conversation: each
proposal feeds only the tokens it has not seen and forgets its rejected guesses.

That cache belongs to one conversation. A `Client` keeps one `DraftModel` and
each session drafts through its own `fork()`: the weights are shared and only
read, the cache and the tokens it has seen are the session's own, so sessions
drafting at once in threads never see each other's state.

Drafts are token ids, so the draft model must use exactly the target's
tokenizer; anything else is refused before the first token.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from infemeral.errors import FailedPrecondition
from infemeral.cloak.sources import load_model
from infemeral.kvcache.prefix import common_prefix
from infemeral.layers.architecture import cache_keyword


def tokenizer_mismatch(target, draft) -> str | None:
    """Why token ids of `draft` would mean something else under `target`, or None if they agree."""
    a, b = target.get_vocab(), draft.get_vocab()
    if a != b:
        only_a, only_b = len(a.keys() - b.keys()), len(b.keys() - a.keys())
        moved = sum(1 for t in a.keys() & b.keys() if a[t] != b[t])
        return (f"vocabularies differ ({len(a)} vs {len(b)} tokens; {only_a} only in the model's, {only_b} only in "
                f"the draft model's, {moved} with different ids)")
    for name in ("bos_token_id", "eos_token_id", "unk_token_id"):
        if getattr(target, name, None) != getattr(draft, name, None):
            return f"special tokens differ ({name}: {getattr(target, name, None)} vs {getattr(draft, name, None)})"
    if sorted(map(str, target.all_special_tokens)) != sorted(map(str, draft.all_special_tokens)):
        return "special tokens differ"
    return None


def check_same_tokenizer(target, draft, where: str = "the draft model") -> None:
    problem = tokenizer_mismatch(target, draft)
    if problem:
        raise FailedPrecondition(f"{where} does not use this model's tokenizer: {problem}. A draft model must share "
                                 "the tokenizer exactly (same family, e.g. a smaller model of the same series); "
                                 "use --speculate ngram instead")


class DraftModel:
    """Greedy drafts from a small causal LM run on the client, for one conversation at a time (`fork` for more)."""

    name = "draft"
    is_free = False  # every draft token is a forward pass of the draft model

    def __init__(self, model, tokenizer=None, target_tokenizer=None):
        if tokenizer is not None and target_tokenizer is not None:
            check_same_tokenizer(target_tokenizer, tokenizer)
        self.model = model.eval()
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self._cache = None
        self._seen: list[int] = []  # the tokens whose keys/values are in the cache, in order
        self.last_seconds: float | None = None  # the last proposal's cost as if the cache had been current
        self._drafts: tuple[int, list[int]] = (0, [])  # the last proposal: where its drafts start, the drafts

    @classmethod
    def load(cls, path: str | Path, target_tokenizer, dtype: torch.dtype = torch.float32) -> "DraftModel":
        model, tokenizer = load_model(path, dtype, what="draft model")
        return cls(model, tokenizer, target_tokenizer)

    def fork(self) -> "DraftModel":
        """A drafter over the same weights (shared, only read) with a cache of its own, empty."""
        other = copy.copy(self)
        other._cache, other._seen, other._drafts = None, [], (0, [])
        return other

    @torch.inference_mode()
    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        if max_draft <= 0 or not context_ids or len(context_ids) + max_draft > self.max_positions:
            return []
        logits, charged = self._feed(list(context_ids))
        draft: list[int] = []
        for i in range(max_draft):
            token = int(logits.argmax())
            draft.append(token)
            if i + 1 < max_draft:
                logits, seconds = self._timed_forward([token])
                charged += seconds
        self.last_seconds = charged
        self._drafts = (len(context_ids), draft)
        return draft

    def _feed(self, context: list[int]) -> tuple[torch.Tensor, float]:
        """Bring the cache to `context` and return the logits after it, with the seconds charged for them.
        Tokens not yet read that are the last proposal's own accepted drafts (drafting every step, the last
        draft of the step before is one) are read with the last token in one pass, charged: it comes with
        every proposal. Tokens verified while the drafter idled are read in a pass of their own that is not
        charged: it is paid once after idling, not for every draft."""
        from transformers import DynamicCache

        keep = common_prefix(self._seen, context[:-1])
        if keep < len(self._seen) and keep > 0:
            try:
                self._cache.crop(keep - len(self._seen))  # a negative count: drop that many from the end
                self._seen = self._seen[:keep]
            except (ValueError, RuntimeError):  # e.g. a sliding-window cache past its window: start over
                keep = 0
        if self._cache is None or keep == 0:
            self._cache, self._seen, keep = DynamicCache(), [], 0
        if len(context) - keep > 1 and not self._own_drafts(context, keep):
            self._forward(context[keep:-1])
            keep = len(context) - 1
        return self._timed_forward(context[keep:])

    def _own_drafts(self, context: list[int], keep: int) -> bool:
        """Whether context[keep:-1], the tokens read before the last one, are drafts of the last proposal."""
        start, drafts = self._drafts
        return start <= keep and context[keep:-1] == drafts[keep - start:len(context) - 1 - start]

    def _timed_forward(self, ids: list[int]) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        logits = self._forward(ids)
        return logits, time.perf_counter() - started

    def _forward(self, ids: list[int]) -> torch.Tensor:
        out = self.model(torch.tensor([ids]), use_cache=True, **{cache_keyword(self.model): self._cache})
        self._cache = getattr(out, cache_keyword(self.model))  # outputs renamed it when the inputs did
        self._seen += ids
        return out.logits[0, -1]
