"""One turn of a session, in phases: open, rewind, prefill, decode (draft → verify → accept), commit.

A turn is one bidirectional gRPC stream (docs/design.md §4). `TurnLoop` is that
turn on the client, shared by everything that generates (the chat SDK, the
CLI, raw completion, the OpenAI endpoint):

    with TurnLoop(session, messages, params) as turn:   # open the stream, rewind the caches
        for delta in turn.generate():                   # prefill, then decode with speculation
            ...
        turn.commit()

Leaving the `with` block without a commit rolls both caches back (the server
drops an uncommitted turn by itself): the client's cache returns to exactly the
committed state, even when the turn dropped or the window evicted committed
positions (`TurnLink` copies the committed cache before it first rewrites it). A
commit whose reply was lost is kept as a `PendingCommit` for the next turn to
settle.

Decoding sends the last sampled token plus up to k drafted tokens per step and
asks for all their outputs (docs/design.md §9): one round trip verifies the drafts,
the longest agreeing prefix is kept (`accept_drafts`), and the rejected
positions are dropped from both caches. The `Speculator` chooses the drafts
and learns from each step; the stream, the caches and the window are `TurnLink`'.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator

import torch

from infemeral.client.turn_link import TurnLink
from infemeral.client.result import TurnResult
from infemeral.client.sampling import Sampler, SamplingParams
from infemeral.client.stream import open_turn
from infemeral.client.text import TextStream
from infemeral.client.upload import ProgressCallback
from infemeral.errors import Aborted
from infemeral.protocol import pb
from infemeral.speculation.acceptance import accept_drafts, accept_tree
from infemeral.speculation.speculator import Speculator

log = logging.getLogger(__name__)


class TurnLoop:
    """One turn of `session`: the new user message(s) in `messages`, answered under `params`.

    `messages` is the session's transcript plus the new message; with `is_whole_transcript` it is a whole
    transcript given by the caller (the OpenAI endpoint), kept as it is even when a lost commit is settled
    first. A raw turn has no messages: `render` gives its token ids, and it leaves the transcript empty.
    `on_progress` is called with an `UploadProgress` as the pod answers each of the prompt's steps; an exception
    it raises cancels the turn (nothing is committed)."""

    def __init__(self, session, messages: list[dict], params: SamplingParams,
                 render: Callable[[list[dict]], list[int]] | None = None, *, is_whole_transcript: bool = False,
                 on_progress: ProgressCallback | None = None):
        self.session, self.client = session, session.client
        self.on_progress = on_progress  # hears how far the prompt's upload has got
        self.messages, self.params = messages, params
        self.render = render or session.render
        self.is_whole_transcript = is_whole_transcript
        self.result = TurnResult()
        self.turn_id = secrets.token_bytes(16)
        self.sampler = Sampler(params)
        self.speculator: Speculator | None = None
        self.link: TurnLink | None = None  # once the stream is open
        self.generated: list[int] = []
        self.is_commit_sent = self.is_committed = False
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
            self.speculator = Speculator(session.draft_sources(self.params.speculate), session.draft_lengths,
                                         self.params.max_draft, self.client.step_cost, self.client.draft_history)
            self._open()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _open(self) -> None:
        """Open the stream and rewind both caches to what they share with the transcript."""
        client, session = self.client, self.session
        info = client.server_info()
        keep, drop = session.rewind(self.target_ids, info.sink_tokens)
        self.new_prompt = self.target_ids[keep:]
        self.result.truncated_tokens, self.result.prompt_tokens = drop, len(self.new_prompt)
        slack = self.speculator.max_draft  # drafts occupy pages until they are verified
        stream, opened = open_turn(client, pb.OpenTurn(
            session_id=session.id, session_key=session.key, expected_version=session.version,
            bundle_fingerprint=client.bundle.server_fingerprint, turn_id=self.turn_id,
            reserve_tokens=len(self.new_prompt) + self.params.max_new_tokens + slack))
        self.link = TurnLink(client.model, session.cache, self.target_ids[:keep], stream, info, client.wire)
        if opened.cache_length != session.cache.length:
            raise Aborted(f"server holds {opened.cache_length} tokens for this session but the client holds "
                          f"{session.cache.length}; the session file is out of date")
        if drop:
            self.link.truncate(drop)

    def __exit__(self, exc_type, exc, tb) -> bool:
        session, link = self.session, self.link
        try:
            if link is not None:
                link.close()
            if self.is_commit_sent and not self.is_committed:  # the outcome is unknown until the server is asked
                self.result.version = session.version + 1
                session.keep_in_doubt(self.turn_id, link.ids, self._transcript(), self.result)
            if not self.is_committed:
                session.restore(link.committed if link is not None else None)
        finally:
            if self._has_lock:
                self._has_lock = False
                session.release()
        return False

    # -- the phases --------------------------------------------------------------------------------
    def prefill(self) -> torch.Tensor:
        """Send the prompt's new tokens, in steps that go up without waiting for each other (`TurnLink.prefill`);
        the logits [vocab] of the token after them. A draft head also gets the features of the prompt's last
        positions (as many as it asks for)."""
        self.started = time.perf_counter()
        link = self.link
        logits = link.prefill(self.new_prompt, self.speculator.prompt_features, self.on_progress)
        self.speculator.observed(link.ids, link.features)
        self.result.round_trips += 1  # the step whose output is the first token
        return logits

    def generate(self) -> Iterator[str]:
        """Prefill, then decode until the answer ends; yields the answer's text as it becomes final."""
        r, link = self.result, self.link
        text = TextStream(self.client.tokenizer, self.params.stop)
        new = [self.sampler(self.prefill(), link.ids)]  # tokens the last step produced, in order
        self.first_at = time.perf_counter()
        r.time_to_first_token = self.first_at - self.started
        anchor = len(link.ids)  # where the caches' copy of `new` (all but its last token) starts
        while True:
            kept = yield from self._emit(new, text)
            link.keep(anchor + kept)
            if link.is_full and not r.finish_reason:
                r.finish_reason = "context"
            if r.finish_reason:
                break
            anchor, new = len(link.ids) + 1, self.decode_step(new[-1])
        delta = text.flush()
        if delta:
            yield delta
        r.text = text.text

    def _emit(self, new: list[int], text: TextStream) -> Iterator[str]:
        """Yield the text of a step's tokens, stopping where the answer ends (its finish reason is set then);
        return how many of them the caches keep: those before the last one shown, which is never in them."""
        r = self.result
        for i, token in enumerate(new):
            if token in self.client.eos_ids:
                r.finish_reason = "eos"
                return i
            self.generated.append(token)
            delta = text.push(token)
            if delta:
                yield delta
            if text.is_stopped:
                r.finish_reason = "stop"
            elif len(self.generated) >= self.params.max_new_tokens:
                r.finish_reason = "length"
            if r.finish_reason:
                return i
        return len(new) - 1

    def decode_step(self, last: int) -> list[int]:
        """Send `last` (sampled, not yet in the caches) plus drafts; the accepted drafts and the next token."""
        context = self.link.ids + [last]
        budget = self.params.max_new_tokens - len(self.generated) - 1  # drafts past the answer's end are waste
        link = self.link
        proposal = self.speculator.propose(context, max(min(budget, link.draft_room()), 0),
                                           trees=link.draft_trees and self.params.draft_trees)
        if proposal.parents is None:
            logits = link.step([last] + proposal.drafts, num_outputs=len(proposal.drafts) + 1)
            new = accept_drafts(self.sampler, logits, context, proposal.drafts)
            features = link.features[:len(new)]
        else:  # a draft tree: the accepted path is kept in both caches, every other row dropped
            logits = link.step([last] + proposal.drafts, num_outputs=len(proposal.drafts) + 1,
                               parents=proposal.parents)
            new, rows = accept_tree(self.sampler, logits, context, [last] + proposal.drafts, proposal.parents)
            features = link.features[rows]
            link.keep_path(rows)
        self.speculator.verified(proposal, new)
        self.speculator.observed(context + new[:-1], features)  # the verified positions
        self.result.add_step(len(proposal.drafts), len(new) - 1)
        return new

    def commit(self) -> TurnResult:
        """Make the turn durable on both sides; the session moves to the new version."""
        r, link = self.result, self.link
        r.token_ids = list(self.generated)
        r.generated_tokens = len(self.generated)
        r.decode_seconds = time.perf_counter() - self.first_at
        r.cache_length = link.cache.length
        r.evicted_tokens = link.num_evicted
        self.is_commit_sent = True
        r.version = link.commit()
        self.is_committed = True
        self.session.committed(r.version, link.ids, self._transcript(), r)
        self._remember_answer()
        return r

    # -- helpers -------------------------------------------------------------------------------------
    def _transcript(self) -> list[dict]:
        if not self.messages:  # raw text: no chat to record
            return []
        return self.messages + [{"role": "assistant", "content": self.result.text}]

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
