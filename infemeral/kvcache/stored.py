"""The stored, encrypted form of a session's KV cache: a manifest plus append-only chunks.

A commit writes one *chunk* holding only the tokens added since the last commit:
for every layer, that layer's keys/values for the token range, each its own
AES-256-GCM segment. The *manifest* lists the chunks that make up the session
and is authenticated (GCM tag) together with the session id; a compaction
rewrites everything into one chunk when chunks pile up or committed tokens were
dropped. Each segment's associated data binds the format version, session id,
layer, token range, the session version it was written at and the chunk's
salt, so a segment moved to another session, layer or position, an old copy
restored, a missing or truncated chunk, and any flipped byte all fail.

Keys: HKDF-SHA256 from the client's session key (salt = session id) gives a
key-check value and a key material; every sealed object draws a random 16-byte
salt and gets its own AES key HKDF(material, salt), so the deterministic
per-segment nonces (the segment's index) never repeat under one key.
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import struct
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from infemeral.errors import DataLoss, FailedPrecondition, PermissionDenied
from infemeral.kvcache.sequence import KVSequence

FORMAT_VERSION = 1
MANIFEST_MAGIC = b"INFKM"
CHUNK_MAGIC = b"INFKC"
_HEAD = struct.Struct("<5sHI")  # magic, format version, length of what follows (header / layer count)
_SEG_LEN = struct.Struct("<Q")
_AAD = struct.Struct("<9sH16sIQQQ16s")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _hkdf(secret: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(secret)


def _nonce(index: int) -> bytes:
    return index.to_bytes(12, "little")


@dataclass(frozen=True)
class SessionKeys:
    """Subkeys of one session; the raw session key is not kept."""

    session_id: bytes
    key_check: bytes
    _material: bytes = field(repr=False)

    @classmethod
    def derive(cls, session_id: bytes, session_key: bytes) -> "SessionKeys":
        return cls(session_id, _hkdf(session_key, session_id, b"infemeral key check v1"),
                   _hkdf(session_key, session_id, b"infemeral kv material v1"))

    def object_key(self, purpose: bytes, salt: bytes) -> AESGCM:
        return AESGCM(_hkdf(self._material, salt, b"infemeral " + purpose + b" v1"))

    def __repr__(self) -> str:  # never print key material
        return f"SessionKeys(session={self.session_id.hex()[:8]}…)"


@dataclass
class ChunkRef:
    name: str
    start: int
    end: int
    version: int
    salt: str  # hex


@dataclass
class Manifest:
    version: int
    length: int
    fingerprint: str
    key_check: str
    first_layer: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    chunks: list[ChunkRef]
    turn_id: str = ""  # hex id of the turn that committed this version


# -- manifest ---------------------------------------------------------------------------------
def seal_manifest(manifest: Manifest, keys: SessionKeys) -> bytes:
    salt = os.urandom(16)
    header = json.dumps({**asdict(manifest), "salt": salt.hex()}, sort_keys=True).encode()
    head = _HEAD.pack(MANIFEST_MAGIC, FORMAT_VERSION, len(header)) + header
    tag = keys.object_key(b"manifest", salt).encrypt(_nonce(0), b"", head + keys.session_id)
    return head + tag


def open_manifest(blob: bytes, keys: SessionKeys) -> Manifest:
    """Parse and authenticate a manifest: FAILED_PRECONDITION for an unknown format,
    PERMISSION_DENIED for the wrong key, DATA_LOSS for anything damaged or moved."""
    if len(blob) < _HEAD.size or blob[:5] != MANIFEST_MAGIC:
        raise DataLoss("stored session is not an infemeral session (bad magic); it is corrupted — delete the session")
    _, fmt, hlen = _HEAD.unpack_from(blob)
    if fmt != FORMAT_VERSION:
        raise FailedPrecondition(f"stored session has format version {fmt}; this server reads format "
                                 f"{FORMAT_VERSION} — upgrade the server or start a new session")
    head, tag = blob[:_HEAD.size + hlen], blob[_HEAD.size + hlen:]
    try:
        raw = json.loads(head[_HEAD.size:])
        salt = bytes.fromhex(raw.pop("salt"))
        stored_check = bytes.fromhex(raw["key_check"])
        raw["chunks"] = [ChunkRef(**c) for c in raw["chunks"]]
        manifest = Manifest(**raw)
    except (ValueError, KeyError, TypeError) as e:
        raise DataLoss("stored session manifest is damaged; delete the session and start again") from e
    if not hmac.compare_digest(stored_check, keys.key_check):
        raise PermissionDenied("the session key does not match this session's stored state; "
                               "use the key the session was created with")
    try:
        keys.object_key(b"manifest", salt).decrypt(_nonce(0), tag, head + keys.session_id)
    except InvalidTag as e:
        raise DataLoss("stored session manifest failed authentication (tampered, truncated or moved "
                       "from another session); delete the session and start a new one") from e
    return manifest


# -- chunks -----------------------------------------------------------------------------------
def _segment_aad(keys: SessionKeys, layer: int, ref: ChunkRef) -> bytes:
    return _AAD.pack(b"INFKV-seg", FORMAT_VERSION, keys.session_id, layer, ref.start, ref.end, ref.version,
                     bytes.fromhex(ref.salt))


def seal_chunk(cache: KVSequence, keys: SessionKeys, start: int, end: int, version: int) -> tuple[ChunkRef, bytes]:
    """Encrypt tokens [start, end) of every layer of `cache` as one chunk."""
    layers = (cache.layer_tensors(slot, start, end) for slot in range(cache.num_layers))
    return seal_layers(layers, cache.first_layer, cache.num_layers, keys, start, end, version)


def seal_layers(layers: Iterable[tuple[torch.Tensor, torch.Tensor]], first_layer: int, num_layers: int,
                keys: SessionKeys, start: int, end: int, version: int) -> tuple[ChunkRef, bytes]:
    """Encrypt each layer's (keys, values) for tokens [start, end), taken one layer at a time, as one chunk (a
    fork seals what it decrypts layer by layer, never holding a whole cache in the clear)."""
    salt = os.urandom(16)
    ref = ChunkRef(f"chunk-{version:08d}-{salt.hex()[:12]}", start, end, version, salt.hex())
    aead = keys.object_key(b"chunk", salt)
    parts = [_HEAD.pack(CHUNK_MAGIC, FORMAT_VERSION, num_layers)]
    for slot, (k, v) in enumerate(layers):
        plain = torch.stack([k, v]).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        ct = aead.encrypt(_nonce(slot), plain, _segment_aad(keys, first_layer + slot, ref))
        parts += [_SEG_LEN.pack(len(ct)), ct]
    if len(parts) != 1 + 2 * num_layers:
        raise ValueError(f"sealed {(len(parts) - 1) // 2} layers of {num_layers}")
    return ref, b"".join(parts)


def _segments(blob: bytes | None, ref: ChunkRef, manifest: Manifest) -> list[memoryview]:
    if blob is None:
        raise DataLoss(f"stored session is missing a segment (tokens {ref.start}-{ref.end}); "
                       "the session cannot be resumed — delete it and start a new one")
    view = memoryview(blob)
    try:
        magic, fmt, layers = _HEAD.unpack_from(view)
        if magic != CHUNK_MAGIC or fmt != FORMAT_VERSION or layers != manifest.num_layers:
            raise ValueError
        out, pos = [], _HEAD.size
        for _ in range(layers):
            (n,) = _SEG_LEN.unpack_from(view, pos)
            pos += _SEG_LEN.size
            if pos + n > len(view):
                raise ValueError
            out.append(view[pos:pos + n])
            pos += n
        if pos != len(view):
            raise ValueError
    except (ValueError, struct.error) as e:
        raise DataLoss(f"stored session segment (tokens {ref.start}-{ref.end}) is truncated or damaged; "
                       "delete the session and start a new one") from e
    return out


def decrypt_layers(chunks: list[tuple[ChunkRef, bytes | None]], manifest: Manifest,
                   keys: SessionKeys) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (slot, keys, values) per layer, each [kv_heads, length, head_dim] on the CPU."""
    dtype = _DTYPES[manifest.dtype]
    split = [(ref, _segments(blob, ref, manifest), keys.object_key(b"chunk", bytes.fromhex(ref.salt)))
             for ref, blob in chunks]
    for slot in range(manifest.num_layers):
        pieces = []
        for ref, segs, aead in split:
            try:
                plain = aead.decrypt(_nonce(slot), bytes(segs[slot]),
                                     _segment_aad(keys, manifest.first_layer + slot, ref))
            except InvalidTag as e:
                raise DataLoss(f"stored session segment (layer {manifest.first_layer + slot}, tokens "
                               f"{ref.start}-{ref.end}) failed authentication: tampered, moved or from an "
                               "older copy — delete the session and start a new one") from e
            t = torch.frombuffer(bytearray(plain), dtype=torch.uint8).view(dtype)
            pieces.append(t.view(2, manifest.kv_heads, ref.end - ref.start, manifest.head_dim))
        kv = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
        yield slot, kv[0], kv[1]


def check_coverage(manifest: Manifest) -> None:
    """DATA_LOSS unless the manifest's chunks cover its tokens from 0, contiguously, to its length."""
    expected = 0
    for ref in manifest.chunks:
        if ref.start != expected:
            raise DataLoss("stored session's segments do not cover its tokens contiguously; delete the session")
        expected = ref.end
    if expected != manifest.length:
        raise DataLoss("stored session's segments do not add up to its length; delete the session")


def load_into(cache: KVSequence, chunks: list[tuple[ChunkRef, bytes | None]], manifest: Manifest,
              keys: SessionKeys) -> None:
    """Fill `cache` from decrypted chunks; decryption of layer i+1 overlaps the copy of layer i."""
    if (manifest.first_layer, manifest.num_layers, manifest.kv_heads, manifest.head_dim) != \
            (cache.first_layer, cache.num_layers, cache.kv_heads, cache.head_dim):
        raise FailedPrecondition("stored session was made for different layers; was the server bundle replaced?")
    check_coverage(manifest)
    if manifest.length == 0:
        cache.set_length(0)
        return
    ready: queue.Queue = queue.Queue(maxsize=2)
    done = threading.Event()  # the consumer has stopped: the producer must not block on a full queue

    def hand_over(item) -> bool:
        while not done.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in decrypt_layers(chunks, manifest, keys):
                if not hand_over(item):
                    return
            hand_over(None)
        except BaseException as e:  # handed to the consumer
            hand_over(e)

    producer = threading.Thread(target=produce, name="infemeral-decrypt", daemon=True)
    producer.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            slot, k, v = item
            cache.load_layer(slot, k, v)
    finally:
        # On any failure (a bad segment, no room for the pages) stop the producer and drop the decrypted
        # layers it queued, so neither ciphertext nor plaintext outlives the failed load.
        done.set()
        producer.join()
        while not ready.empty():
            ready.get_nowait()
    cache.set_length(manifest.length)
