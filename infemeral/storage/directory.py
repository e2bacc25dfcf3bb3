"""Local-directory store: one folder per session, crash-safe writes, flock-based turn lock.

Every file is written durably (`write_private`: a temp file in the same folder,
fsynced, renamed into place, the folder fsynced), so readers and crashes see old
or new bytes, never a torn file. The turn lock is an flock on the session's lock
file: the kernel drops it when the holding process dies, so a crashed server
never leaves a session locked. A holder may remove the session folder, lock
file included, while it holds the lock (an uncommitted or deleted session leaves
no trace), so whoever takes the lock checks afterwards that the file it locked
is still the one at the path, and starts over if not: otherwise two turns could
each hold a lock on a different file. (flock is per host; replicas on several hosts share
sessions through the Redis store.)
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import time
from pathlib import Path

from infemeral.files import leftover_temporaries, write_private
from infemeral.storage.base import SessionBusy, SessionLock, Store

MANIFEST = "manifest"
LOCK = "lock"


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is (still) the file at `path`."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)


class _FileLock(SessionLock):
    def __init__(self, fd: int, folder: Path):
        self.fd = fd
        self.folder = folder
        self.token = secrets.token_hex(8)

    def refresh(self) -> None:
        if self.fd < 0:
            raise SessionBusy("the session's turn lock was released")

    def release(self) -> None:
        if self.fd >= 0:
            if not (self.folder / MANIFEST).exists():  # nothing was committed: leave no trace
                shutil.rmtree(self.folder, ignore_errors=True)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


class DirectoryStore(Store):
    def __init__(self, root: Path, ttl_seconds: float = 7 * 24 * 3600):
        super().__init__(ttl_seconds)
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    def folder(self, session_id: bytes) -> Path:
        return self.root / session_id.hex()

    def _write(self, folder: Path, name: str, data: bytes) -> None:
        folder.mkdir(mode=0o700, exist_ok=True)
        write_private(folder / name, data, durable=True)
        self._count(len(data))

    def lock(self, session_id: bytes, lease_seconds: float = 60.0) -> SessionLock:
        folder = self.folder(session_id)
        path = folder / LOCK
        while True:
            folder.mkdir(mode=0o700, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:  # the folder was removed between mkdir and open
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise SessionBusy("this session is in a turn on another connection or server; "
                                  "wait for it to finish (one turn at a time per session)") from None
            if _is_at(fd, path):
                return _FileLock(fd, folder)
            # The previous holder removed the file after we opened it: our lock guards nothing. Again.
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def read_manifest(self, session_id: bytes) -> bytes | None:
        path = self.folder(session_id) / MANIFEST
        try:
            if time.time() - path.stat().st_mtime > self.ttl_seconds:
                return None
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def write_chunk(self, session_id: bytes, name: str, data: bytes) -> None:
        self._write(self.folder(session_id), name, data)

    def read_chunk(self, session_id: bytes, name: str) -> bytes | None:
        try:
            return (self.folder(session_id) / name).read_bytes()
        except FileNotFoundError:
            return None

    def commit_manifest(self, session_id: bytes, data: bytes, lock: SessionLock) -> None:
        lock.refresh()
        folder = self.folder(session_id)
        self._write(folder, MANIFEST, data)
        for leftover in leftover_temporaries(folder):  # of writes a crash cut short (we hold the lock)
            leftover.unlink(missing_ok=True)

    def list_chunks(self, session_id: bytes) -> list[str]:
        folder = self.folder(session_id)
        if not folder.exists():
            return []
        return sorted(p.name for p in folder.iterdir() if p.name.startswith("chunk-"))

    def delete_chunks(self, session_id: bytes, names: list[str], lock: SessionLock) -> None:
        lock.refresh()
        for name in names:
            (self.folder(session_id) / name).unlink(missing_ok=True)

    def delete_session(self, session_id: bytes) -> bool:
        folder = self.folder(session_id)
        existed = (folder / MANIFEST).exists()
        shutil.rmtree(folder, ignore_errors=True)
        return existed

    def purge_expired(self) -> int:
        now, purged = time.time(), 0
        for folder in self.root.iterdir():
            manifest = folder / MANIFEST
            try:
                idle = now - manifest.stat().st_mtime
            except FileNotFoundError:
                continue
            if idle > self.ttl_seconds:
                try:
                    lock = self.lock(bytes.fromhex(folder.name))
                except (SessionBusy, ValueError):
                    continue
                try:
                    shutil.rmtree(folder, ignore_errors=True)
                    purged += 1
                finally:
                    lock.release()
        return purged
