"""One turn of a session, in phases: open, rewind, prefill, decode (draft → verify → accept), commit.

A turn is one bidirectional gRPC stream (DESIGN.md §4). `TurnLoop` is that
turn on the client, shared by everything that generates (the chat SDK, the
CLI, raw completion, the OpenAI endpoint):

    with TurnLoop(session, messages, params) as turn:   # open the stream, rewind the caches
        for delta in turn.generate():                   # prefill, then decode with speculation
            ...
        turn.commit()

Leaving the `with` block without a commit rolls both caches back (the server
drops an uncommitted turn by itself): the client's cache returns to exactly the
committed state, even when the turn dropped or the window evicted committed
positions (the turn copies the committed cache before it first rewrites it). A
commit whose reply was lost is kept as a `PendingCommit` for the next turn to
settle.

Opening a turn is retried while the server answers RESOURCE_EXHAUSTED with a
`retry-after-ms` hint, within the client's timeout: nothing has been sent
then but the request to open. Once a turn has started, nothing is retried.

Decoding sends the last sampled token plus up to k drafted tokens per step and
asks for all their outputs (DESIGN.md §9): one round trip verifies the drafts,
the longest agreeing prefix is kept, and the rejected positions are dropped
from both caches — locally at once, on the server by a `Truncate` sent in the
same flight as the next step, so a rejection costs no extra round trip.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
from collections.abc import Callable, Iterator

import grpc
import torch

from infemeral.client.keepalive import KeepAlive
from infemeral.client.pending import PendingCommit, committed_copy
from infemeral.client.result import TurnResult
from infemeral.client.sampling import Sampler, SamplingParams
from infemeral.errors import Aborted, ResourceExhausted, StatusError, from_rpc_error
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.window import WindowPolicy, apply_window
from infemeral.protocol import pb
from infemeral.protocol.tensors import from_proto, to_proto
from infemeral.speculation.acceptance import accept_drafts
from infemeral.speculation.source import DraftSource

log = logging.getLogger(__name__)
RETRY_AFTER_KEY = "retry-after-ms"  # the server's hint on RESOURCE_EXHAUSTED (infemeral.server.turn_call)
MIN_RETRY_WAIT = 0.05  # seconds


class TurnStream:
    """One bidirectional Turn RPC: send requests, read responses in order.

    Requests may be sent ahead of the replies (a truncation and the next step travel together);
    the server answers each in order. While the client is busy between messages (a slow laptop), keep-alives
    stop the server's turn-idle deadline from firing."""

    def __init__(self, client):
        self._requests: queue.Queue = queue.Queue()
        self._keepalive = KeepAlive(self._requests.put, client.server_info().turn_idle_seconds)
        self._responses = client.stub.Turn(iter(self._requests.get, None), timeout=client.timeout)

    def send(self, request: pb.TurnRequest) -> None:
        self._keepalive.sent()
        self._requests.put(request)

    def receive(self, expect: str):
        try:
            response = next(self._responses)
        except grpc.RpcError as e:
            raise status_error(e) from None
        except StopIteration:
            raise StatusError("server ended the turn unexpectedly") from None
        kind = response.WhichOneof("kind")
        if kind != expect:
            raise StatusError(f"protocol error: expected {expect}, got {kind}")
        return getattr(response, kind)

    def call(self, request: pb.TurnRequest, expect: str):
        self.send(request)
        return self.receive(expect)

    def close(self) -> None:
        """End the stream. Half-close first and wait for the server to finish the call, so that the
        session is released on the server before the next turn opens; then make sure it is over."""
        self._keepalive.stop()
        self._requests.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass
        self._responses.cancel()


def status_error(e: grpc.RpcError) -> StatusError:
    """The StatusError of a failed call. RESOURCE_EXHAUSTED carries the server's `retry-after-ms` hint as
    `retry_after` in seconds, or None where the server gave none (a limit that waiting will not lift)."""
    error = from_rpc_error(e)
    if isinstance(error, ResourceExhausted):
        error.retry_after = None
        metadata = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
        for key, value in metadata or ():
            if key == RETRY_AFTER_KEY:
                try:
                    error.retry_after = max(int(value), 0) / 1000
                except ValueError:
                    pass
    return error


def open_turn(client, request: pb.OpenTurn) -> tuple[TurnStream, pb.Opened]:
    """Open a Turn stream: the stream and the server's `opened` reply.

    While the server is at a limit (RESOURCE_EXHAUSTED with a retry hint) wait as it says and try again,
    until the client's timeout would pass: the open is all that was sent, so trying again repeats nothing."""
    deadline = time.monotonic() + client.timeout
    while True:
        stream = TurnStream(client)
        try:
            return stream, stream.call(pb.TurnRequest(open=request), "opened")
        except ResourceExhausted as e:
            stream.close()
            if e.retry_after is None or time.monotonic() + e.retry_after > deadline:
                raise
            log.info("server is at a limit; opening the turn again in %.2f s", e.retry_after)
            time.sleep(max(e.retry_after, MIN_RETRY_WAIT))
        except BaseException:
            stream.close()
            raise


class TextStream:
    """The answer's text as its tokens arrive: cut at the first stop string, and held back while it
    could still become one, or while it ends in half a character.

    Each token costs a bounded amount of work, however long the answer: only the newest tokens are
    decoded (with a few before them as context, as a detokenizer must: a piece's leading space, a
    character split over tokens), stop strings are looked for only where a new one can be, and text is
    kept in pieces. The output is the same as decoding the whole answer at every token. A tokenizer that
    cleans up spaces when it decodes (which can change text already decoded) is decoded whole each time."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.longest_stop = max((len(s) for s in self.stop), default=1)
        self.hold = self.longest_stop - 1
        self.token_ids: list[int] = []
        self.is_stopped = False
        self._is_whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        # token_ids[:_read] decode to whole characters: the settled text. Of it, `_pieces` hold what no stop
        # search or emission reads again, and `_recent` (from text index `_recent_at`) the rest.
        # token_ids[_context:_read] are decoded again with newer tokens as their context.
        self._pieces: list[str] = []
        self._recent, self._recent_at = "", 0
        self._context = self._read = 0
        self._view = ""  # the text from `_recent_at` as of the last token (cut at a stop string)
        self._emitted = 0  # characters shown so far

    @property
    def text(self) -> str:
        """The answer's text so far (cut at a stop string)."""
        return "".join(self._pieces) + self._view

    def push(self, token: int) -> str:
        """Add a token; return the text that is now safe to show (possibly nothing)."""
        self.token_ids.append(token)
        known = self._recent_at + len(self._recent)  # settled text: no stop string lies wholly in it
        tail = self._decode_tail()
        if tail is None:  # the decoder changed text it gave before (invalid bytes): begin again from the whole
            known, tail = 0, self._start_over()
        view = self._recent + tail
        search_from = max(known - self.longest_stop + 1 - self._recent_at, 0)
        hits = [i for i in (view.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            view, self.is_stopped = view[:min(hits)], True
        self._view = view
        if not (self._is_whole or self.is_stopped) and tail and not tail.endswith("\ufffd"):  # whole characters
            self._recent += tail
            self._context, self._read = self._read, len(self.token_ids)
        length = self._recent_at + len(view)
        if self.is_stopped:
            delta = self._emit(length)
        else:
            ready = max(self._emitted, length - self.hold)
            is_half = ready > self._emitted and view[ready - 1 - self._recent_at] == "\ufffd"  # half a character
            delta = "" if is_half else self._emit(ready)
        self._forget_read_text()
        return delta

    def flush(self) -> str:
        """Whatever was held back, at the end of the answer."""
        return self._emit(self._recent_at + len(self._view))

    def _decode_tail(self) -> str | None:
        """The text of token_ids[_read:] (it may end in half a character); None if decoding it with its
        context changed the context's own text (a byte-fallback decoder meeting an invalid byte sequence)."""
        decode = self.tokenizer.decode
        if self._is_whole:
            return decode(self.token_ids, skip_special_tokens=True)
        context = decode(self.token_ids[self._context:self._read], skip_special_tokens=True)
        text = decode(self.token_ids[self._context:], skip_special_tokens=True)
        return text[len(context):] if text.startswith(context) else None

    def _start_over(self) -> str:
        """Forget the settled text; the whole answer's text, as the new tail."""
        self._pieces, self._recent, self._recent_at = [], "", 0
        self._context = self._read = 0
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _emit(self, end: int) -> str:
        """The text from what was shown up to index `end` (nothing if that is not further)."""
        if end <= self._emitted:
            return ""
        delta = self._view[self._emitted - self._recent_at:end - self._recent_at]
        self._emitted = end
        return delta

    def _forget_read_text(self) -> None:
        """Move settled text that neither a stop search nor an emission reads again out of `_recent`."""
        settled = self._recent_at + len(self._recent)
        keep_from = min(self._emitted, settled - self.longest_stop + 1)
        if keep_from - self._recent_at > 256:  # in chunks: each move copies what stays
            cut = keep_from - self._recent_at
            self._pieces.append(self._recent[:cut])
            self._recent, self._view, self._recent_at = self._recent[cut:], self._view[cut:], keep_from


class TurnLoop:
    """One turn of `session`: the new user message(s) in `messages`, answered under `params`.

    `messages` is the session's transcript plus the new message; with `is_whole_transcript` it is a whole
    transcript given by the caller (the OpenAI endpoint), kept as it is even when a lost commit is settled
    first. A raw turn has no messages: `render` gives its token ids, and it leaves the transcript empty."""

    def __init__(self, session, messages: list[dict], params: SamplingParams,
                 render: Callable[[list[dict]], list[int]] | None = None, *, is_whole_transcript: bool = False):
        self.session, self.client = session, session.client
        self.model = self.client.model
        self.messages, self.params = messages, params
        self.render = render or session.render
        self.is_whole_transcript = is_whole_transcript
        self.result = TurnResult()
        self.turn_id = secrets.token_bytes(16)
        self.sampler = Sampler(params)
        self.source: DraftSource | None = None
        self.draft_length = session.draft_length
        self.stream: TurnStream | None = None
        self.fed: list[int] = []      # what the caches hold (with what the window evicted), client-side only
        self.generated: list[int] = []
        self.is_commit_sent = self.is_committed = False
        self._committed: KVCache | None = None  # the committed local cache, copied before it is first rewritten
        self._pending_drop = 0        # positions dropped here whose Truncate goes out with the next message
        self._has_lock = False

    # -- open and close ------------------------------------------------------------------------------
    def __enter__(self) -> "TurnLoop":
        session = self.session
        session.claim()
        self._has_lock = True
        try:
            if session.pending_commit is not None:
                session.settle_pending()
                if not self.is_whole_transcript:  # the new message, on the settled transcript
                    self.messages = session.messages + self.messages[-1:]
            self.target_ids = self.render(self.messages)
            self.source = session.draft_source(self.params.speculate)
            self.draft_length.max_draft = self.params.max_draft if self.source is not None else 0
            self._open()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _open(self) -> None:
        client, session = self.client, self.session
        self.info = info = client.server_info()
        self.wire = client.wire_dtype
        self.window = WindowPolicy(info.max_context, info.sink_tokens, info.page_size or 1, enabled=info.window)
        keep, drop = session.rewind(self.target_ids, info.sink_tokens)
        self.new_prompt = self.target_ids[keep:]
        self.result.truncated_tokens, self.result.prompt_tokens = drop, len(self.new_prompt)
        slack = self.draft_length.max_draft  # drafts occupy pages until they are verified
        self.stream, opened = open_turn(client, pb.OpenTurn(
            session_id=session.id, session_key=session.key, expected_version=session.version,
            bundle_fingerprint=client.bundle.server_fingerprint, turn_id=self.turn_id,
            reserve_tokens=len(self.new_prompt) + self.params.max_new_tokens + slack))
        if opened.cache_length != session.cache.length:
            raise Aborted(f"server holds {opened.cache_length} tokens for this session but the client holds "
                          f"{session.cache.length}; the session file is out of date")
        if drop:
            self._keep_committed()
            self.stream.call(pb.TurnRequest(truncate=pb.Truncate(tokens=drop, cache_length=session.cache.length)),
                             "truncated")
            session.cache.truncate(drop)

    def __exit__(self, exc_type, exc, tb) -> bool:
        session = self.session
        try:
            if self.stream is not None:
                self.stream.close()
            if self.is_commit_sent and not self.is_committed:  # the outcome is unknown until the server is asked
                self.result.version = session.version + 1
                session.pending_commit = PendingCommit.of_turn(
                    self.turn_id, session.version + 1, session.cache, self.fed, self._transcript(), self.result)
            if not self.is_committed:
                if self._committed is not None:  # committed positions were dropped or moved: the copy has them
                    session.cache = self._committed
                else:  # only positions past the committed ones were written
                    session.cache.rollback()
        finally:
            if self._has_lock:
                self._has_lock = False
                session.release()
        return False

    # -- the phases --------------------------------------------------------------------------------
    def prefill(self) -> torch.Tensor:
        """Send the prompt's new tokens; the logits [vocab] of the token after them."""
        self.started = time.perf_counter()
        chunk = max(1, min(self.info.max_step_tokens, self.window.max_step))
        for i in range(0, len(self.new_prompt), chunk):
            logits = self._step(self.new_prompt[i:i + chunk])
        self.fed = list(self.target_ids)
        self.result.round_trips += 1  # the step whose output is the first token
        return logits[-1]

    def generate(self) -> Iterator[str]:
        """Prefill, then decode until the answer ends; yields the answer's text as it becomes final."""
        r, eos = self.result, self.client.eos_ids
        text = TextStream(self.client.tokenizer, self.params.stop)
        new = [self.sampler(self.prefill(), self.fed)]  # tokens the last step produced, in order
        self.first_at = time.perf_counter()
        r.time_to_first_token = self.first_at - self.started
        anchor = len(self.fed)  # where the caches' copy of `new` (all but its last token) starts
        while True:
            for i, token in enumerate(new):  # emit, stopping where the answer ends
                if token in eos:
                    r.finish_reason = "eos"
                    break
                self.generated.append(token)
                delta = text.push(token)
                if delta:
                    yield delta
                if text.is_stopped:
                    r.finish_reason = "stop"
                elif len(self.generated) >= self.params.max_new_tokens:
                    r.finish_reason = "length"
                if r.finish_reason:
                    break
            self._keep_in_caches(anchor + (i if r.finish_reason else len(new) - 1))
            is_full = not self.window.enabled and self.session.cache.length + 1 > self.info.max_context
            if is_full and not r.finish_reason:
                r.finish_reason = "context"
            if r.finish_reason:
                break
            anchor, new = len(self.fed) + 1, self._decode_step(new[-1])
        delta = text.flush()
        if delta:
            yield delta
        r.text = text.text

    def _decode_step(self, last: int) -> list[int]:
        """Send `last` (sampled, not yet in the caches) plus drafts; the accepted drafts and the next token."""
        context = self.fed + [last]
        started = time.perf_counter()  # drafting counts as part of the step's cost (a draft model's is real)
        k = min(self.draft_length.choose(self.source.is_free), self._draft_room()) if self.source else 0
        drafts = self.source.propose(context, k)[:k] if k > 0 else []
        shadow = self.source.propose(context, 1) if self.source and k == 0 and self.source.is_free else []
        logits = self._step([last] + drafts, num_outputs=len(drafts) + 1)
        self.fed = context + drafts
        new = accept_drafts(self.sampler, logits, context, drafts)
        self.draft_length.step_time(len(drafts) + 1, time.perf_counter() - started)
        if drafts:
            self.draft_length.update(len(drafts), len(new) - 1)
        elif shadow:
            self.draft_length.shadow(shadow[0] == new[0])
        r = self.result
        r.round_trips += 1
        r.drafted_tokens += len(drafts)
        r.accepted_drafts += len(new) - 1
        return new

    def _draft_room(self) -> int:
        """Most drafts the next step may carry: within the answer's budget and the step limits, and never
        so many that the window would evict at a different step than decoding one token at a time
        (so greedy output stays the same with and without speculation)."""
        length, window, info = self.session.cache.length, self.window, self.info
        room = min(self.params.max_new_tokens - len(self.generated) - 1, info.max_step_tokens - 1,
                   window.max_step - 1)
        if window.enabled:
            room = min(room, info.max_context - (length - window.tokens_to_evict(length, 1)) - 1)
        else:
            room = min(room, info.max_context - length - 1)
        return max(room, 0)

    def _keep_in_caches(self, length: int) -> None:
        """Drop the caches' positions past `length` of `fed` (rejected drafts, or tokens after the end):
        here at once, on the server with the next message."""
        drop = len(self.fed) - length
        if drop > 0:
            self.session.cache.truncate(drop)
            self.fed = self.fed[:length]
            self._pending_drop += drop

    def _step(self, ids: list[int], num_outputs: int = 1) -> torch.Tensor:
        """Run `ids` through both halves; the logits [num_outputs, vocab] of the last positions."""
        cache, model, window = self.session.cache, self.model, self.window
        drop = self._flush_truncate()
        before = cache.length
        evict = window.tokens_to_evict(before, len(ids))
        if evict:
            self._keep_committed()
            apply_window(cache, window, len(ids), model.inv_freq)
            self.result.evicted_tokens += evict
        hidden = model.cloak(ids, cache).to(self.wire)
        self.stream.send(pb.TurnRequest(step=pb.Step(hidden=to_proto(hidden), cache_length=before, evict=evict,
                                                     outputs=num_outputs if num_outputs > 1 else 0)))
        if drop:
            self._check_truncated(self.stream.receive("truncated"), before)
        out = self.stream.receive("step")
        if out.cache_length != cache.length or out.evicted != evict:
            raise Aborted(f"server cache length {out.cache_length} (evicted {out.evicted}) != client's "
                          f"{cache.length} (evicted {evict})")
        residual = from_proto(out.hidden, model.hidden_size, num_outputs, "server residual")
        if residual.shape[0] != num_outputs:
            raise Aborted(f"server returned {residual.shape[0]} outputs for a step that asked for {num_outputs}")
        return model.logits(residual)

    def _flush_truncate(self) -> int:
        """Send the pending Truncate ahead of the next message (its reply is read after that message's)."""
        drop, self._pending_drop = self._pending_drop, 0
        if drop:
            self.stream.send(pb.TurnRequest(truncate=pb.Truncate(tokens=drop,
                                                                 cache_length=self.session.cache.length + drop)))
        return drop

    def _check_truncated(self, reply, expected: int) -> None:
        if reply.cache_length != expected:
            raise Aborted(f"server cache length {reply.cache_length} after dropping rejected drafts != client's "
                          f"{expected}")

    def commit(self) -> TurnResult:
        """Make the turn durable on both sides; the session moves to the new version."""
        r, session = self.result, self.session
        r.token_ids = list(self.generated)
        r.generated_tokens = len(self.generated)
        r.decode_seconds = time.perf_counter() - self.first_at
        r.cache_length = session.cache.length
        self.is_commit_sent = True
        drop = self._flush_truncate()
        self.stream.send(pb.TurnRequest(commit=pb.Commit()))
        if drop:
            self._check_truncated(self.stream.receive("truncated"), session.cache.length)
        done = self.stream.receive("committed")
        self.is_committed = True
        session.version = r.version = done.version
        session.cache.commit()
        session.history_ids = self.fed
        session.messages = self._transcript()
        session.last_result = r
        self._remember_answer()
        return r

    # -- helpers -------------------------------------------------------------------------------------
    def _transcript(self) -> list[dict]:
        if not self.messages:  # raw text: no chat to record
            return []
        return self.messages + [{"role": "assistant", "content": self.result.text}]

    def _keep_committed(self) -> None:
        """Before the turn first drops or moves committed positions (a truncation, an eviction): copy the
        committed cache, which a turn that does not commit restores."""
        if self._committed is None:
            cache = self.session.cache
            self._committed = committed_copy(cache, cache.committed_length)

    def _remember_answer(self) -> None:
        """Add the committed answer to the answer index. The turn has succeeded whatever the index does:
        a failure to remember is logged, never raised."""
        index = self.client.answer_index
        if index is None or not self.generated:
            return
        try:
            index.add(self.generated)
        except Exception as e:
            log.warning("the answer index could not keep this answer (%s: %s); the turn is committed",
                        type(e).__name__, e)
