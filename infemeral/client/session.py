"""A chat session: a conversation whose KV cache lives in two places, moved on one turn at a time.

The client's local layers hold their part of the cache here; the server's
layers hold theirs encrypted in the server's store. Every turn (`TurnLoop`) is
one gRPC stream that sends only the turn's new tokens, as hidden states in the
secret basis, and ends with a commit: both caches move to the new version
together, or — if anything fails — both stay at the old one. The session
keeps the committed state; a turn tells it how the turn ended (`committed`,
`restore`, `keep_in_doubt`) rather than rewriting it.

    from infemeral import Client
    with Client("127.0.0.1:50051", "bundles/client") as client:
        chat = client.new_session()
        for delta in chat.stream("What is the capital of France?"):
            print(delta, end="", flush=True)
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from infemeral.client import session_file
from infemeral.client.pending import PendingCommit, committed_copy
from infemeral.client.result import TurnResult
from infemeral.client.sampling import SamplingParams
from infemeral.client.session_file import SavedSession
from infemeral.client.stream import open_turn
from infemeral.client.turn import TurnLoop
from infemeral.client.upload import ProgressCallback
from infemeral.errors import Aborted, FailedPrecondition, InfemeralError, NotFound, StatusError
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.prefix import common_prefix
from infemeral.protocol import pb
from infemeral.speculation.draft_length import DraftLength
from infemeral.speculation.source import DraftSource, per_session, session_sources

log = logging.getLogger(__name__)
# How a call ends when its request may have reached the server but its reply did not come back
REPLY_LOST = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})


class Session:
    """A conversation with committed state on both sides; not safe for concurrent use."""

    def __init__(self, client, *, system_prompt: str | None = None, session_id: bytes | None = None,
                 key: bytes | None = None):
        self.client = client
        self.id = session_id or secrets.token_bytes(16)
        self.key = key or secrets.token_bytes(32)
        self.version = 0
        self.history_ids: list[int] = []  # tokens in the committed caches, client-side only
        self.messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        # (tokens of history_ids, messages) as each committed turn still in the caches left them: where a fork
        # may cut (`fork(at_turn=)`)
        self.turn_ends: list[tuple[int, int]] = []
        self.cache = client.model.new_cache()
        self._busy = threading.Lock()
        self._forks: dict[str, tuple[object, DraftSource]] = {}  # this session's own forks of the client's draft
        # model and draft head, by kind: (what it was forked from, the fork)
        self.last_result: TurnResult | None = None
        # A turn whose commit was sent but never answered (connection lost), until the server says whether
        # it landed; the next turn settles it first.
        self.pending_commit: PendingCommit | None = None
        # how many drafts a step carries, per draft source, learnt as it goes; the link's cost is the client's
        self.draft_lengths: dict[str, DraftLength] = {}

    def __repr__(self) -> str:  # never print the key
        return f"Session(id={self.id.hex()[:8]}…, version={self.version}, tokens={len(self.history_ids)})"

    # -- chat ---------------------------------------------------------------------------------
    def chat(self, message: str, sampling: SamplingParams | None = None, *,
             on_progress: ProgressCallback | None = None) -> TurnResult:
        """Send a user message; return the full answer once generated.

        `on_progress`, here and in every call that answers, hears how far the prompt's upload has got (an
        `UploadProgress` as the pod answers each of its steps); an exception it raises cancels the turn, and
        the session stays as it was."""
        for _ in self.stream(message, sampling, on_progress=on_progress):
            pass
        return self.last_result

    def stream(self, message: str, sampling: SamplingParams | None = None, *,
               on_progress: ProgressCallback | None = None) -> Iterator[str]:
        """Send a user message; yield the answer's text as it is sampled."""
        return self._stream(self.messages + [{"role": "user", "content": message}], sampling or SamplingParams(),
                            on_progress=on_progress)

    def _stream(self, messages: list[dict], params: SamplingParams, **turn_options) -> Iterator[str]:
        with TurnLoop(self, messages, params, **turn_options) as turn:
            yield from turn.generate()
            turn.commit()

    def stream_messages(self, messages: list[dict], sampling: SamplingParams | None = None, *,
                        on_progress: ProgressCallback | None = None) -> Iterator[str]:
        """Answer the last message of a whole transcript; yield the answer's text as it is sampled.

        The caches keep what they share with the transcript and only the rest is sent, so a caller that
        resends a growing conversation every time (as OpenAI-style tools do) sends only its new tokens."""
        return self._stream([dict(m) for m in messages], sampling or SamplingParams(), is_whole_transcript=True,
                            on_progress=on_progress)

    # -- raw text -----------------------------------------------------------------------------
    def complete(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                 special_tokens: bool = False, on_progress: ProgressCallback | None = None) -> TurnResult:
        """Continue raw text (or token ids) without the chat template, for base models and template-free
        prompts; return the continuation once generated."""
        for _ in self.stream_raw(prompt, sampling, special_tokens=special_tokens, on_progress=on_progress):
            pass
        return self.last_result

    def stream_raw(self, prompt: str | list[int], sampling: SamplingParams | None = None, *,
                   special_tokens: bool = False, on_progress: ProgressCallback | None = None) -> Iterator[str]:
        """Continue raw text (or token ids); yield the continuation as it is sampled.

        `prompt` is the whole text: the session's caches keep what they share with it (a longer prompt
        that starts with an earlier prompt and its continuation sends only what is new). Raw turns leave
        `messages` empty: the history is text, not a chat. A text prompt is read as plain text, the
        spelling of a special token included, unless `special_tokens` is True (`Client.text_ids`)."""
        ids = (self.client.text_ids(prompt, special_tokens=special_tokens) if isinstance(prompt, str)
               else [int(i) for i in prompt])
        if not ids:
            raise InfemeralError("the prompt is empty: there is nothing to continue")
        return self._stream([], sampling or SamplingParams(), render=lambda _: ids, is_whole_transcript=True,
                            on_progress=on_progress)

    # -- what a turn uses -----------------------------------------------------------------------
    def claim(self) -> None:
        """Take the session for one turn; Aborted if a turn of it is running (one at a time)."""
        if not self._busy.acquire(blocking=False):
            raise Aborted("this session is already running a turn")

    def release(self) -> None:
        """The turn that claimed the session is over."""
        self._busy.release()

    def render(self, messages: list[dict]) -> list[int]:
        """A transcript as token ids, by the model's chat template."""
        return self.client.chat_ids(messages)

    def draft_sources(self, speculate: str) -> list[DraftSource]:
        """Where this session's drafts come from (`session_sources`), the draft model and draft head through this
        session's own forks of them."""
        client = self.client
        wanted = {"draft": speculate in ("draft", "auto"), "head": speculate in ("head", "auto")}
        forks = {kind: self._fork(kind, shared) if wanted[kind] and shared is not None else None
                 for kind, shared in (("draft", client.draft_model), ("head", client.draft_head))}
        return session_sources(speculate, client.answer_index, forks["draft"], forks["head"])

    def _fork(self, kind: str, shared) -> DraftSource:
        of, fork = self._forks.get(kind, (None, None))
        if of is not shared:
            fork = per_session(shared)
            self._forks[kind] = (shared, fork)
        return fork

    def settle_pending(self) -> None:
        """Ask the server whether the turn whose commit reply was lost did commit; adopt it if so."""
        pending = self.pending_commit
        stream, opened = open_turn(self.client, pb.OpenTurn(
            session_id=self.id, session_key=self.key, expected_version=self.version,
            bundle_fingerprint=self.client.bundle.server_fingerprint, turn_id=secrets.token_bytes(16),
            pending_turn_id=pending.turn_id, reserve_tokens=1))
        stream.close()  # no commit: the probe changes nothing
        if opened.pending_committed and opened.version == pending.version:
            self.cache = pending.cache
            self.committed(pending.version, pending.history_ids, pending.messages, pending.result)
        self.pending_commit = None

    def rewind(self, target_ids: list[int], sink_tokens: int) -> tuple[int, int]:
        """(tokens of the history a turn for `target_ids` keeps, cache positions it drops first).

        Normally the turn keeps the longest common prefix of the history and the new transcript and
        drops the cache's tail after it. But once the window has evicted tokens, the cache holds the
        sinks and the most recent tokens only: a rewind into what was evicted cannot be made by
        dropping a tail (it would cut into the sinks and leave the wrong tokens in their place), so the
        turn then drops the whole cache and sends the transcript again from the start."""
        keep = common_prefix(self.history_ids, target_ids)
        if keep == len(target_ids):  # always send at least one token to get logits
            keep -= 1
        if not self._tail_drops_to(keep, sink_tokens):
            return 0, self.cache.length
        return keep, len(self.history_ids) - keep

    def _tail_drops_to(self, keep: int, sink_tokens: int) -> bool:
        """Whether dropping the cache's tail leaves it holding the history's first `keep` tokens as they were:
        not once the window has evicted tokens at or after the sinks' end up to `keep` (the cache then holds
        the sinks and the most recent tokens only, moved to new positions)."""
        evicted = len(self.history_ids) - self.cache.length
        return evicted <= 0 or keep >= sink_tokens + evicted

    # -- how a turn ended ---------------------------------------------------------------------------
    def committed(self, version: int, history_ids: list[int], messages: list[dict], result: TurnResult) -> None:
        """A turn committed: both caches are at `version`, holding `history_ids`; `messages` is the transcript."""
        self.cache.commit()
        shared_tokens = common_prefix(self.history_ids, history_ids)
        shared_messages = common_prefix(self.messages, messages)
        self.turn_ends = [(tokens, count) for tokens, count in self.turn_ends
                          if tokens <= shared_tokens and count <= shared_messages]
        self.turn_ends.append((len(history_ids), len(messages)))
        self.version, self.history_ids, self.messages, self.last_result = version, history_ids, messages, result

    def keep_in_doubt(self, turn_id: bytes, history_ids: list[int], messages: list[dict],
                      result: TurnResult) -> None:
        """A turn sent its commit but never heard back: remember the state it leads to (a copy of the cache as
        it is now) for the next turn to settle (`settle_pending`)."""
        self.pending_commit = PendingCommit.of_turn(turn_id, self.version + 1, self.cache, history_ids, messages,
                                                    result)

    def restore(self, committed: KVCache | None) -> None:
        """A turn ended without committing: back to the committed cache — `committed`, a copy the turn took
        before it dropped or moved committed positions, or else this cache without what the turn added."""
        if committed is not None:
            self.cache = committed
        else:
            self.cache.rollback()

    # -- lifecycle ----------------------------------------------------------------------------
    def fork(self, at_turn: int | None = None, *, keep_tokens: int | None = None) -> "Session":
        """A new session (its own id and key) holding this one's committed conversation, made on the pod from
        the stored cache: nothing is uploaded again, so a second conversation about a long document starts at
        once. This session is left as it is.

        `at_turn`: keep only the first `at_turn` turns (1 = the first exchange), to edit or regenerate a later
        message: the fork continues exactly as a session that only ever had those turns. `keep_tokens` instead:
        keep the first `keep_tokens` tokens of `history_ids` (what a whole transcript shares with them, as the
        OpenAI endpoint finds it), and the messages of the turns they hold whole. Refused (FailedPrecondition)
        where the window has already evicted tokens of what would be kept, or while this session's last commit
        is unconfirmed (a turn settles it first). A fork takes a turn slot, so a pod at its limits is asked again
        within the client's timeout as a turn's open is; a fork whose reply is lost is deleted on the pod, best
        effort, before its error is raised."""
        self.claim()
        try:
            if self.pending_commit is not None:
                raise FailedPrecondition("this session's last commit is unconfirmed; run a turn (it asks the server "
                                         "first) before forking it")
            if not self.version:
                raise FailedPrecondition("this session has nothing committed to fork yet; fork it after its first "
                                         "turn")
            if at_turn is not None and keep_tokens is not None:
                raise InfemeralError("fork takes at_turn or keep_tokens, not both")
            keep_messages = len(self.messages)
            if at_turn is not None:
                if not 1 <= at_turn <= len(self.turn_ends):
                    raise InfemeralError(f"at_turn={at_turn}: this session holds turns 1 to {len(self.turn_ends)} "
                                         "(a session saved by an older version knows only the turns since)")
                keep_tokens, keep_messages = self.turn_ends[at_turn - 1]
            elif keep_tokens is None:
                keep_tokens = len(self.history_ids)
            elif not 1 <= keep_tokens <= len(self.history_ids):
                raise InfemeralError(f"keep_tokens={keep_tokens}: this session holds 1 to {len(self.history_ids)}")
            else:
                keep_messages = max([count for tokens, count in self.turn_ends if tokens <= keep_tokens], default=0)
            drop = len(self.history_ids) - keep_tokens
            if drop and not self._tail_drops_to(keep_tokens, self.client.server_info().sink_tokens):
                raise FailedPrecondition("the window has evicted tokens of what the fork would keep: that prefix is "
                                         "gone from the caches; start a new session with those messages instead")
            fork = Session(self.client)
            try:
                reply = self.client.link.fork_session(pb.ForkSessionRequest(
                    source_id=self.id, source_key=self.key, source_version=self.version,
                    bundle_fingerprint=self.client.bundle.server_fingerprint, session_id=fork.id,
                    session_key=fork.key, drop=drop), timeout=self.client.timeout)
            except StatusError as e:
                if e.code not in REPLY_LOST:
                    raise
                outcome = self._discard_fork(fork, "its reply was lost")
                raise type(e)(f"{e.message}: the fork's reply never came, so the server may have made it; {outcome}. "
                              "This session is unchanged: fork it again (a pod that needs longer asks for a "
                              "larger Client timeout)", e.code) from None
            length = self.cache.length - drop
            if reply.cache_length != length:
                outcome = self._discard_fork(fork, "it does not match the client's cache")
                raise Aborted(f"the server's fork holds {reply.cache_length} tokens but the client's {length}; "
                              f"the session file is out of date ({outcome})")
            fork.cache = committed_copy(self.cache, length)
            fork.version, fork.history_ids = reply.version, self.history_ids[:keep_tokens]
            fork.messages = [dict(m) for m in self.messages[:keep_messages]]
            fork.turn_ends = [end for end in self.turn_ends if end[0] <= keep_tokens and end[1] <= keep_messages]
            return fork
        finally:
            self.release()

    def _discard_fork(self, fork: "Session", why: str) -> str:
        """Delete, best effort, what the server may hold of a fork this session will not hand out (`why`), so that
        it does not wait there, sealed, for the store's TTL; what became of it, for a message. Safe whatever the
        server did: the fork's id is fresh (random, drawn for this fork) and was never given to anyone, so the
        delete can only remove what this fork made. Logs name the fork by its short id (`Session.__repr__`)."""
        try:
            self.client.link.delete_session(fork.id, fork.key)
            outcome = "the session it made was deleted"
        except NotFound:
            outcome = "it had made none"
        except Aborted:  # the server is still forking: what it makes expires with the store's TTL
            outcome = "it is still making it, and that session will expire on the server"
        except StatusError as e:
            outcome = f"deleting what it made failed ({e.code.name}), so that will expire on the server"
        log.warning("fork %r of %r discarded (%s): %s", fork, self, why, outcome)
        return outcome

    def delete(self) -> None:
        """Remove the session's stored state from the server."""
        self.client.link.delete_session(self.id, self.key)
        self.version = 0

    def save(self, path: str | Path) -> Path:
        """Write the session (id, key, version, transcript, local cache, and a turn whose commit is still
        unconfirmed) to an owner-only file."""
        saved = SavedSession(self.id, self.key, self.version, self.history_ids, self.messages, self.cache,
                             self.pending_commit, self.turn_ends)
        return session_file.save(path, saved, self.client.bundle.server_fingerprint)

    @classmethod
    def load(cls, client, path: str | Path) -> "Session":
        """A session saved by `save`; a turn it left unconfirmed is settled by the next turn."""
        saved = session_file.load(path, client.bundle.server_fingerprint, client.model.new_cache)
        session = cls(client, session_id=saved.id, key=saved.key)
        session.version, session.history_ids, session.messages = saved.version, saved.history_ids, saved.messages
        session.cache, session.pending_commit, session.turn_ends = saved.cache, saved.pending_commit, saved.turn_ends
        return session
