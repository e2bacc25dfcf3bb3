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

Sources are shared by every session of a `Client`, and sessions run in
parallel threads (the OpenAI endpoint answers requests at once). A source
that remembers the conversation it drafts for — a draft model's KV cache —
therefore offers `fork()`: the same read-only parts with a state of its own,
and each session drafts through its own fork (`per_session`), so that no
draft ever depends on another session. The answer index is shared on
purpose (that is its point) and is safe under threads.

Matching is a vectorised scan over a token array (numpy), not a suffix tree:
for the sizes a laptop keeps (a few hundred thousand tokens) a scan per step
takes well under a millisecond and needs no index to build or store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

SEPARATOR = -1  # between answers in an AnswerIndex; never a token id

log = logging.getLogger(__name__)


@runtime_checkable
class DraftSource(Protocol):
    """Proposes up to `max_draft` tokens that may follow `context_ids` (possibly none)."""

    name: str
    is_free: bool  # proposing costs (almost) nothing, so it may be tried on every step

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]: ...


def per_session(source: DraftSource) -> DraftSource:
    """`source` as one session drafts with it: a source with a state of its own per conversation (`fork()`)
    is forked, so that sessions never share that state; a stateless source is shared as it is."""
    fork = getattr(source, "fork", None)
    return fork() if callable(fork) else source


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

    It holds the user's own conversations' answers — of every session of every caller of this client,
    deleted sessions included — so it lives only on the client, in an owner-only file, bounded to
    `max_tokens` (the oldest answers go first), and can be switched off (`Client(answer_index=None)`) or
    cleared (`clear()`). One file per tokenizer: token ids mean nothing under another vocabulary.

    Safe to share between threads. The file is append-only between compactions: an answer is appended in
    one write, and the file is rewritten (through a temporary file of its own) only when it has grown to
    twice `max_tokens`. It is a cache, not a record: nothing is fsynced, and a file torn by a crash or
    holding foreign data is cut back to its last whole answer when loaded, with a warning."""

    name = "answers"
    is_free = True

    def __init__(self, path: str | Path | None = None, *, max_tokens: int = 262_144, min_match: int = 3,
                 max_match: int = 12, min_support: float = 0.3, limit: int = 256, vocab_size: int | None = None):
        self.path = Path(path).expanduser() if path is not None else None
        self.max_tokens = max_tokens
        self.min_match, self.max_match, self.min_support, self.limit = min_match, max_match, min_support, limit
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._file_tokens = 0  # entries (tokens and separators) in the file
        corpus = np.empty(0, dtype=np.int64)
        if self.path is not None and self.path.exists():
            corpus = self._load()
        self.corpus = self._bounded(corpus)  # replaced whole, never changed in place: readers need no lock

    @classmethod
    def for_tokenizer(cls, directory: str | Path, tokenizer, **kwargs) -> "AnswerIndex":
        """The index file under `directory` that belongs to this tokenizer's vocabulary."""
        kwargs.setdefault("vocab_size", len(tokenizer.get_vocab()))
        return cls(Path(directory).expanduser() / f"{tokenizer_fingerprint(tokenizer)[:16]}.tokens", **kwargs)

    @property
    def num_tokens(self) -> int:
        return int((self.corpus != SEPARATOR).sum())

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        corpus = self.corpus
        if max_draft <= 0 or len(corpus) < 2 or not context_ids:
            return []
        tail = np.asarray(context_ids[-self.max_match:], dtype=np.int64)
        ends, _ = suffix_matches(corpus, tail, min_match=self.min_match, max_match=self.max_match, limit=self.limit)
        return continuation(corpus, ends, max_draft, self.min_support) if len(ends) else []

    def add(self, answer_ids: Sequence[int]) -> None:
        """Remember one answer (and persist it, if the index has a file)."""
        if not len(answer_ids):
            return
        new = np.asarray(list(answer_ids) + [SEPARATOR], dtype=np.int64)
        with self._lock:
            if self.path is not None and self._file_tokens and not self.path.exists():
                self.corpus, self._file_tokens = self.corpus[:0], 0  # cleared from outside (forget-answers)
            self.corpus = self._bounded(np.concatenate([self.corpus, new]))
            if self.path is None:
                return
            if self._file_tokens + len(new) > 2 * self.max_tokens:
                self._rewrite(self.corpus)
            else:
                self._append(new)

    def clear(self) -> None:
        """Forget every answer, on disk too."""
        with self._lock:
            self.corpus = np.empty(0, dtype=np.int64)
            self._file_tokens = 0
            if self.path is not None:
                self.path.unlink(missing_ok=True)

    # -- the file ------------------------------------------------------------------------------------
    def _load(self) -> np.ndarray:
        """The file's answers, checked: whole 4-byte ids, each a token of the vocabulary or a separator, the
        last answer ended. Anything after the first flaw is dropped (a torn append, or data that is not an
        index, would otherwise shift or corrupt every later token), and the file is cut back to match."""
        raw = self.path.read_bytes()
        ids = np.frombuffer(raw[:len(raw) - len(raw) % 4], dtype="<i4").astype(np.int64)
        is_bad = (ids != SEPARATOR) & ((ids < 0) | (ids >= (self.vocab_size or 1 << 31)))
        first_bad = int(np.argmax(is_bad)) if is_bad.any() else len(ids)
        ends = np.flatnonzero(ids[:first_bad] == SEPARATOR)
        good = ids[:int(ends[-1]) + 1] if len(ends) else ids[:0]
        if len(good) * 4 != len(raw):
            log.warning("answer index %s was damaged (a torn write or foreign data): kept its first %d of %d bytes, "
                        "up to the last whole answer", self.path.name, len(good) * 4, len(raw))
            self._rewrite(good)
        self._file_tokens = len(good)
        return good

    def _append(self, new: np.ndarray) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, new.astype("<i4").tobytes())
        finally:
            os.close(fd)
        self._file_tokens += len(new)

    def _rewrite(self, corpus: np.ndarray) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")  # 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(corpus.astype("<i4").tobytes())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._file_tokens = len(corpus)

    def _bounded(self, corpus: np.ndarray) -> np.ndarray:
        """`corpus` without its oldest answers, so that at most max_tokens remain."""
        if len(corpus) <= self.max_tokens:
            return corpus
        start = len(corpus) - self.max_tokens
        seps = np.flatnonzero(corpus[start - 1:] == SEPARATOR)  # cut at an answer boundary
        cut = start - 1 + int(seps[0]) + 1 if len(seps) else len(corpus)
        return corpus[cut:]


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
