"""The storage interface: opaque, already-encrypted blobs keyed by session id.

Backends never see keys or plaintext; they only need atomic replace, read and
delete. `open_store` picks a backend from a URL-ish string.
"""

from __future__ import annotations

import abc
from pathlib import Path


class Store(abc.ABC):
    @abc.abstractmethod
    def read(self, session_id: bytes) -> bytes | None:
        """The session's stored blob, or None if there is none."""

    @abc.abstractmethod
    def write(self, session_id: bytes, data: bytes) -> None:
        """Replace the session's blob atomically: readers see the old or the new bytes, never a mix."""

    @abc.abstractmethod
    def delete(self, session_id: bytes) -> bool:
        """Remove everything stored for the session; False if there was nothing."""


def open_store(url: str | Path) -> Store:
    """`file:///path`, `dir:///path` or a plain path: a local directory store."""
    from infemeral.storage.directory import DirectoryStore

    text = str(url)
    for prefix in ("file://", "dir://"):
        if text.startswith(prefix):
            return DirectoryStore(Path(text[len(prefix):]))
    if "://" in text:
        raise ValueError(f"unsupported store URL {text!r}; use a directory path or file:///path")
    return DirectoryStore(Path(text))
