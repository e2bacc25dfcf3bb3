"""A session saved to an owner-only file, to resume a conversation in another process.

The file holds everything the server does not: the session id and key, the
version, the transcript and the committed part of the local layers' cache, and
a turn whose commit is still unconfirmed (`PendingCommit`), so that a client
that exits in between settles it when the session is resumed. Safetensors,
with the metadata as JSON; written whole, owner-only and durably (`write_private`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from infemeral.errors import FailedPrecondition, InfemeralError
from infemeral.files import write_private

if TYPE_CHECKING:  # torch loads with the tensors, not to read who a session is (`identity`: delete)
    from infemeral.client.pending import PendingCommit
    from infemeral.kvcache.cache import KVCache

FORMAT = "infemeral-session"
VERSION = 2  # 2: adds an unconfirmed turn (`pending`); version 1 files still load


@dataclass
class SavedSession:
    """What a session file holds, apart from the bundle it belongs to."""

    id: bytes
    key: bytes
    version: int
    history_ids: list[int]  # tokens in the committed caches, client-side only
    messages: list[dict]
    cache: KVCache          # only its committed positions are saved
    pending_commit: PendingCommit | None
    # (tokens, messages) at the end of each turn still in the caches (`Session.turn_ends`); none in older files
    turn_ends: list[tuple[int, int]] = field(default_factory=list)


def save(path: str | Path, saved: SavedSession, server_fingerprint: str) -> Path:
    from safetensors.torch import save as save_tensors

    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    cache, pending = saved.cache, saved.pending_commit
    meta = {"format": FORMAT, "format_version": VERSION, "server_fingerprint": server_fingerprint,
            "id": saved.id.hex(), "key": saved.key.hex(), "version": saved.version,
            "history_ids": saved.history_ids, "messages": saved.messages, "cache_length": cache.committed_length,
            "pending": pending.metadata() if pending else None, "turn_ends": saved.turn_ends}
    tensors = {}
    for slot in range(cache.num_layers):
        k, v = cache.layer_tensors(slot, 0, cache.committed_length)
        tensors[f"k.{slot}"], tensors[f"v.{slot}"] = k.contiguous(), v.contiguous()
    if pending:
        tensors.update(pending.tensors())
    # durable: it holds the session's key, without which the cache the server keeps for it cannot be read
    return write_private(path, save_tensors(tensors, metadata={"session": json.dumps(meta)}), durable=True)


def load(path: str | Path, server_fingerprint: str, new_cache: Callable[[], KVCache]) -> SavedSession:
    """The session saved at `path`, its caches loaded into new ones from `new_cache`; refused if the file
    belongs to another bundle than the one with `server_fingerprint`."""
    from safetensors.torch import load_file

    from infemeral.client.pending import PendingCommit

    path = Path(path).expanduser()
    meta = _metadata(path, server_fingerprint)
    tensors = load_file(str(path))
    cache = new_cache()
    for slot in range(cache.num_layers):
        cache.load_layer(slot, tensors[f"k.{slot}"], tensors[f"v.{slot}"])
    cache.set_length(meta.get("cache_length", len(meta["history_ids"])))
    pending = PendingCommit.from_saved(meta["pending"], tensors, new_cache()) if meta.get("pending") else None
    return SavedSession(bytes.fromhex(meta["id"]), bytes.fromhex(meta["key"]), meta["version"], meta["history_ids"],
                        meta["messages"], cache, pending, [tuple(end) for end in meta.get("turn_ends", [])])


def identity(path: str | Path, server_fingerprint: str) -> tuple[bytes, bytes, int]:
    """(id, key, version) of the session saved at `path`, read from the file's header alone (no torch)."""
    meta = _metadata(Path(path).expanduser(), server_fingerprint)
    return bytes.fromhex(meta["id"]), bytes.fromhex(meta["key"]), meta["version"]


def transcript(path: str | Path, server_fingerprint: str) -> list[dict]:
    """The messages of the session saved at `path`, read from the file's header alone (no torch)."""
    return _metadata(Path(path).expanduser(), server_fingerprint)["messages"]


def _metadata(path: Path, server_fingerprint: str) -> dict:
    """The session's metadata from the safetensors header (an 8-byte little-endian length, then JSON); refused
    if the file is no session file or belongs to another bundle than the one with `server_fingerprint`."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        meta = json.loads(header.get("__metadata__", {}).get("session", "{}"))
    except (struct.error, ValueError, AttributeError):
        meta = {}
    if meta.get("format") != FORMAT or meta.get("format_version") not in (1, VERSION):
        raise InfemeralError(f"{path} is not an infemeral session file this version can read")
    if meta["server_fingerprint"] != server_fingerprint:
        raise FailedPrecondition(f"{path} belongs to a different client bundle")
    return meta
