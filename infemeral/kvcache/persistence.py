"""Loading and committing a session's encrypted KV cache through a storage backend.

Commit appends: the stored chunks that still describe the live cache
correctly are kept, and only the positions after them are encrypted and
written (one chunk). What is still correct is the cache's `committed_length`:
the leading positions untouched since the last commit. A turn that only adds
tokens keeps every chunk and writes just its new tokens, so bytes written per
turn follow the turn, not the conversation. A truncation into committed tokens
rewrites from the last chunk that ends before the cut. A window slide moves
every position after the sinks, so a turn that evicted rewrites the whole
window (that is the price of the window: O(max_context) bytes on such turns).
When chunks pile up the commit compacts everything into one. The manifest is
replaced last and atomically; chunks it no longer names are removed afterwards
(only while the session lock is still ours), and orphans of an interrupted
commit are removed by the next one.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging

from infemeral.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from infemeral.kvcache import stored
from infemeral.kvcache.sequence import KVSequence
from infemeral.storage.base import SessionBusy, SessionLock, Store
from infemeral.storage.open import store_errors

log = logging.getLogger(__name__)

MAX_CHUNKS = 16


def intact_chunks(chunks: list[stored.ChunkRef], intact: int) -> list[stored.ChunkRef]:
    """The leading chunks that lie wholly within the first `intact` positions."""
    kept = []
    for ref in chunks:
        if ref.end > intact:
            break
        kept.append(ref)
    return kept


class SessionPersistence:
    def __init__(self, store: Store, fingerprint: str, max_chunks: int = MAX_CHUNKS):
        self.store = store
        self.fingerprint = fingerprint
        self.max_chunks = max_chunks

    def lock(self, session_id: bytes) -> SessionLock:
        return self.store.lock(session_id)

    def read_manifest(self, session_id: bytes, keys: stored.SessionKeys) -> stored.Manifest | None:
        blob = self.store.read_manifest(session_id)
        return None if blob is None else stored.open_manifest(blob, keys)

    def read_committed(self, session_id: bytes, keys: stored.SessionKeys, expected_version: int,
                       pending_turn_id: bytes = b"") -> stored.Manifest | None:
        """The committed manifest (None for a new session); refuse a version the client does not expect.

        One exception: the client may name a turn whose commit reply it never got; if that very turn
        is what moved the session on, the client can adopt the result instead of being refused."""
        manifest = self.read_manifest(session_id, keys)  # checks the key before revealing anything
        if manifest is None:
            if expected_version != 0:
                raise NotFound(f"no stored state for this session (client expects version {expected_version}); "
                               "it may have expired or been deleted — start a new session")
            return None
        adopted = bool(pending_turn_id) and manifest.version == expected_version + 1 and \
            hmac.compare_digest(manifest.turn_id, pending_turn_id.hex())
        if manifest.version != expected_version and not adopted:
            raise Aborted(f"stored session is at version {manifest.version} but the client expects version "
                          f"{expected_version}; another client moved it on or an old copy was restored")
        if manifest.fingerprint != self.fingerprint:
            raise FailedPrecondition("stored session was made with a different server bundle and cannot be resumed")
        return manifest

    def fill(self, session_id: bytes, keys: stored.SessionKeys, manifest: stored.Manifest | None,
             cache: KVSequence) -> None:
        """Decrypt the committed state into `cache` (nothing for a new session)."""
        if manifest is None:
            return
        chunks = [(ref, self.store.read_chunk(session_id, ref.name)) for ref in manifest.chunks]
        stored.load_into(cache, chunks, manifest, keys)

    def load(self, session_id: bytes, keys: stored.SessionKeys, expected_version: int,
             cache: KVSequence, pending_turn_id: bytes = b"") -> stored.Manifest | None:
        """Fill `cache` with the committed state (see `read_committed`)."""
        manifest = self.read_committed(session_id, keys, expected_version, pending_turn_id)
        self.fill(session_id, keys, manifest, cache)
        return manifest

    def commit(self, session_id: bytes, keys: stored.SessionKeys, cache: KVSequence,
               previous: stored.Manifest | None, lock: SessionLock, turn_id: bytes = b"") -> stored.Manifest:
        """Write what changed since `previous` (the state `cache` was loaded from or last committed to) and
        move the session to the next version."""
        version = (previous.version if previous else 0) + 1
        kept = intact_chunks(previous.chunks, cache.committed_length) if previous else []
        if len(kept) >= self.max_chunks:
            kept = []  # compaction: rewrite everything as one chunk
        start = kept[-1].end if kept else 0
        if cache.length > start:
            ref, blob = stored.seal_chunk(cache, keys, start, cache.length, version)
            self.store.write_chunk(session_id, ref.name, blob)
            kept.append(ref)
        manifest = stored.Manifest(
            version=version, length=cache.length, fingerprint=self.fingerprint, key_check=keys.key_check.hex(),
            first_layer=cache.first_layer, num_layers=cache.num_layers, kv_heads=cache.kv_heads,
            head_dim=cache.head_dim, dtype=str(cache.dtype).removeprefix("torch."), chunks=kept,
            turn_id=turn_id.hex())
        self.store.commit_manifest(session_id, stored.seal_manifest(manifest, keys), lock)
        self._remove_garbage(session_id, {ref.name for ref in kept}, lock)
        return manifest

    def _remove_garbage(self, session_id: bytes, live: set[str], lock: SessionLock) -> None:
        """Delete chunks the new manifest does not name. The commit has landed whatever happens here."""
        try:
            garbage = [name for name in self.store.list_chunks(session_id) if name not in live]
            if garbage:
                self.store.delete_chunks(session_id, garbage, lock)
        except SessionBusy:
            log.warning("lost the session lock before removing stale chunks; the next commit removes them")
        except store_errors():
            log.warning("could not remove stale chunks; the next commit retries")

    def fork(self, source_id: bytes, source_keys: stored.SessionKeys, source_version: int, session_id: bytes,
             keys: stored.SessionKeys, drop: int, lock: SessionLock) -> stored.Manifest:
        """Store the source's committed cache, less its last `drop` positions, as the new session's version 1,
        sealed under the new session's keys: the associated data binds the session id, so no chunk can be
        copied as it is. One layer at a time is decrypted and sealed again; the caller holds both sessions'
        locks, and nothing of the source changes."""
        if source_version == 0:
            raise FailedPrecondition("this session has nothing committed to fork yet; fork it after its first turn")
        source = self.read_committed(source_id, source_keys, source_version)  # checks the key first
        if self.store.read_manifest(session_id) is not None:
            raise AlreadyExists("a session with the new session's id is already stored; fork under another id")
        if drop > source.length:
            raise InvalidArgument(f"cannot leave {drop} positions off a session that holds {source.length}")
        stored.check_coverage(source)
        length, chunks = source.length - drop, []
        if length:
            needed = [ref for ref in source.chunks if ref.start < length]
            read = [(ref, self.store.read_chunk(source_id, ref.name)) for ref in needed]
            layers = ((k[:, :length], v[:, :length]) for _, k, v in stored.decrypt_layers(read, source, source_keys))
            ref, blob = stored.seal_layers(layers, source.first_layer, source.num_layers, keys, 0, length, 1)
            self.store.write_chunk(session_id, ref.name, blob)
            chunks = [ref]
        manifest = dataclasses.replace(source, version=1, length=length, key_check=keys.key_check.hex(),
                                       chunks=chunks, turn_id="")
        self.store.commit_manifest(session_id, stored.seal_manifest(manifest, keys), lock)
        return manifest

    def delete(self, session_id: bytes, keys: stored.SessionKeys) -> None:
        if self.read_manifest(session_id, keys) is None:
            raise NotFound("no such session (it may have expired or been deleted already)")
        self.store.delete_session(session_id)
