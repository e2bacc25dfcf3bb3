"""Drafts from the client's own earlier answers, across sessions (SuffixDecoding-style).

It helps open chat, where the prompt rarely holds the answer but answers
repeat themselves. The index is kept on the laptop, in an owner-only file, and
matched like the conversation is (`matching.py`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from infemeral.files import leftover_temporaries, write_private
from infemeral.speculation.matching import SEPARATOR, continuation, suffix_matches

log = logging.getLogger(__name__)

# In an index's directory: a mark that changes each time answers there are forgotten. Every index holding
# answers from that directory compares it with the mark it loaded under before it drafts or writes, and
# drops what it holds when it changed: forgetting holds for the other processes that hold the index too.
FORGET_MARK = "forgotten"


class AnswerIndex:
    """The client's own earlier answers (token ids), searchable for drafts, kept on the laptop.

    It holds the user's own conversations' answers — of every session of every caller of this client,
    deleted sessions included — so it lives only on the client, in an owner-only file, bounded to
    `max_tokens` (the oldest answers go first), and can be switched off (`Client(answer_index=None)`) or
    cleared (`clear()`). One file per tokenizer: token ids mean nothing under another vocabulary.

    Safe to share between threads. The file is append-only between compactions: an answer is appended in
    one write, and the file is rewritten (through a temporary file of its own) only when it has grown to
    twice `max_tokens`. It is a cache, not a record: nothing is fsynced, and a file torn by a crash or
    holding foreign data is cut back to its last whole answer when loaded, with a warning.

    Other processes may hold the same file (a `serve`, a `chat`); each remembers what it loaded and added.
    Forgetting (`clear()`, `forget_answers`) holds for all of them: it changes the directory's forget mark
    under the directory's lock, which every write takes too, and an index that sees the mark changed (or its
    file gone) drops what it holds and reads the file again before it drafts or writes."""

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
        self._forget_mark = b""  # the directory's forget mark when the file was read
        self.corpus = np.empty(0, dtype=np.int64)  # replaced whole, never changed in place: readers need no lock
        if self.path is not None and self.path.exists():
            with _directory_lock(self.path.parent):
                self._read_file()
        elif self.path is not None:
            self._forget_mark = _forget_mark(self.path.parent)

    @classmethod
    def for_tokenizer(cls, directory: str | Path, tokenizer, **kwargs) -> "AnswerIndex":
        """The index file under `directory` that belongs to this tokenizer's vocabulary."""
        kwargs.setdefault("vocab_size", len(tokenizer.get_vocab()))
        return cls(Path(directory).expanduser() / f"{tokenizer_fingerprint(tokenizer)[:16]}.tokens", **kwargs)

    @property
    def num_tokens(self) -> int:
        return int((self.corpus != SEPARATOR).sum())

    def propose(self, context_ids: Sequence[int], max_draft: int) -> list[int]:
        if self.path is not None:
            try:
                self._catch_up()
            except OSError:  # whether its answers were forgotten cannot be told: draft nothing from them
                return []
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
            if self.path is None:
                self.corpus = self._bounded(np.concatenate([self.corpus, new]))
                return
            with _directory_lock(self.path.parent):
                if self._is_forgotten():
                    self._read_file()
                self.corpus = self._bounded(np.concatenate([self.corpus, new]))
                if self._file_tokens + len(new) > 2 * self.max_tokens:
                    self._rewrite(self.corpus)
                else:
                    self._append(new)

    def clear(self) -> None:
        """Forget every answer, on disk too, and in every other process that holds this index's file."""
        with self._lock:
            self.corpus = np.empty(0, dtype=np.int64)
            self._file_tokens = 0
            if self.path is not None and self.path.parent.is_dir():
                with _directory_lock(self.path.parent):
                    self._forget_mark = _forget(self.path.parent, [self.path])

    # -- the file ------------------------------------------------------------------------------------
    def _is_forgotten(self) -> bool:
        """Whether the answers this index holds from its file were forgotten since it read it (the directory's
        forget mark changed, or the file is gone from under it)."""
        return (_forget_mark(self.path.parent) != self._forget_mark
                or (self._file_tokens > 0 and not self.path.exists()))

    def _catch_up(self) -> None:
        """Drop what this index holds if it was forgotten since the file was read, and hold what the file holds."""
        if self._is_forgotten():
            with self._lock, _directory_lock(self.path.parent):
                if self._is_forgotten():
                    self._read_file()

    def _read_file(self) -> None:
        """Hold what the file holds now, dropping anything else (under the directory's lock)."""
        self._forget_mark = _forget_mark(self.path.parent)
        try:
            corpus = self._load()
        except FileNotFoundError:
            corpus, self._file_tokens = np.empty(0, dtype=np.int64), 0
        self.corpus = self._bounded(corpus)

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
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, new.astype("<i4").tobytes())
        finally:
            os.close(fd)
        self._file_tokens += len(new)

    def _rewrite(self, corpus: np.ndarray) -> None:
        write_private(self.path, corpus.astype("<i4").tobytes())
        self._file_tokens = len(corpus)

    def _bounded(self, corpus: np.ndarray) -> np.ndarray:
        """`corpus` without its oldest answers, so that at most max_tokens remain."""
        if len(corpus) <= self.max_tokens:
            return corpus
        start = len(corpus) - self.max_tokens
        seps = np.flatnonzero(corpus[start - 1:] == SEPARATOR)  # cut at an answer boundary
        cut = start - 1 + int(seps[0]) + 1 if len(seps) else len(corpus)
        return corpus[cut:]


def forget_answers(directory: str | Path) -> int:
    """Forget the answers of every index file in `directory`, in the processes that hold them too; how many
    files there were."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        return 0
    with _directory_lock(directory):
        files = sorted(directory.glob("*.tokens"))
        _forget(directory, files)
    return len(files)


def _forget(directory: Path, files: list[Path]) -> bytes:
    """Delete `files` (and what an interrupted rewrite left of them), then change the directory's forget
    mark; the new mark. Under the directory's lock."""
    for path in files:
        path.unlink(missing_ok=True)
        for leftover in leftover_temporaries(directory, path.name):
            leftover.unlink(missing_ok=True)
    mark = os.urandom(8).hex().encode()
    write_private(directory / FORGET_MARK, mark)
    return mark


def _forget_mark(directory: Path) -> bytes:
    try:
        return (directory / FORGET_MARK).read_bytes()
    except FileNotFoundError:
        return b""


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive lock on `directory` (made owner-only if new), between processes and threads alike:
    forgetting and every write of an index file there take it, so that no write of answers from before a
    forget lands after it."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and with it the lock


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what makes token ids mean the same thing: the vocabulary and the special tokens."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()
