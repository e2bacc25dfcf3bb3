"""write_private: owner-only, whole or not at all, and durable (file, then its directory) only when asked."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from infemeral import files
from infemeral.client import session_file
from infemeral.files import leftover_temporaries, write_private
from infemeral.kvcache.cache import KVCache


@pytest.fixture
def recorded(monkeypatch):
    """os.fsync and os.replace as they are called: ("fsync", "file" or "directory", inode) and ("replace", name)."""
    calls: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        calls.append(("fsync", "directory" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    return calls


def test_a_file_is_owner_only_whatever_the_umask(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"old")
    path.chmod(0o644)  # an existing file readable by others is replaced by an owner-only one
    old_umask = os.umask(0)
    try:
        write_private(path, b"new")
        write_private(tmp_path / "fresh", b"fresh")
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b"new" and (tmp_path / "fresh").read_bytes() == b"fresh"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "secret"]  # no temporary file left


@pytest.mark.parametrize("fails_at", ["write", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, fails_at):
    path = tmp_path / "manifest"
    write_private(path, b"old bytes")
    real_fdopen = os.fdopen

    class HalfWritten:
        """The temporary file, whose write stops halfway with a full disk."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def fileno(self):
            return self.f.fileno()

        def write(self, data):
            self.f.write(data[:len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    def no_space(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    if fails_at == "write":
        monkeypatch.setattr(files.os, "fdopen", lambda *a, **kw: HalfWritten(real_fdopen(*a, **kw)))
    else:
        monkeypatch.setattr(files.os, "replace", no_space)
    with pytest.raises(OSError, match="No space left"):
        write_private(path, b"the new bytes, longer than the old", durable=True)
    assert path.read_bytes() == b"old bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["manifest"]


def test_durable_fsyncs_the_file_then_renames_then_fsyncs_its_directory(tmp_path, recorded):
    path = tmp_path / "chunk-1"
    write_private(path, b"sealed", durable=True)
    assert recorded == [("fsync", "file", path.stat().st_ino), ("replace", "chunk-1"),
                        ("fsync", "directory", tmp_path.stat().st_ino)]


def test_not_durable_fsyncs_nothing(tmp_path, recorded):
    write_private(tmp_path / "answers.tokens", b"\x01\x00\x00\x00")
    assert recorded == [("replace", "answers.tokens")]


def test_each_write_has_a_temporary_of_its_own_that_leftover_temporaries_finds(tmp_path, monkeypatch):
    """What a crash between the write and the rename would leave is what `leftover_temporaries` looks for, by
    the file's name; two writers of one file never share a temporary."""
    seen: list[tuple[str, list, list, list]] = []
    real_replace = os.replace

    def replace(src, dst):
        seen.append((os.path.basename(src), leftover_temporaries(tmp_path, "a.tokens"),
                     leftover_temporaries(tmp_path, "b.tokens"), leftover_temporaries(tmp_path)))
        return real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    write_private(tmp_path / "a.tokens", b"1")
    write_private(tmp_path / "a.tokens", b"2")
    (first, *_), (second, *_) = seen
    assert first != second
    for temp, of_a, of_b, of_any in seen:
        assert [p.name for p in of_a] == [temp] and of_b == [] and [p.name for p in of_any] == [temp]
    assert leftover_temporaries(tmp_path) == []


def test_a_saved_session_holding_its_key_is_durable_and_owner_only(tmp_path, recorded):
    cache = KVCache(0, 1, 1, 4, torch.float32, capacity=4)
    saved = session_file.SavedSession(id=b"\x01" * 16, key=b"\x02" * 32, version=3, history_ids=[], messages=[],
                                      cache=cache, pending_commit=None)
    path = session_file.save(tmp_path / "chat.session", saved, "fingerprint")
    assert session_file.identity(path, "fingerprint") == (saved.id, saved.key, 3)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [call[:2] for call in recorded] == [("fsync", "file"), ("replace", "chat.session"), ("fsync", "directory")]
