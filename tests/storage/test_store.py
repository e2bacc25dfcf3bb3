"""The encrypted, versioned KV store: backends, format, tamper detection, byte counts.

Every test runs against both backends: a local directory and a real
`redis-server` started on a free localhost port.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from infemeral.errors import Aborted, DataLoss, FailedPrecondition, NotFound, PermissionDenied
from infemeral.kvcache import stored
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.persistence import SessionPersistence
from infemeral.storage.base import SessionBusy
from infemeral.storage.open import open_store

FP = "sha256:" + "ab" * 32
LAYERS, FIRST, HEADS, HEAD_DIM = 3, 1, 2, 8


@pytest.fixture(params=["directory", "redis"])
def store(request, tmp_path):
    if request.param == "directory":
        s = open_store(tmp_path / "store")
    else:
        s = open_store(request.getfixturevalue("redis_url"))
    yield s
    s.close()


def new_cache() -> KVCache:
    return KVCache(FIRST, LAYERS, HEADS, HEAD_DIM, torch.float32)


def grow(cache: KVCache, n: int, seed: int) -> None:
    """Append n random positions to every layer, as a forward pass would."""
    g = torch.Generator().manual_seed(seed)
    cache.begin_step()
    for slot in range(LAYERS):
        k = torch.randn(1, HEADS, n, HEAD_DIM, generator=g)
        cache.update(k, -k, FIRST + slot)
    cache.finish_step(n)


class Conversation:
    """A session driven straight through SessionPersistence (what the engine does per turn)."""

    def __init__(self, store, seed: int = 0):
        self.store, self.p = store, SessionPersistence(store, FP)
        self.id, self.key = os.urandom(16), os.urandom(32)
        self.keys = stored.SessionKeys.derive(self.id, self.key)
        self.cache, self.manifest, self.seed = new_cache(), None, seed

    def turn(self, new_tokens: int, drop: int = 0, turn_id: bytes = b"") -> stored.Manifest:
        lock = self.p.lock(self.id)
        try:
            if drop:
                self.cache.truncate(drop)
            self.seed += 1
            grow(self.cache, new_tokens, self.seed)
            self.manifest = self.p.commit(self.id, self.keys, self.cache, self.manifest, lock, turn_id)
            self.cache.commit()
            return self.manifest
        finally:
            lock.release()

    def load(self, key: bytes | None = None, version: int | None = None) -> KVCache:
        keys = self.keys if key is None else stored.SessionKeys.derive(self.id, key)
        fresh = new_cache()
        lock = self.p.lock(self.id)
        try:
            self.p.load(self.id, keys, self.manifest.version if version is None else version, fresh)
        finally:
            lock.release()
        return fresh

    def assert_loads_equal(self) -> None:
        fresh = self.load()
        assert fresh.length == self.cache.length
        for slot in range(LAYERS):
            for a, b in zip(fresh.layer_tensors(slot), self.cache.layer_tensors(slot)):
                assert torch.equal(a, b)


def stored_files(store, session_id) -> dict[str, bytes]:
    out = {"manifest": store.read_manifest(session_id)}
    out.update({n: store.read_chunk(session_id, n) for n in store.list_chunks(session_id)})
    return out


def put_files(store, session_id, files: dict[str, bytes]) -> None:
    """Write raw stored objects back (what an attacker with access to the storage can do)."""
    lock = store.lock(session_id)
    try:
        for name in store.list_chunks(session_id):
            if name not in files:
                store.delete_chunks(session_id, [name], lock)
        for name, data in files.items():
            if name != "manifest":
                store.write_chunk(session_id, name, data)
        store.commit_manifest(session_id, files["manifest"], lock)
    finally:
        lock.release()


def flip(data: bytes, index: int) -> bytes:
    b = bytearray(data)
    b[index] ^= 0x01
    return bytes(b)


# -- round trips and what is written ------------------------------------------------------------------
def test_turns_round_trip_keep_untouched_chunks_and_compact(store):
    c = Conversation(store)
    for n in (5, 1, 1, 7):
        c.turn(n)
        c.assert_loads_equal()
    assert [(r.start, r.end) for r in c.manifest.chunks] == [(0, 5), (5, 6), (6, 7), (7, 14)]
    first = [r.name for r in c.manifest.chunks]
    c.turn(2, drop=3)  # drops committed tokens of the last chunk: it is rewritten, the others are kept
    assert [(r.start, r.end) for r in c.manifest.chunks] == [(0, 5), (5, 6), (6, 7), (7, 13)]
    assert [r.name for r in c.manifest.chunks][:3] == first[:3]
    assert sorted(store.list_chunks(c.id)) == sorted(r.name for r in c.manifest.chunks)  # old chunk removed
    c.assert_loads_equal()
    c.turn(1, drop=8)  # back to the end of the first chunk: it is kept, everything after the cut rewritten
    assert [(r.start, r.end) for r in c.manifest.chunks] == [(0, 5), (5, 6)]
    assert c.manifest.chunks[0].name == first[0]
    c.turn(1, drop=3)  # ... and into it: nothing is kept
    assert [(r.start, r.end) for r in c.manifest.chunks] == [(0, 4)] and c.manifest.chunks[0].name != first[0]
    c.assert_loads_equal()
    for _ in range(SessionPersistence(store, FP).max_chunks + 1):  # chunks pile up: compaction
        c.turn(1)
    assert len(c.manifest.chunks) < SessionPersistence(store, FP).max_chunks
    assert store.list_chunks(c.id) == sorted(r.name for r in c.manifest.chunks)
    c.assert_loads_equal()


def test_an_eviction_rewrites_everything_after_the_sinks(store):
    """An eviction moves every position after the sinks; the stored chunks must follow (issue: a commit
    that appended only the tail left the pre-eviction keys/values in the store)."""
    c = Conversation(store)
    c.turn(10)
    c.turn(6)
    lock = c.p.lock(c.id)
    try:
        c.cache.evict(4, 8, lambda k: k * 2)  # moved keys differ from the stored ones
        assert c.cache.committed_length == 4
        grow(c.cache, 9, seed=77)  # 8 + 9 = 17 >= the stored 16 tokens: the append-only rule would keep them
        c.manifest = c.p.commit(c.id, c.keys, c.cache, c.manifest, lock)
        c.cache.commit()
    finally:
        lock.release()
    assert [(r.start, r.end) for r in c.manifest.chunks] == [(0, 17)]
    c.assert_loads_equal()


def test_one_token_turn_writes_the_same_bytes_whatever_the_history(store):
    written = {}
    for history in (8, 256, 2048):
        c = Conversation(store)
        c.turn(history)
        before = store.bytes_written
        c.turn(1)
        written[history] = store.bytes_written - before
    full_turn = written[8]
    assert max(written.values()) - min(written.values()) <= 16, written  # only digits in the manifest differ
    per_token = 2 * LAYERS * HEADS * HEAD_DIM * 4
    assert full_turn < 2048 * per_token / 20  # nowhere near rewriting the history


def test_wrong_key_is_permission_denied_and_changes_nothing(store):
    c = Conversation(store)
    c.turn(4)
    before = stored_files(store, c.id)
    with pytest.raises(PermissionDenied, match="session key does not match"):
        c.load(key=os.urandom(32))
    with pytest.raises(PermissionDenied):
        c.p.delete(c.id, stored.SessionKeys.derive(c.id, os.urandom(32)))
    assert stored_files(store, c.id) == before
    c.assert_loads_equal()


def test_version_mismatch_is_aborted_with_the_stored_version(store):
    c = Conversation(store)
    c.turn(3)
    c.turn(2)
    with pytest.raises(Aborted, match="stored session is at version 2 but the client expects version 1"):
        c.load(version=1)
    with pytest.raises(NotFound):
        Conversation(store).p.load(os.urandom(16), c.keys, 3, new_cache())


def test_no_two_sealed_objects_share_a_key_and_nonce(tmp_path, monkeypatch):
    """AES-GCM under one key and nonce twice leaks the XOR of the plaintexts and lets the tag be forged:
    every segment of every chunk (layers, commits, rewrites, compactions) and every manifest must be sealed
    under a (key, nonce) pair of its own."""
    sealed: list[tuple[bytes, bytes]] = []

    class RecordingAESGCM:  # the real cipher, noting the key and nonce of each encryption
        def __init__(self, key: bytes):
            self.key, self.aead = key, AESGCM(key)

        def encrypt(self, nonce, data, associated_data):
            sealed.append((self.key, bytes(nonce)))
            return self.aead.encrypt(nonce, data, associated_data)

        def decrypt(self, nonce, data, associated_data):
            return self.aead.decrypt(nonce, data, associated_data)

    monkeypatch.setattr(stored, "AESGCM", RecordingAESGCM)
    store = open_store(tmp_path / "store")
    c = Conversation(store)
    c.p.max_chunks = 3
    for new_tokens, drop in ((5, 0), (1, 0), (2, 3), (4, 0), (1, 0), (3, 0)):  # a rewrite, then a compaction
        c.turn(new_tokens, drop)
    assert [(r.start, r.end) for r in c.manifest.chunks] == [(0, 13)], "no compaction happened"
    commits, chunks_sealed = 6, 6
    assert len(sealed) == commits + chunks_sealed * LAYERS
    repeated = {pair for pair in sealed if sealed.count(pair) > 1}
    assert not repeated, f"{len(repeated)} (key, nonce) pairs sealed more than once"
    c.assert_loads_equal()


# -- tampering ----------------------------------------------------------------------------------------
def test_flipped_bytes_anywhere_are_detected(store):
    c, other = Conversation(store), Conversation(store, seed=100)
    for conv in (c, other):
        conv.turn(6)
        conv.turn(2)
    good = stored_files(store, c.id)
    rng = random.Random(1234)
    for name, data in good.items():
        for index in rng.sample(range(len(data)), min(40, len(data))):
            put_files(store, c.id, {**good, name: flip(data, index)})
            with pytest.raises((DataLoss, PermissionDenied, FailedPrecondition)):
                c.load()
    for name in good:  # every chunk byte flip is DATA_LOSS specifically
        if name != "manifest":
            put_files(store, c.id, {**good, name: flip(good[name], len(good[name]) // 2)})
            with pytest.raises(DataLoss, match="failed authentication"):
                c.load()
    other.assert_loads_equal()  # other sessions are unaffected
    put_files(store, c.id, good)
    c.assert_loads_equal()


def test_truncated_and_missing_chunks_are_data_loss(store):
    c = Conversation(store)
    c.turn(5)
    c.turn(3)
    good = stored_files(store, c.id)
    chunk = c.manifest.chunks[1].name
    put_files(store, c.id, {**good, chunk: good[chunk][:-7]})
    with pytest.raises(DataLoss, match="truncated or damaged"):
        c.load()
    put_files(store, c.id, {k: v for k, v in good.items() if k != chunk})
    with pytest.raises(DataLoss, match="missing"):
        c.load()
    put_files(store, c.id, {**good, "manifest": good["manifest"][:-3]})
    with pytest.raises(DataLoss):
        c.load()
    put_files(store, c.id, good)
    c.assert_loads_equal()


def _segments(blob: bytes) -> tuple[bytes, list[bytes]]:
    head, pos, segs = blob[:stored._HEAD.size], stored._HEAD.size, []
    while pos < len(blob):
        (n,) = stored._SEG_LEN.unpack_from(blob, pos)
        segs.append(blob[pos:pos + stored._SEG_LEN.size + n])
        pos += stored._SEG_LEN.size + n
    return head, segs


def test_segments_swapped_between_layers_positions_and_sessions_are_detected(store):
    a, b = Conversation(store), Conversation(store, seed=50)
    for conv in (a, b):
        conv.turn(4)
        conv.turn(4)  # two chunks of the same size: tokens 0-4 and 4-8
    good = stored_files(store, a.id)
    first, second = (r.name for r in a.manifest.chunks)
    head, segs = _segments(good[first])
    swapped_layers = head + b"".join([segs[1], segs[0], *segs[2:]])
    cases = {
        "layers swapped": {**good, first: swapped_layers},
        "positions swapped": {**good, first: good[second], second: good[first]},
        "chunk from another session": {**good, first: stored_files(store, b.id)[b.manifest.chunks[0].name]},
    }
    for name, files in cases.items():
        put_files(store, a.id, files)
        with pytest.raises(DataLoss, match="failed authentication"):
            a.load()
    # B's whole manifest under A's id: the key check is salted with the session id.
    put_files(store, a.id, {**good, "manifest": stored_files(store, b.id)["manifest"]})
    with pytest.raises((PermissionDenied, DataLoss)):
        a.load()
    put_files(store, a.id, good)
    a.assert_loads_equal()
    b.assert_loads_equal()


def test_restored_older_copy_is_refused(store):
    c = Conversation(store)
    c.turn(4)
    old = stored_files(store, c.id)
    c.turn(3)
    new = stored_files(store, c.id)
    put_files(store, c.id, old)  # a backup put back
    with pytest.raises(Aborted, match="stored session is at version 1 but the client expects version 2"):
        c.load()
    # The old manifest with the new chunk list, or new manifest with old chunks only: never loads.
    put_files(store, c.id, {**new, **{k: v for k, v in old.items() if k != "manifest"}})
    c.assert_loads_equal()  # extra unreferenced chunks are harmless
    put_files(store, c.id, {"manifest": new["manifest"], **{k: v for k, v in old.items() if k != "manifest"}})
    with pytest.raises(DataLoss, match="missing"):
        c.load()
    put_files(store, c.id, new)
    c.assert_loads_equal()


def test_unknown_format_version_is_a_clear_error(store):
    c = Conversation(store)
    c.turn(2)
    good = stored_files(store, c.id)
    manifest = bytearray(good["manifest"])
    manifest[5:7] = (99).to_bytes(2, "little")
    put_files(store, c.id, {**good, "manifest": bytes(manifest)})
    with pytest.raises(FailedPrecondition, match="format version 99"):
        c.load()


# -- locks, expiry, deletion ---------------------------------------------------------------------------
def test_one_turn_at_a_time(store):
    sid = os.urandom(16)
    lock = store.lock(sid)
    with pytest.raises(SessionBusy, match="one turn at a time"):
        store.lock(sid)
    lock.release()
    store.lock(sid).release()


def test_redis_lock_expires_and_fences_a_stale_holder(redis_url):
    s = open_store(redis_url)
    c = Conversation(s)
    c.turn(2)
    stale = s.lock(c.id, lease_seconds=0.2)
    time.sleep(0.4)  # the holder "crashed"; its lease runs out
    fresh = s.lock(c.id)
    with pytest.raises(SessionBusy, match="lease"):
        s.commit_manifest(c.id, b"garbage", stale)
    with pytest.raises(SessionBusy):
        stale.refresh()
    fresh.release()
    c.assert_loads_equal()


def test_directory_lock_of_a_killed_process_is_released(tmp_path):
    root = tmp_path / "store"
    sid = os.urandom(16)
    code = ("import sys,time; from pathlib import Path; from infemeral.storage.directory import DirectoryStore;"
            f"DirectoryStore(Path({str(root)!r})).lock(bytes.fromhex({sid.hex()!r})); print('locked', flush=True);"
            "time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    store = open_store(root)
    with pytest.raises(SessionBusy):
        store.lock(sid)
    proc.kill()
    proc.wait()
    store.lock(sid).release()


def test_expired_sessions_are_gone(tmp_path, redis_url):
    d = open_store(tmp_path / "store", ttl_seconds=60)
    c = Conversation(d)
    c.turn(3)
    old = time.time() - 120
    os.utime(d.folder(c.id) / "manifest", (old, old))
    assert d.read_manifest(c.id) is None
    assert d.purge_expired() == 1
    assert not d.folder(c.id).exists()
    r = open_store(redis_url, ttl_seconds=0.3)
    c = Conversation(r)
    c.turn(3)
    assert r.read_manifest(c.id) is not None
    time.sleep(0.6)
    assert r.read_manifest(c.id) is None and r.list_chunks(c.id) == []


def test_delete_removes_everything(store):
    c = Conversation(store)
    c.turn(3)
    c.turn(1)
    c.p.delete(c.id, c.keys)
    assert store.read_manifest(c.id) is None and store.list_chunks(c.id) == []
    with pytest.raises(NotFound):
        c.p.delete(c.id, c.keys)


# -- fencing: what a holder may do once its hold is gone --------------------------------------------------
def test_a_pending_turn_is_adopted_only_by_its_own_turn_id(store):
    """A client that lost a commit reply may adopt version + 1 only if that very turn committed it; a
    version another device committed meanwhile is refused like any other stale version."""
    c = Conversation(store)
    mine, theirs = os.urandom(16), os.urandom(16)
    c.turn(3, turn_id=os.urandom(16))
    c.turn(2, turn_id=mine)
    adopted = new_cache()
    assert c.p.load(c.id, c.keys, 1, adopted, pending_turn_id=mine).version == 2
    assert adopted.length == c.cache.length
    c.turn(1, turn_id=theirs)  # version 3, from another device
    with pytest.raises(Aborted, match="stored session is at version 3 but the client expects version 2"):
        c.p.load(c.id, c.keys, 2, new_cache(), pending_turn_id=mine)
    with pytest.raises(Aborted, match="at version 3 but the client expects version 2"):
        c.p.load(c.id, c.keys, 2, new_cache(), pending_turn_id=os.urandom(16))
    assert c.p.load(c.id, c.keys, 2, new_cache(), pending_turn_id=theirs).version == 3


def test_chunks_are_deleted_only_under_a_live_lock(store):
    c = Conversation(store)
    c.turn(3)
    name = c.manifest.chunks[0].name
    lock = store.lock(c.id)
    lock.release()
    with pytest.raises(SessionBusy):
        store.delete_chunks(c.id, [name], lock)
    assert store.list_chunks(c.id) == [name]
    c.assert_loads_equal()


def test_a_holder_whose_lease_expired_cannot_delete_the_next_holders_chunk(redis_url, monkeypatch):
    """Holder A commits, then stalls before removing stale chunks; its lease runs out, B takes the session
    and commits a new chunk. A's clean-up must not delete it (B's manifest would name a missing chunk)."""
    s = open_store(redis_url)
    a = Conversation(s)
    a.turn(3)
    b = Conversation(s)
    b.id, b.key, b.keys = a.id, a.key, a.keys
    real_commit = s.commit_manifest

    def commit_then_stall(session_id, data, lock):
        real_commit(session_id, data, lock)
        monkeypatch.setattr(s, "commit_manifest", real_commit)
        time.sleep(0.5)  # A's lease (0.2 s) runs out here
        b.cache = b.load(version=2)
        b.manifest = b.p.read_manifest(b.id, b.keys)
        b.turn(4)  # version 3: a new chunk A has never heard of

    monkeypatch.setattr(s, "commit_manifest", commit_then_stall)
    lock = s.lock(a.id, lease_seconds=0.2)
    grow(a.cache, 2, seed=9)
    a.manifest = a.p.commit(a.id, a.keys, a.cache, a.manifest, lock)
    lock.release()
    assert set(r.name for r in b.manifest.chunks) <= set(s.list_chunks(b.id))
    b.assert_loads_equal()
    s.close()


def test_directory_writes_fsync_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """A power cut after the rename must find the new bytes (the temp file fsynced, whole, before
    `os.replace`) and the new name (the folder fsynced after it). A SIGKILL cannot tell; only the order of
    the calls can."""
    calls: list[tuple] = []  # ("fsync", inode, size) and ("replace", inode, destination)
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        calls.append(("fsync", st.st_ino, st.st_size))
        real_fsync(fd)

    def replace(src, dst, **kw):
        calls.append(("replace", os.stat(src).st_ino, Path(dst).name))
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    store = open_store(tmp_path / "store")
    sid = os.urandom(16)
    lock = store.lock(sid)
    folder = store.folder(sid)
    for name, data, write in (("chunk-1", b"segments" * 100, lambda d: store.write_chunk(sid, "chunk-1", d)),
                              ("manifest", b"manifest", lambda d: store.commit_manifest(sid, d, lock))):
        calls.clear()
        write(data)
        file = (folder / name).stat().st_ino
        renamed = calls.index(("replace", file, name))
        assert ("fsync", file, len(data)) in calls[:renamed], f"{name}: the temp file was not fsynced whole first"
        fsynced_after = {inode for kind, inode, _ in calls[renamed:] if kind == "fsync"}
        assert folder.stat().st_ino in fsynced_after, f"{name}: the folder was not fsynced after the rename"
    lock.release()


def test_directory_lock_taken_while_its_holder_removes_the_file(tmp_path, monkeypatch):
    """The holder of an uncommitted session removes its folder, lock file included, when it lets go. A turn
    that opened the old lock file just before must not end up holding a lock on the removed file while a
    third turn locks the new one."""
    from infemeral.storage import directory

    store = open_store(tmp_path / "store")
    sid = os.urandom(16)
    first = store.lock(sid)
    real_open = os.open
    raced = []

    def open_then_let_go(path, flags, mode=0o777, **kw):
        fd = real_open(path, flags, mode, **kw)
        if str(path).endswith("/lock") and not raced:
            raced.append(path)
            first.release()  # no manifest: removes the folder and the lock file we just opened
        return fd

    monkeypatch.setattr(directory.os, "open", open_then_let_go)
    second = store.lock(sid)
    monkeypatch.setattr(directory.os, "open", real_open)
    assert raced
    with pytest.raises(SessionBusy):
        store.lock(sid)
    second.release()
    store.lock(sid).release()
