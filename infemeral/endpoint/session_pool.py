"""Live sessions kept for stateless callers, keyed by the tokens their caches hold.

OpenAI-style tools send the whole conversation with every request. Opening a
fresh session for each would send the whole conversation again every time; a
pool keeps the sessions of recent requests alive and hands a request the idle
session whose history shares the longest prefix with it, so the SDK's
common-prefix rewind sends only the new tokens (and drops a tail that differs,
say a regenerated answer). A session is never reused for a different
conversation: if the best one would have to drop more of its history than it
keeps, the request gets a new session and the old one stays for its own
conversation — forked from it on the pod where they share at least
`min_fork_tokens` (an edited earlier message, a second question about the
same document), so the shared prefix is not uploaded again and the old
session stays as it was. One request at a time per session; concurrent requests get
different sessions, whose turns the server batches together. Beyond
`max_sessions` the least recently used idle sessions are deleted on the server
(best effort: one that cannot be deleted expires there after its TTL). Sessions
in use are never evicted, so the pool may hold more while many requests run.

A request may name a saved conversation (the chat page's, `conversations.py`):
its session is then that conversation's alone, reused whatever it drops (a
regenerated answer), loaded from its file when the pool holds none, and never
deleted on the server when it leaves the pool: its file keeps it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from infemeral.errors import Aborted, InfemeralError, StatusError
from infemeral.kvcache.prefix import common_prefix

log = logging.getLogger(__name__)

# A request sharing fewer tokens than this with every idle session sends them again instead of forking one: well
# past a chat template's system prompt, which every conversation shares.
MIN_FORK_TOKENS = 256


@dataclass
class PoolStats:
    """What the pool did, for tests and the endpoint's log (counts only)."""

    num_opened: int = 0    # requests that got a new session
    num_reused: int = 0    # requests that continued an idle session
    num_forked: int = 0    # requests that got a fork of an idle session (`fork`)
    num_evicted: int = 0   # sessions deleted to stay within the bound
    num_discarded: int = 0  # sessions dropped because their state went wrong


class SessionPool:
    def __init__(self, client, max_sessions: int = 8, min_fork_tokens: int = MIN_FORK_TOKENS):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.client = client
        self.max_sessions = max_sessions
        self.min_fork_tokens = min_fork_tokens
        self.stats = PoolStats()
        # Whether the pod forks sessions: None until a fork was tried (an older pod answers UNIMPLEMENTED; no
        # request then tries again).
        self.pod_forks: bool | None = None
        self._idle: OrderedDict[int, object] = OrderedDict()  # id(session) -> session, least recently used first
        self._busy: dict[int, object] = {}
        self._conversations: dict[int, str] = {}  # id(session) -> the saved conversation it belongs to
        self._lock = threading.Lock()

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._idle) + len(self._busy)

    @property
    def num_busy(self) -> int:
        with self._lock:
            return len(self._busy)

    def acquire(self, target_ids: list[int], conversation: str | None = None,
                resume: Callable[[], object | None] | None = None, *, fresh: bool = False):
        """A session for a request whose prompt is `target_ids`, reserved until `release` or `discard`.

        `conversation`: the saved conversation the request continues; its own session is the only one it
        takes, and `resume()` gives it (or None: a new one) when the pool holds none. `fresh`: a new session
        whatever the pool holds (a retry after the server refused a pooled session as gone: the other idle
        sessions may be as stale, all expired or an older copy of the store restored)."""
        if conversation is None and not fresh:
            forked = self._fork_for(target_ids)
            if forked is not None:
                return forked
        with self._lock:
            if fresh:
                session = None
            elif conversation is None:
                session = self._best_match(target_ids)
            else:
                session = self._of_conversation(conversation)
            if session is not None:
                del self._idle[id(session)]
                self.stats.num_reused += 1
            else:
                session = (resume() if resume else None) or self.client.new_session()
                self.stats.num_opened += 1
            if conversation is not None:
                self._conversations[id(session)] = conversation
            self._busy[id(session)] = session
            evicted = self._over_bound()
        self._delete(evicted)
        return session

    def fork(self, source, *, at_turn: int | None = None, keep_tokens: int | None = None,
             conversation: str | None = None):
        """A fork of the pool's idle session `source` (`Session.fork`), reserved like `acquire`'s answer (for the
        saved `conversation`, if given); `source` is held while the pod copies it, then idle again, as it was.
        Aborted if `source` is answering a request."""
        with self._lock:
            if id(source) not in self._idle:
                raise Aborted("that conversation is answering another request: stop that answer first")
            del self._idle[id(source)]
            self._busy[id(source)] = source
        try:
            forked = source.fork(at_turn, keep_tokens=keep_tokens)
        except StatusError as e:
            if e.code == grpc.StatusCode.UNIMPLEMENTED:
                self.pod_forks = False
            raise
        finally:
            self.release(source)
        with self._lock:
            self.pod_forks = True
            self.stats.num_forked += 1
            if conversation is not None:
                self._conversations[id(forked)] = conversation
            self._busy[id(forked)] = forked
            evicted = self._over_bound()
        self._delete(evicted)
        return forked

    def release(self, session) -> None:
        """Give a session back after its request, whatever the turn did: a turn that failed left the
        session at its last committed state, which the next request can continue."""
        with self._lock:
            if self._busy.pop(id(session), None) is None:
                return
            self._idle[id(session)] = session
            evicted = self._over_bound()
        self._delete(evicted)

    def discard(self, session) -> None:
        """Drop a session whose state went wrong (expired or refused on the server) instead of reusing it."""
        with self._lock:
            found = self._busy.pop(id(session), None) or self._idle.pop(id(session), None)
            if found is not None:
                self.stats.num_discarded += 1
        if found is not None:
            self._delete([session])

    def forget(self, conversation: str) -> None:
        """Drop a saved conversation's session from the pool, leaving what the server stores to its file (the
        caller deletes both); Aborted while it answers a request."""
        with self._lock:
            self._of_conversation(conversation)  # refuses a busy one
            for key, name in list(self._conversations.items()):
                if name == conversation:
                    self._idle.pop(key, None)
                    del self._conversations[key]

    def rename(self, conversation: str, new_name: str) -> None:
        """The saved conversation's session belongs to `new_name` from now on; Aborted while it answers."""
        with self._lock:
            self._of_conversation(conversation)
            for key, name in self._conversations.items():
                if name == conversation:
                    self._conversations[key] = new_name

    def close(self) -> None:
        """Delete every idle session on the server (the keys live only in this process)."""
        with self._lock:
            idle, self._idle = list(self._idle.values()), OrderedDict()
        self._delete(idle)

    # -- policy ---------------------------------------------------------------------------------------
    def _best_match(self, target_ids: list[int]):
        """The idle session sharing the longest prefix with the request, if it keeps at least as much of its
        history as it would drop; None means: open a new session."""
        best, best_keep = None, -1
        for key, session in self._idle.items():
            if key in self._conversations:
                continue  # a saved conversation's session serves that conversation only
            keep = common_prefix(session.history_ids, target_ids)
            if keep > best_keep:
                best, best_keep = session, keep
        if best is None or best_keep < len(best.history_ids) - best_keep:
            return None
        return best

    def _fork_for(self, target_ids: list[int]):
        """A fork of the idle session sharing the longest prefix with the request, where none may be continued
        as it is (`_best_match`) and that prefix is at least `min_fork_tokens`; None otherwise, or if the fork
        is refused (the window evicted that prefix, the pod is at its limits): the request then opens a session."""
        with self._lock:
            if self.pod_forks is False or self._best_match(target_ids) is not None:
                return None
            source, keep = None, self.min_fork_tokens - 1
            for key, session in self._idle.items():
                shared = common_prefix(session.history_ids, target_ids[:-1])  # a turn sends at least one token
                if key not in self._conversations and session.version and shared > keep:
                    source, keep = session, shared
        if source is None:
            return None
        try:
            return self.fork(source, keep_tokens=keep)
        except InfemeralError as e:
            code = getattr(getattr(e, "code", None), "name", type(e).__name__)
            log.info("could not fork the session sharing %d tokens with a request (%s); it opens a new one", keep,
                     code)
            return None

    def _of_conversation(self, conversation: str):
        """The idle session of a saved conversation, if the pool holds one (under the lock); Aborted if it is
        busy: two sessions for one conversation would leave one of them orphaned on the server."""
        for key, name in self._conversations.items():
            if name == conversation:
                if key in self._busy:
                    raise Aborted("this conversation is answering another request: stop that answer first")
                return self._idle.get(key)
        return None

    def _over_bound(self) -> list:
        """Take the least recently used idle sessions beyond the bound out of the pool (under the lock)."""
        evicted = []
        while self._idle and len(self._idle) + len(self._busy) > self.max_sessions:
            _, session = self._idle.popitem(last=False)
            evicted.append(session)
            self.stats.num_evicted += 1
        return evicted

    def _delete(self, sessions: list) -> None:
        for session in sessions:
            with self._lock:
                is_saved = self._conversations.pop(id(session), None) is not None
            if is_saved:
                continue  # a saved conversation's: its file keeps it, and deleting it is the user's call
            if not session.version and session.pending_commit is None:
                continue  # never committed: the server holds nothing
            try:
                session.delete()
            except InfemeralError as e:
                code = getattr(getattr(e, "code", None), "name", type(e).__name__)
                log.warning("could not delete a session left the pool (%s); it expires on the server after its TTL",
                            code)
