"""Live sessions kept for stateless callers, keyed by the tokens their caches hold.

OpenAI-style tools send the whole conversation with every request. Opening a
fresh session for each would send the whole conversation again every time; a
pool keeps the sessions of recent requests alive and hands a request the idle
session whose history shares the longest prefix with it, so the SDK's
common-prefix rewind sends only the new tokens (and drops a tail that differs,
say a regenerated answer). A session is never reused for a different
conversation: if the best one would have to drop more of its history than it
keeps, the request gets a new session and the old one stays for its own
conversation. One request at a time per session; concurrent requests get
different sessions, whose turns the server batches together. Beyond
`max_sessions` the least recently used idle sessions are deleted on the server
(best effort: one that cannot be deleted expires there after its TTL). Sessions
in use are never evicted, so the pool may hold more while many requests run.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from infemeral.errors import InfemeralError
from infemeral.kvcache.prefix import common_prefix

log = logging.getLogger(__name__)


@dataclass
class PoolStats:
    """What the pool did, for tests and the endpoint's log (counts only)."""

    num_opened: int = 0    # requests that got a new session
    num_reused: int = 0    # requests that continued an idle session
    num_evicted: int = 0   # sessions deleted to stay within the bound
    num_discarded: int = 0  # sessions dropped because their state went wrong


class SessionPool:
    def __init__(self, client, max_sessions: int = 8):
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.client = client
        self.max_sessions = max_sessions
        self.stats = PoolStats()
        self._idle: OrderedDict[int, object] = OrderedDict()  # id(session) -> session, least recently used first
        self._busy: dict[int, object] = {}
        self._lock = threading.Lock()

    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._idle) + len(self._busy)

    @property
    def num_busy(self) -> int:
        with self._lock:
            return len(self._busy)

    def acquire(self, target_ids: list[int]):
        """A session for a request whose prompt is `target_ids`, reserved until `release` or `discard`."""
        with self._lock:
            session = self._best_match(target_ids)
            if session is not None:
                del self._idle[id(session)]
                self.stats.num_reused += 1
            else:
                session = self.client.new_session()
                self.stats.num_opened += 1
            self._busy[id(session)] = session
            evicted = self._over_bound()
        self._delete(evicted)
        return session

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
        for session in self._idle.values():
            keep = common_prefix(session.history_ids, target_ids)
            if keep > best_keep:
                best, best_keep = session, keep
        if best is None or best_keep < len(best.history_ids) - best_keep:
            return None
        return best

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
            if not session.version and session.pending_commit is None:
                continue  # never committed: the server holds nothing
            try:
                session.delete()
            except InfemeralError as e:
                code = getattr(getattr(e, "code", None), "name", type(e).__name__)
                log.warning("could not delete a session left the pool (%s); it expires on the server after its TTL",
                            code)
