"""Files infemeral writes whole or not at all, readable by their owner alone.

Every file it keeps (session keys, the store's chunks, the answer index, resolved tokenizers, draft heads)
goes through `write_private`: a reader or a crash sees the old bytes or the new ones, never a torn file, and
no other user of the machine can read them in between.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

TEMP_PREFIX = ".tmp-"  # a write in progress, or one a crash cut short: `.tmp-<name>.<random>`


def write_private(path: str | Path, data: bytes, *, durable: bool = False) -> Path:
    """Replace `path` with `data` at once, owner-only (0600), through a temporary file of its own beside it
    (two writers never share one) that is removed if the write fails. `durable`: fsync the file before the
    rename and its directory after, so that what was written survives a power cut, not only a crash."""
    with private_file(path, durable=durable) as f:
        f.write(data)
    return Path(path)


@contextmanager
def private_file(path: str | Path, *, durable: bool = False) -> Iterator[BinaryIO]:
    """`write_private` for data written a piece at a time (more than memory holds): the file to write, which
    replaces `path` whole when the block ends and is removed if it raises; owner-only throughout."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f"{TEMP_PREFIX}{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # mkstemp's 0600 less the umask: exactly 0600 whatever the umask
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make the names in `directory` (a rename into it, a new file) survive a power cut."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def leftover_temporaries(directory: Path, name: str = "") -> list[Path]:
    """The temporary files of writes to `directory` (of `name` alone, if given) that a crash cut short; only
    for a caller that knows no write there is under way (it holds the directory's lock)."""
    pattern = f"{TEMP_PREFIX}{name}.*" if name else f"{TEMP_PREFIX}*"
    return sorted(directory.glob(pattern))
