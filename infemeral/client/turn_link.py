"""The model's two halves during one turn: the laptop's layers here, the server's over the turn's stream.

Every step runs through both and both caches move together: the window
evicts at the same step on each side (docs/design.md §5), and positions dropped
here (rejected drafts, the tail of an answer) are dropped on the server by a
`Truncate` sent in the same flight as the next message, so a rejection costs
no extra round trip. A prompt's steps go up without waiting for each other's
replies (`prefill`), so the pod works while the rest is on the wire. Before
the turn first drops or moves committed positions, the committed cache is
copied: a turn that does not commit hands that copy back to its session.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from infemeral.client.pending import committed_copy
from infemeral.client.stream import ReplyReader, TurnStream
from infemeral.client.upload import ChunkSizer, ProgressCallback, UploadClock, free_tokens
from infemeral.errors import Aborted
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.window import WindowPolicy, apply_window
from infemeral.protocol import pb
from infemeral.protocol.tensors import Wire, from_proto, to_proto


@dataclass(frozen=True)
class SentStep:
    """A step on its way: its ids, and what its reply must say (the cache's length after it, the eviction before it)
    and hold (`num_outputs` outputs)."""

    ids: list[int]
    cache_length: int
    evict: int
    num_outputs: int
    keep_features: int = 0  # of a prompt's step: how many of its outputs' features the prompt keeps


class TurnLink:
    """`model` and `cache` (the session's) on the laptop, the server behind `stream`, which announced `info`.

    `ids` are the tokens the caches hold, those the window evicted included (client-side only)."""

    def __init__(self, model, cache: KVCache, ids: list[int], stream: TurnStream, info: pb.ServerInfo,
                 wire: Wire):
        self.model, self.cache, self.ids, self.stream, self.wire = model, cache, list(ids), stream, wire
        self.max_step_tokens, self.max_context = info.max_step_tokens, info.max_context
        self.window = WindowPolicy(info.max_context, info.sink_tokens, info.page_size or 1, enabled=info.window)
        self.committed: KVCache | None = None  # the committed cache, copied before it is first rewritten
        self.features: torch.Tensor | None = None  # the last step's outputs as the LM head reads them [n, d]
        self.num_evicted = 0                   # tokens the window dropped during this turn
        self.draft_trees = info.draft_trees    # the server verifies draft trees (else chains only)
        self._pending_drop = 0                 # positions dropped here whose Truncate goes out with the next message
        self._pending_keep: list[int] = []     # ...but for these offsets among them (a tree's accepted path)
        self._tree_step: tuple[int, int, int] | None = None  # the last step's tree: (cache start, ids start, rows)

    # -- limits ------------------------------------------------------------------------------------
    @property
    def max_chunk(self) -> int:
        """Most tokens one step may carry."""
        return max(1, min(self.max_step_tokens, self.window.max_step))

    @property
    def is_full(self) -> bool:
        """Without a window, whether the caches have no room for another token."""
        return not self.window.enabled and self.cache.length + 1 > self.max_context

    def draft_room(self) -> int:
        """Most drafts the next step may carry besides its token (may be below 0): within the step limits, and
        never so many that the window would evict at a different step than decoding one token at a time
        (so greedy output stays the same with and without speculation)."""
        length, window = self.cache.length, self.window
        room = min(self.max_step_tokens - 1, window.max_step - 1)
        if window.enabled:
            return min(room, self.max_context - (length - window.tokens_to_evict(length, 1)) - 1)
        return min(room, self.max_context - length - 1)

    # -- steps -------------------------------------------------------------------------------------
    def step(self, ids: list[int], num_outputs: int = 1, num_logits: int | None = None,
             parents: list[int] | None = None) -> torch.Tensor:
        """Run `ids` through both halves; the logits [num_logits, vocab] of the last positions (of all
        `num_outputs` outputs unless fewer are asked for). `features` keeps every output's feature. With
        `parents` (the server must take draft trees) the ids are a draft tree (layers/draft_tree.py), all of
        whose rows stay in the caches until `keep_path` keeps the accepted ones."""
        drop = self._flush_drop()
        before = self.cache.length
        if parents is not None and not self.draft_trees:
            raise ValueError("this server verifies chains only (ServerInfo.draft_trees); send the step without parents")
        sent = self._send_step(ids, num_outputs, parents=parents)
        if drop:
            self._check_truncated(self.stream.receive("truncated"), before)
        self._answered(sent, self.stream.receive("step"))
        return self.model.project(self.features if num_logits is None else self.features[-num_logits:])

    def prefill(self, ids: list[int], last_outputs: int = 1,
                on_progress: ProgressCallback | None = None) -> torch.Tensor:
        """Run a prompt through both halves, its steps sent without waiting for their replies (`upload`): the
        pod prefills one step while the next is on the wire, and the laptop's layers run the next meanwhile.
        The logits [vocab] of the last position; `features` keeps those of the prompt's last `last_outputs`
        positions, from as many steps as they span. Every reply is checked as `step` checks it; `on_progress`
        hears of each (an exception it raises ends the turn, which then commits nothing)."""
        drop = self._flush_drop()  # none at a turn's start, where prompts go
        if drop:
            self._check_truncated(self.stream.receive("truncated"), self.cache.length)
        per_token = self._bytes_per_token()
        sizer = ChunkSizer(len(ids), free_tokens(self.cache.length, len(ids), self.window, self.max_chunk),
                           self.max_chunk, per_token)
        clock = UploadClock(len(ids), per_token)
        replies = ReplyReader(self.stream, "step")
        in_flight: deque[SentStep] = deque()
        kept: list[torch.Tensor] = []
        kept_from = len(ids) - last_outputs  # the first position whose feature is kept
        try:
            start = 0
            while start < len(ids):
                self._take_replies(replies, in_flight, sizer, clock, on_progress, kept,
                                   wait=len(in_flight) >= sizer.max_in_flight)
                part = ids[start:start + sizer.next(start)]
                keep = min(max(start + len(part) - max(start, kept_from), 0), len(part))  # the last `keep` of it
                start += len(part)
                in_flight.append(self._send_step(part, max(keep, 1), keep))
                replies.expect_one()
            while in_flight:
                self._take_replies(replies, in_flight, sizer, clock, on_progress, kept, wait=True)
        finally:
            replies.stop()
        if len(kept) > 1:  # the kept positions spanned several steps
            self.features = torch.cat(kept)
        return self.model.project(self.features[-1:])[-1]

    def _send_step(self, ids: list[int], num_outputs: int, keep_features: int = 0,
                   parents: list[int] | None = None) -> SentStep:
        """Slide the window if the step needs it, run the laptop's layers, send the step; what to expect back."""
        cache, model, window = self.cache, self.model, self.window
        before = cache.length
        evict = window.tokens_to_evict(before, len(ids))
        if evict:
            self._keep_committed()
            apply_window(cache, window, len(ids), model.inv_freq)
            self.num_evicted += evict
        # a tree's rows start where the cache ends once the window has slid
        self._tree_step = None if parents is None else (cache.length, len(self.ids), len(ids))
        hidden = model.cloak(ids, cache, parents)
        self.stream.send(pb.TurnRequest(step=pb.Step(hidden=self._encode(hidden), cache_length=before,
                                                     evict=evict, outputs=num_outputs if num_outputs > 1 else 0,
                                                     answer_dtype=self.wire.answer, parents=parents or [])))
        return SentStep(list(ids), cache.length, evict, num_outputs, keep_features)

    def _encode(self, hidden: torch.Tensor) -> pb.Tensor:
        return to_proto(hidden, self.wire.upload)

    def _answered(self, sent: SentStep, out: pb.StepResult) -> None:
        """Check the server's reply to `sent` and take its outputs: `features`, and the step's ids into `ids`."""
        if out.cache_length != sent.cache_length or out.evicted != sent.evict:
            raise Aborted(f"server cache length {out.cache_length} (evicted {out.evicted}) != client's "
                          f"{sent.cache_length} (evicted {sent.evict})")
        residual = from_proto(out.hidden, self.model.hidden_size, sent.num_outputs, "server residual")
        if residual.shape[0] != sent.num_outputs:
            raise Aborted(f"server returned {residual.shape[0]} outputs for a step that asked for {sent.num_outputs}")
        self.ids += sent.ids
        self.features = self.model.features(residual)

    def _take_replies(self, replies: ReplyReader, in_flight: deque[SentStep], sizer: ChunkSizer, clock: UploadClock,
                      on_progress, kept: list[torch.Tensor], wait: bool) -> None:
        """Take the replies that have come (with `wait`, at least one) to the oldest steps in flight; the
        features the prompt keeps go to `kept`."""
        while in_flight:
            reply = replies.get(block=wait)
            if reply is None:
                return
            out, arrived = reply
            sent = in_flight.popleft()
            self._answered(sent, out)
            if sent.keep_features:
                kept.append(self.features[-sent.keep_features:])
            progress = clock.answered(len(sent.ids))
            sizer.measured(clock.tokens, arrived - clock.started)
            if on_progress is not None:
                on_progress(progress)
            wait = False

    def _bytes_per_token(self) -> int:
        """What one token's hidden state takes on the wire, framing left out (every wire's size is linear in
        the tokens: the difference between two rows and one)."""
        rows = torch.zeros(2, self.model.hidden_size)
        return self._encode(rows).ByteSize() - self._encode(rows[:1]).ByteSize()

    def truncate(self, tokens: int) -> None:
        """Drop the caches' last `tokens` positions on both sides now, waiting for the server (a rewind)."""
        self._keep_committed()
        self.stream.call(pb.TurnRequest(truncate=pb.Truncate(tokens=tokens, cache_length=self.cache.length)),
                         "truncated")
        self.cache.truncate(tokens)

    def keep(self, length: int) -> None:
        """Drop the caches' positions past `length` of `ids` (rejected drafts, or tokens after the end): here at
        once, on the server with the next message."""
        drop = len(self.ids) - length
        if drop > 0:
            self.cache.truncate(drop)
            self.ids = self.ids[:length]
            if drop <= len(self._pending_keep):  # the tail of a kept tree path: keep less of it
                self._pending_keep = self._pending_keep[:len(self._pending_keep) - drop]
            else:
                self._pending_drop += drop - len(self._pending_keep)
                self._pending_keep = []

    def keep_path(self, rows: list[int]) -> None:
        """After a draft tree's step: keep its `rows` (ascending: the root, then each accepted child), moved to
        consecutive positions, and drop its other rows — here at once, on the server with the next message
        (a Truncate whose `keep` lists them). Their keys were rotated for base + depth, which is where they
        land, so nothing is re-rotated."""
        if self._tree_step is None:
            raise RuntimeError("keep_path follows a draft tree's step")
        start, ids_start, num_rows = self._tree_step
        self._tree_step = None
        self.cache.keep_positions(start, list(rows))
        step_ids = self.ids[ids_start:]
        self.ids = self.ids[:ids_start] + [step_ids[r] for r in rows]
        self._pending_drop, self._pending_keep = num_rows, list(rows)

    def commit(self) -> int:
        """Ask the server to commit the turn (after any pending drop); the session's new version."""
        drop = self._flush_drop()
        self.stream.send(pb.TurnRequest(commit=pb.Commit()))
        if drop:
            self._check_truncated(self.stream.receive("truncated"), self.cache.length)
        return self.stream.receive("committed").version

    def close(self) -> None:
        self.stream.close()

    # -- helpers -----------------------------------------------------------------------------------
    def _flush_drop(self) -> int:
        """Send the pending Truncate ahead of the next message (its reply is read after that message's)."""
        drop, keep = self._pending_drop, self._pending_keep
        self._pending_drop, self._pending_keep = 0, []
        if drop:
            self.stream.send(pb.TurnRequest(truncate=pb.Truncate(
                tokens=drop, cache_length=self.cache.length + drop - len(keep), keep=keep)))
        return drop

    def _check_truncated(self, reply, expected: int) -> None:
        if reply.cache_length != expected:
            raise Aborted(f"server cache length {reply.cache_length} after dropping rejected drafts != client's "
                          f"{expected}")

    def _keep_committed(self) -> None:
        """Before the turn first drops or moves committed positions (a truncation, an eviction): copy the
        committed cache, which a turn that does not commit restores."""
        if self.committed is None:
            self.committed = committed_copy(self.cache, self.cache.committed_length)
