"""The storage interface: opaque, already-encrypted bytes, grouped by session.

A session is stored as immutable *chunks* (encrypted KV segments, written once)
and one small *manifest* that names the chunks making up the committed state.
Committing is: write the new chunk durably, then replace the manifest
atomically (guarded by the session lock's fencing token), then drop chunks the
manifest no longer names (guarded the same way). A crash at any point leaves the old or the new
manifest, each naming chunks that exist. Backends never see keys or plaintext.

The interface knows no backend: `infemeral.storage.open` picks one from a URL.
"""

from __future__ import annotations

import abc
import threading

from infemeral.errors import Aborted


class SessionBusy(Aborted):
    """Another turn (here or on another replica) holds the session."""


class SessionLock(abc.ABC):
    """One turn's exclusive hold on a session, with a fencing token."""

    token: str

    @abc.abstractmethod
    def refresh(self) -> None:
        """Extend the hold; raise SessionBusy if it was lost."""

    @abc.abstractmethod
    def release(self) -> None:
        ...


class Store(abc.ABC):
    def __init__(self, ttl_seconds: float):
        self.ttl_seconds = ttl_seconds
        self._counter_lock = threading.Lock()
        self.bytes_written = 0
        self.writes = 0

    def _count(self, n: int) -> None:
        with self._counter_lock:
            self.bytes_written += n
            self.writes += 1

    @abc.abstractmethod
    def lock(self, session_id: bytes, lease_seconds: float = 60.0) -> SessionLock:
        """Take the session for one turn; raise SessionBusy if another turn holds it."""

    @abc.abstractmethod
    def read_manifest(self, session_id: bytes) -> bytes | None:
        """The committed manifest, or None for an unknown or expired session."""

    @abc.abstractmethod
    def write_chunk(self, session_id: bytes, name: str, data: bytes) -> None:
        """Store a chunk durably (it is not yet part of the session)."""

    @abc.abstractmethod
    def read_chunk(self, session_id: bytes, name: str) -> bytes | None:
        ...

    @abc.abstractmethod
    def commit_manifest(self, session_id: bytes, data: bytes, lock: SessionLock) -> None:
        """Atomically replace the manifest, only while `lock` still holds the session."""

    @abc.abstractmethod
    def list_chunks(self, session_id: bytes) -> list[str]:
        ...

    @abc.abstractmethod
    def delete_chunks(self, session_id: bytes, names: list[str], lock: SessionLock) -> None:
        """Delete chunks, only while `lock` still holds the session (raise SessionBusy otherwise): a holder
        whose lease ran out must not delete what the session's next holder just wrote."""

    @abc.abstractmethod
    def delete_session(self, session_id: bytes) -> bool:
        """Remove everything stored for the session; False if there was nothing."""

    @abc.abstractmethod
    def purge_expired(self) -> int:
        """Delete sessions idle for longer than the TTL; return how many."""

    def close(self) -> None:
        pass
