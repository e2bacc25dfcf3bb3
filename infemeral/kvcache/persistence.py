"""Loading and committing a session's encrypted KV cache through a storage backend.

Commit appends: only tokens added since the last commit are encrypted and
written (one chunk), so bytes written per turn follow the turn's new tokens,
not the conversation's length. When a turn dropped committed tokens, or chunks
have piled up, the commit compacts: it writes the whole cache as one chunk.
The manifest is replaced last and atomically; chunks it no longer names are
removed afterwards, and orphans of an interrupted commit are removed by the
next one.
"""

from __future__ import annotations

import hmac
import logging

from infemeral.errors import Aborted, FailedPrecondition, NotFound
from infemeral.kvcache import stored
from infemeral.kvcache.cache import KVCache
from infemeral.storage.base import SessionLock, Store

log = logging.getLogger(__name__)

MAX_CHUNKS = 16


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

    def load(self, session_id: bytes, keys: stored.SessionKeys, expected_version: int,
             cache: KVCache, pending_turn_id: bytes = b"") -> stored.Manifest | None:
        """Fill `cache` with the committed state; refuse a version the client does not expect.

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
        chunks = [(ref, self.store.read_chunk(session_id, ref.name)) for ref in manifest.chunks]
        stored.load_into(cache, chunks, manifest, keys)
        return manifest

    def commit(self, session_id: bytes, keys: stored.SessionKeys, cache: KVCache, previous: stored.Manifest | None,
               low_water: int, lock: SessionLock, turn_id: bytes = b"") -> stored.Manifest:
        """Write the turn's new tokens (or compact) and move the session to the next version."""
        version = (previous.version if previous else 0) + 1
        kept = list(previous.chunks) if previous else []
        stored_length = previous.length if previous else 0
        if low_water < stored_length or len(kept) >= self.max_chunks:
            kept, start = [], 0  # compaction: rewrite everything as one chunk
        else:
            start = stored_length
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
        live = {ref.name for ref in kept}
        garbage = [name for name in self.store.list_chunks(session_id) if name not in live]
        if garbage:
            try:
                self.store.delete_chunks(session_id, garbage)
            except OSError:
                log.warning("could not remove %d stale chunks; the next commit retries", len(garbage))
        return manifest

    def delete(self, session_id: bytes, keys: stored.SessionKeys) -> None:
        if self.read_manifest(session_id, keys) is None:
            raise NotFound("no such session (it may have expired or been deleted already)")
        self.store.delete_session(session_id)
