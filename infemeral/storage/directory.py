"""Local-directory store: one file per session, replaced atomically.

Write goes to a temp file in the same directory, is fsynced, renamed over the
old file, and the directory is fsynced, so a crash at any moment leaves either
the old or the new blob, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from infemeral.storage.base import Store


class DirectoryStore(Store):
    def __init__(self, root: Path):
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    def path(self, session_id: bytes) -> Path:
        return self.root / f"{session_id.hex()}.kv"

    def read(self, session_id: bytes) -> bytes | None:
        try:
            return self.path(session_id).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, session_id: bytes, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(session_id))
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def delete(self, session_id: bytes) -> bool:
        try:
            self.path(session_id).unlink()
            return True
        except FileNotFoundError:
            return False
