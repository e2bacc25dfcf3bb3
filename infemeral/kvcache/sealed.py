"""A session's KV cache sealed with AES-256-GCM under keys derived from the client's session key.

Layout: MAGIC | u16 format version | u32 header length | header JSON | nonce | ciphertext.
The header (session version, length, shapes, dtype, bundle fingerprint and a
key-check value) is authenticated as associated data together with the
session id, so moving a blob to another session, editing the header or
flipping any byte fails authentication. The key-check value, an HKDF output,
lets the server tell "wrong key" (PERMISSION_DENIED) from "damaged data"
(DATA_LOSS) without revealing anything about the key.
"""

from __future__ import annotations

import hmac
import json
import os
import struct
from dataclasses import dataclass

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from infemeral.errors import DataLoss, FailedPrecondition, PermissionDenied
from infemeral.kvcache.cache import KVCache

MAGIC = b"INFKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<5sHI")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _hkdf(session_key: bytes, session_id: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=session_id, info=info).derive(session_key)


@dataclass(frozen=True)
class SessionKeys:
    """Subkeys of one session; the raw session key is not kept."""

    session_id: bytes
    key_check: bytes
    _material: bytes

    @classmethod
    def derive(cls, session_id: bytes, session_key: bytes) -> "SessionKeys":
        return cls(session_id, _hkdf(session_key, session_id, b"infemeral key check v1"),
                   _hkdf(session_key, session_id, b"infemeral kv material v1"))

    def cache_key(self, version: int) -> bytes:
        """A fresh AES key per stored version, so random nonces never meet twice under one key."""
        return _hkdf(self._material, self.session_id, b"infemeral kv cache v1/" + str(version).encode())

    def __repr__(self) -> str:  # never print key material
        return f"SessionKeys(session={self.session_id.hex()[:8]}…)"


@dataclass
class SealedHeader:
    version: int
    length: int
    first_layer: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    fingerprint: str
    key_check: str


def seal(cache: KVCache, keys: SessionKeys, version: int, fingerprint: str) -> bytes:
    dtype = str(cache.dtype).removeprefix("torch.")
    header = SealedHeader(version, cache.length, cache.first_layer, cache.num_layers, cache.kv_heads,
                          cache.head_dim, dtype, fingerprint, keys.key_check.hex())
    header_bytes = json.dumps(header.__dict__, sort_keys=True).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header_bytes))
    parts = []
    for slot in range(cache.num_layers):
        k, v = cache.layer_tensors(slot)
        parts.append(k.contiguous().cpu().view(torch.uint8).numpy().tobytes())
        parts.append(v.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    plaintext = b"".join(parts)
    nonce = os.urandom(12)
    ct = AESGCM(keys.cache_key(version)).encrypt(nonce, plaintext, prefix + header_bytes + keys.session_id)
    return prefix + header_bytes + nonce + ct


def read_header(blob: bytes) -> tuple[SealedHeader, bytes, int]:
    """Parse the unauthenticated header; callers must still `unseal`."""
    if len(blob) < _PREFIX.size or blob[:5] != MAGIC:
        raise DataLoss("stored cache is not an infemeral cache (bad magic); it is corrupted — delete the session")
    _, fmt, hlen = _PREFIX.unpack_from(blob)
    if fmt != FORMAT_VERSION:
        raise FailedPrecondition(f"stored cache has format version {fmt}; this server reads version {FORMAT_VERSION}")
    try:
        header = SealedHeader(**json.loads(blob[_PREFIX.size:_PREFIX.size + hlen]))
    except (ValueError, TypeError) as e:
        raise DataLoss("stored cache header is damaged; delete the session and start again") from e
    return header, blob[:_PREFIX.size + hlen], _PREFIX.size + hlen


def check_key(header: SealedHeader, keys: SessionKeys) -> None:
    try:
        stored = bytes.fromhex(header.key_check)
    except ValueError as e:
        raise DataLoss("stored cache header is damaged; delete the session and start again") from e
    if not hmac.compare_digest(stored, keys.key_check):
        raise PermissionDenied("the session key does not match this session's stored cache; "
                               "use the key the session was created with")


def unseal(blob: bytes, keys: SessionKeys, cache: KVCache) -> SealedHeader:
    """Authenticate, decrypt and load the blob into `cache` (which must be empty)."""
    header, aad_head, offset = read_header(blob)
    check_key(header, keys)
    nonce, ct = blob[offset:offset + 12], blob[offset + 12:]
    try:
        plaintext = AESGCM(keys.cache_key(header.version)).decrypt(nonce, ct, aad_head + keys.session_id)
    except InvalidTag as e:
        raise DataLoss("stored cache failed authentication (tampered, truncated or moved); "
                       "the session cannot be resumed — delete it and start a new one") from e
    if (header.first_layer, header.num_layers, header.kv_heads, header.head_dim) != \
            (cache.first_layer, cache.num_layers, cache.kv_heads, cache.head_dim):
        raise FailedPrecondition("stored cache was made for different layers; was the server bundle replaced?")
    dtype = _DTYPES[header.dtype]
    per = header.kv_heads * header.length * header.head_dim
    flat = torch.frombuffer(bytearray(plaintext), dtype=torch.uint8).view(dtype)
    for slot in range(header.num_layers):
        base = 2 * slot * per
        k = flat[base:base + per].view(header.kv_heads, header.length, header.head_dim)
        v = flat[base + per:base + 2 * per].view(header.kv_heads, header.length, header.head_dim)
        cache.load_layer(slot, k, v)
    del plaintext, flat
    cache.set_length(header.length)
    return header
