"""A prompt's upload: the steps it goes up in, sized by the link, and its progress.

A long prompt's hidden states are large (d bytes per token and element), so on a
home uplink the upload, not the pod, takes most of the time to the first token.
The prompt goes up in steps sent without waiting for their replies: the pod
prefills one step while the next is on the wire (docs/design.md §4). The first
steps are small so that the pod starts early (a prompt that fits in the first
goes up whole); later ones grow to what the measured rate carries in
`CHUNK_SECONDS`, so a fast link sends few of them; and the last ones shrink
again, so that what the pod has left to do after the last byte is small.

How the prompt is split must not change the answer. Steps that evict nothing
can be cut anywhere: the caches end the same. A step that makes the window
slide evicts by its own size (docs/design.md §5), so from the first step of
`max_chunk` tokens that would evict on, the prompt goes up in steps of
`max_chunk` from there, whatever the link: where the window slides does not
depend on the link's rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from infemeral.kvcache.window import WindowPolicy

FIRST_CHUNK_BYTES = 256 << 10  # the first step: small, so the pod starts while the rest is on the wire
CHUNK_SECONDS = 0.25     # a later step carries about this long of upload at the measured rate
MAX_IN_FLIGHT = 8        # steps sent and not yet answered, at most: bounds what waits in memory


@dataclass(frozen=True)
class UploadProgress:
    """How far a prompt's upload has got, counted by what the pod has received and prefilled.

    Bytes are the hidden states' payload on the wire (framing left out)."""

    tokens_sent: int
    tokens_total: int
    bytes_sent: int
    bytes_total: int
    seconds: float  # since the first step was sent

    @property
    def rate(self) -> float:
        """Bytes a second so far (0 before the pod has answered)."""
        return self.bytes_sent / self.seconds if self.seconds > 0 else 0.0

    @property
    def seconds_left(self) -> float | None:
        """The rest at the rate so far; None until there is a rate."""
        rate = self.rate
        return (self.bytes_total - self.bytes_sent) / rate if rate > 0 else None

    @property
    def is_done(self) -> bool:
        return self.tokens_sent >= self.tokens_total


ProgressCallback = Callable[[UploadProgress], None]


def free_tokens(length: int, count: int, window: WindowPolicy, max_chunk: int) -> int:
    """How many of a prompt's `count` tokens, sent onto a cache of `length`, go up in steps of any size: those
    before the first step of `max_chunk` that would make the window slide (or all, without a window)."""
    if not window.enabled:
        return count  # no slide: an overflow is refused at whichever step reaches it
    start = 0
    while start < count and length + min(start + max_chunk, count) <= window.max_context:
        start += max_chunk
    return min(start, count)


class ChunkSizer:
    """The size of each next step of one prompt: `FIRST_CHUNK_BYTES` of hidden states until the pod has answered,
    then what the measured rate carries in `CHUNK_SECONDS` (growing at most twofold a step), within
    `max_chunk`; at most half of what is left, down to the first step's size, so that the pod's work after the
    last byte is small; steps of `max_chunk` from `free` tokens on (see `free_tokens`)."""

    def __init__(self, total: int, free: int, max_chunk: int, bytes_per_token: int):
        self.total, self.free, self.max_chunk = total, free, max_chunk
        self.max_in_flight = MAX_IN_FLIGHT
        self.smallest = max(1, FIRST_CHUNK_BYTES // max(bytes_per_token, 1))
        self.size = self.smallest
        self._rate = 0.0  # tokens a second, once measured

    def next(self, sent: int) -> int:
        """The size of the step that starts at token `sent`."""
        if sent >= self.free:
            return min(self.max_chunk, self.total - sent)
        if self._rate:  # not before: a laptop that outruns its link would size every step blind
            self.size = max(self.smallest, min(2 * self.size, int(self._rate * CHUNK_SECONDS)))
        self.size = max(1, min(self.size, self.max_chunk))
        left = self.free - sent
        return min(self.size, max(self.smallest, -(-left // 2)), left)  # halving at the end: the last is small

    def measured(self, tokens: int, seconds: float) -> None:
        """`tokens` of the prompt answered by the pod in `seconds` since the first step was sent."""
        if tokens > 0 and seconds > 0:
            self._rate = tokens / seconds


class UploadClock:
    """The progress of one prompt's upload, from the steps the pod has answered."""

    def __init__(self, tokens_total: int, bytes_per_token: int):
        self.tokens_total, self.bytes_per_token = tokens_total, bytes_per_token
        self.started = time.perf_counter()
        self.tokens = 0

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def answered(self, tokens: int) -> UploadProgress:
        """The pod answered a step of `tokens`: the progress now."""
        self.tokens += tokens
        return UploadProgress(self.tokens, self.tokens_total, self.tokens * self.bytes_per_token,
                              self.tokens_total * self.bytes_per_token, self.seconds)
