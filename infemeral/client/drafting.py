"""Draft sources for speculative decoding: guesses of the next few tokens, checked by the real model.

A draft costs one round trip less for every token the model agrees with and
almost nothing when it is wrong (the server verifies k+1 positions in about
the time of one), so the guesses only have to be cheap and sometimes right.
Every source answers one question — `propose(context_ids, max_draft)`: which
tokens probably follow `context_ids`? — and may answer with nothing.

- `PromptLookup` copies from the conversation itself (prompt and answer so
  far): if the last few tokens appeared before, what followed them then is
  the draft. Free, and very good when the answer quotes, copies or edits
  the prompt.
- `AnswerIndex` does the same over the client's own earlier answers, across
  sessions (SuffixDecoding-style), kept on the laptop; it helps open chat,
  where the prompt rarely holds the answer but answers repeat themselves.
- `infemeral.client.draft_model.DraftModel` asks a small local model.

Matching is a vectorised scan over a token array (numpy), not a suffix tree:
for the sizes a laptop keeps (a few hundred thousand tokens) a scan per step
takes well under a millisecond and needs no index to build or store.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

SEPARATOR = -1  # between answers in an AnswerIndex; never a token id


@runtime_checkable
class DraftSource(Protocol):
    """Proposes up to `max_draft` tokens that may follow `context_ids` (possibly none)."""

    name: str
    is_free: bool  # proposing costs (almost) nothing, so it may be tried on every step

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]: ...


def suffix_matches(corpus: np.ndarray, tail: np.ndarray, *, min_match: int, max_match: int,
                   limit: int) -> tuple[np.ndarray, int]:
    """Where the longest suffix of `tail` (between min_match and max_match tokens) ends in `corpus`.

    Returns the positions p of the match's last token (each with at least one token after it, most
    recent `limit` only) and the match length; no positions if even `min_match` tokens do not match."""
    n = min(max_match, len(tail))
    if n < min_match or len(corpus) < 2:
        return np.empty(0, dtype=np.int64), 0
    ends = np.flatnonzero(corpus[:-1] == tail[-1])[-limit:]
    best, length = ends, 1
    for j in range(1, n):
        ends = ends[ends >= j]
        ends = ends[corpus[ends - j] == tail[-1 - j]]
        if len(ends) == 0:
            break
        best, length = ends, j + 1
    if length < min_match or len(best) == 0:
        return np.empty(0, dtype=np.int64), 0
    return best, length


def continuation(corpus: np.ndarray, ends: np.ndarray, max_draft: int, min_support: float) -> list[int]:
    """The most common continuation after the matched positions, token by token.

    Each token is the one most matches continue with (ties: the most recent); matches that
    disagree drop out. Drafting stops when the surviving share of the original matches falls
    below `min_support` — a disputed continuation is a poor guess."""
    draft: list[int] = []
    total = len(ends)
    for i in range(1, max_draft + 1):
        pos = ends + i
        keep = pos < len(corpus)
        ends, pos = ends[keep], pos[keep]
        if len(ends) == 0:
            break
        tokens = corpus[pos]
        keep = tokens != SEPARATOR
        ends, tokens = ends[keep], tokens[keep]
        if len(ends) == 0:
            break
        values, counts = np.unique(tokens, return_counts=True)
        top = counts.max()
        if top / total < min_support:
            break
        tied = values[counts == top]
        token = tied[0] if len(tied) == 1 else tokens[::-1][np.isin(tokens[::-1], tied)][0]
        ends = ends[tokens == token]
        draft.append(int(token))
    return draft


class PromptLookup:
    """Drafts by copying from the conversation's own tokens (prompt lookup decoding, n-gram matching).

    The longest suffix of the context (up to `max_match` tokens, at least `min_match`) that occurred
    earlier in the context is looked up; the tokens that followed it are the draft."""

    name = "ngram"
    is_free = True

    def __init__(self, *, min_match: int = 2, max_match: int = 8, min_support: float = 0.5, limit: int = 64):
        self.min_match, self.max_match, self.min_support, self.limit = min_match, max_match, min_support, limit

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        if max_draft <= 0 or len(context_ids) < 2:
            return []
        corpus = np.asarray(context_ids, dtype=np.int64)
        ends, _ = suffix_matches(corpus, corpus[-self.max_match:], min_match=self.min_match,
                                 max_match=self.max_match, limit=self.limit)
        return continuation(corpus, ends, max_draft, self.min_support) if len(ends) else []


class AnswerIndex:
    """The client's own earlier answers (token ids), searchable for drafts, kept on the laptop.

    It holds the user's own conversations' answers, so it lives only on the client, in an
    owner-only file, bounded to `max_tokens` (the oldest answers go first), and can be switched
    off or cleared. One file per tokenizer: token ids mean nothing under another vocabulary."""

    name = "answers"
    is_free = True

    def __init__(self, path: str | Path | None = None, *, max_tokens: int = 262_144, min_match: int = 3,
                 max_match: int = 12, min_support: float = 0.3, limit: int = 256):
        self.path = Path(path).expanduser() if path is not None else None
        self.max_tokens = max_tokens
        self.min_match, self.max_match, self.min_support, self.limit = min_match, max_match, min_support, limit
        self.corpus = np.empty(0, dtype=np.int64)
        if self.path is not None and self.path.exists():
            self.corpus = np.fromfile(self.path, dtype="<i4").astype(np.int64)
            self._bound()

    @classmethod
    def for_tokenizer(cls, directory: str | Path, tokenizer, **kwargs) -> "AnswerIndex":
        """The index file under `directory` that belongs to this tokenizer's vocabulary."""
        return cls(Path(directory).expanduser() / f"{tokenizer_fingerprint(tokenizer)[:16]}.tokens", **kwargs)

    @property
    def num_tokens(self) -> int:
        return int((self.corpus != SEPARATOR).sum())

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        if max_draft <= 0 or len(self.corpus) < 2 or not context_ids:
            return []
        tail = np.asarray(context_ids[-self.max_match:], dtype=np.int64)
        ends, _ = suffix_matches(self.corpus, tail, min_match=self.min_match, max_match=self.max_match,
                                 limit=self.limit)
        return continuation(self.corpus, ends, max_draft, self.min_support) if len(ends) else []

    def add(self, answer_ids: Sequence[int]) -> None:
        """Remember one answer (and persist it, if the index has a file)."""
        if not answer_ids:
            return
        new = np.asarray(list(answer_ids) + [SEPARATOR], dtype=np.int64)
        self.corpus = np.concatenate([self.corpus, new])
        trimmed = self._bound()
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if trimmed or not self.path.exists():
            self._rewrite()
        else:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, new.astype("<i4").tobytes())
            finally:
                os.close(fd)

    def clear(self) -> None:
        """Forget every answer, on disk too."""
        self.corpus = np.empty(0, dtype=np.int64)
        if self.path is not None and self.path.exists():
            self.path.unlink()

    def _bound(self) -> bool:
        """Drop the oldest answers until at most max_tokens remain; whether anything was dropped."""
        if len(self.corpus) <= self.max_tokens:
            return False
        start = len(self.corpus) - self.max_tokens
        seps = np.flatnonzero(self.corpus[start - 1:] == SEPARATOR)  # cut at an answer boundary
        cut = start - 1 + int(seps[0]) + 1 if len(seps) else len(self.corpus)
        self.corpus = self.corpus[cut:]
        return True

    def _rewrite(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, self.corpus.astype("<i4").tobytes())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)


class FirstOf:
    """Several sources in order of preference: the first that proposes anything wins."""

    def __init__(self, *sources: DraftSource):
        self.sources = list(sources)
        self.name = "+".join(s.name for s in sources)
        self.is_free = all(s.is_free for s in sources)

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        for source in self.sources:
            draft = source.propose(context_ids, max_draft)
            if draft:
                return draft
        return []


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what makes token ids mean the same thing: the vocabulary and the special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()
