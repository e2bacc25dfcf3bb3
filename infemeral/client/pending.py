"""A turn whose commit was sent but whose reply never came (the connection was lost).

The server may or may not have committed it, and only the server can say.
Until it does, the session keeps its committed state *and* this record of the
state that turn leads to. The next turn names it when it opens
(`pending_turn_id`): if that very turn is what moved the stored session on,
the server says so and the session adopts this state; otherwise it is
dropped. The record is saved in the session file, so a client that exits in
between settles it when the session is resumed, instead of finding the server
one version ahead.

`committed_copy` is the one way a turn keeps a cache aside: the committed
state it may have to restore (taken before the turn first rewrites committed
positions), and the state a lost commit may turn out to have reached.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from infemeral.client.result import TurnResult
from infemeral.kvcache.cache import KVCache

PREFIX = "pending."  # tensor names in the session file


def committed_copy(cache: KVCache, length: int) -> KVCache:
    """A copy of `cache`'s first `length` positions, all of them committed: a state a session can adopt as it
    is, whatever happens to `cache` afterwards (rollbacks and saves keep all of it)."""
    if length > cache.length:
        raise ValueError(f"cannot copy {length} positions of a cache of {cache.length}")
    copy = cache.clone()
    copy.set_length(length)
    return copy


@dataclass
class PendingCommit:
    turn_id: bytes           # the turn whose commit is in doubt
    version: int             # the session's version if it landed
    cache: KVCache           # the client's local cache as that turn left it, marked committed
    history_ids: list[int]   # tokens in that cache (and any the window evicted), client-side only
    messages: list[dict]     # the transcript with that turn's exchange
    result: TurnResult

    @classmethod
    def of_turn(cls, turn_id: bytes, version: int, cache: KVCache, history_ids: list[int], messages: list[dict],
                result: TurnResult) -> "PendingCommit":
        """Record a turn's outcome; copies the whole cache, which the session is about to roll back."""
        return cls(turn_id, version, committed_copy(cache, cache.length), list(history_ids), list(messages), result)

    # -- the session file ----------------------------------------------------------------------------
    def metadata(self) -> dict:
        return {"turn_id": self.turn_id.hex(), "version": self.version, "history_ids": self.history_ids,
                "messages": self.messages, "cache_length": self.cache.length, "result": asdict(self.result)}

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for slot in range(self.cache.num_layers):
            k, v = self.cache.layer_tensors(slot)
            out[f"{PREFIX}k.{slot}"], out[f"{PREFIX}v.{slot}"] = k.contiguous(), v.contiguous()
        return out

    @classmethod
    def from_saved(cls, meta: dict, tensors: dict[str, torch.Tensor], cache: KVCache) -> "PendingCommit":
        """Rebuild from `metadata()` and `tensors()`, loading the tensors into the empty `cache`."""
        for slot in range(cache.num_layers):
            cache.load_layer(slot, tensors[f"{PREFIX}k.{slot}"], tensors[f"{PREFIX}v.{slot}"])
        cache.set_length(meta["cache_length"])
        return cls(bytes.fromhex(meta["turn_id"]), meta["version"], cache, meta["history_ids"], meta["messages"],
                   TurnResult(**meta["result"]))
