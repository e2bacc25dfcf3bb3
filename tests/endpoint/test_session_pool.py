"""The session pool's policy, without a model: which session a request gets, and which are deleted."""

from __future__ import annotations

import pytest

from infemeral.endpoint.answer import Answer
from infemeral.endpoint.session_pool import SessionPool
from infemeral.errors import NotFound, Unavailable


class FakeSession:
    def __init__(self, client, history=()):
        self.client, self.history_ids = client, list(history)
        self.version = 1 if history else 0
        self.pending_commit = None

    def delete(self):
        self.client.deleted.append(self)
        if self.client.fail_deletes:
            raise Unavailable("store down")
        self.version = 0


class FakeClient:
    def __init__(self):
        self.opened, self.deleted, self.fail_deletes = [], [], False

    def new_session(self):
        session = FakeSession(self)
        self.opened.append(session)
        return session


def finish(pool: SessionPool, session, history: list[int]) -> None:
    """What a committed turn leaves behind."""
    session.history_ids, session.version = list(history), session.version + 1
    pool.release(session)


def test_a_growing_conversation_continues_its_session():
    pool = SessionPool(FakeClient(), max_sessions=4)
    first = pool.acquire([1, 2, 3])
    finish(pool, first, [1, 2, 3, 10, 11])
    assert pool.acquire([1, 2, 3, 10, 11, 4, 5]) is first
    finish(pool, first, [1, 2, 3, 10, 11, 4, 5, 12])
    # a regenerated answer (same prompt again) keeps the prompt and drops only the old answer
    assert pool.acquire([1, 2, 3, 10, 11, 4, 5]) is first
    assert pool.stats.num_opened == 1 and pool.stats.num_reused == 2


def test_another_conversation_gets_its_own_session():
    client = FakeClient()
    pool = SessionPool(client, max_sessions=4)
    first = pool.acquire([1, 2, 3, 4, 5, 6])
    finish(pool, first, [1, 2, 3, 4, 5, 6, 7, 8])
    # shares the system prompt (2 tokens) only: reusing would throw away most of the first conversation
    other = pool.acquire([1, 2, 9, 9])
    assert other is not first and len(client.opened) == 2
    finish(pool, other, [1, 2, 9, 9, 5])
    assert pool.acquire([1, 2, 3, 4, 5, 6, 7, 8, 0]) is first
    assert pool.acquire([1, 2, 9, 9, 5, 0]) is other


def test_a_session_that_keeps_exactly_as_much_as_it_drops_is_reused():
    client = FakeClient()
    pool = SessionPool(client, max_sessions=4)
    first = pool.acquire([1, 2, 3, 4])
    finish(pool, first, [1, 2, 3, 4])
    assert pool.acquire([1, 2, 9, 9, 9]) is first  # keeps 2 tokens, drops 2
    finish(pool, first, [1, 2, 9, 9, 9])
    assert pool.acquire([1, 2, 3]) is not first and len(client.opened) == 2  # keeps 2, would drop 3


def test_a_busy_session_is_never_shared():
    pool = SessionPool(FakeClient(), max_sessions=4)
    first = pool.acquire([1, 2, 3])
    second = pool.acquire([1, 2, 3])
    assert second is not first
    finish(pool, first, [1, 2, 3, 4])
    finish(pool, second, [1, 2, 3, 5])
    assert pool.acquire([1, 2, 3, 5, 6]) is second


def test_least_recently_used_sessions_are_deleted_beyond_the_bound():
    client = FakeClient()
    pool = SessionPool(client, max_sessions=2)
    sessions = []
    for n in range(3):
        s = pool.acquire([n] * 4)
        finish(pool, s, [n] * 5)
        sessions.append(s)
    assert client.deleted == [sessions[0]] and pool.stats.num_evicted == 1 and pool.num_sessions == 2
    again = pool.acquire([1] * 5 + [7])  # touching session 1 makes session 2 the least recently used
    finish(pool, again, [1] * 6)
    s = pool.acquire([3] * 4)
    assert client.deleted == [sessions[0], sessions[2]]
    finish(pool, s, [3] * 5)
    pool.close()
    assert set(map(id, client.deleted)) == {id(x) for x in (sessions[0], sessions[2], sessions[1], s)}


def test_busy_sessions_are_not_evicted_and_failed_deletes_are_only_logged(caplog):
    client = FakeClient()
    client.fail_deletes = True
    pool = SessionPool(client, max_sessions=1)
    a, b = pool.acquire([1]), pool.acquire([2])  # over the bound while both run
    assert client.deleted == [] and pool.num_sessions == 2
    finish(pool, a, [1, 1])
    finish(pool, b, [2, 2])  # now a is idle and least recently used
    assert client.deleted == [a] and pool.num_sessions == 1
    assert "could not delete" in caplog.text and "UNAVAILABLE" in caplog.text


def test_a_never_committed_session_is_deleted_on_eviction_only_if_its_commit_is_in_doubt():
    """A first commit whose answer was lost may have been stored (the session is still at version 0, with the
    commit pending): evicting it deletes it, or it would sit on the server until its TTL; a session that never
    sent a commit holds nothing there."""
    client = FakeClient()
    pool = SessionPool(client, max_sessions=1)
    doubtful = pool.acquire([1, 2])
    doubtful.history_ids, doubtful.pending_commit = [1, 2], object()  # the commit went out, no answer came
    pool.release(doubtful)
    assert doubtful.version == 0
    fresh = pool.acquire([7, 7])  # another conversation: the doubtful session is the one evicted
    assert client.deleted == [doubtful] and pool.stats.num_evicted == 1
    fresh.history_ids = [7, 7]
    pool.release(fresh)
    pool.acquire([8, 8])  # evicts `fresh`: version 0, nothing pending
    assert client.deleted == [doubtful] and pool.stats.num_evicted == 2


def test_a_discarded_session_is_deleted_and_never_handed_out_again():
    client = FakeClient()
    pool = SessionPool(client, max_sessions=4)
    s = pool.acquire([1, 2])
    finish(pool, s, [1, 2, 3])
    s = pool.acquire([1, 2, 3, 4])
    pool.discard(s)
    assert client.deleted == [s] and pool.num_sessions == 0
    assert pool.acquire([1, 2, 3, 4]) is not s


def test_a_request_whose_session_is_gone_is_retried_on_a_new_session_not_another_pooled_one():
    """The server no longer holds the pooled session a request continues: the other idle sessions may be as
    stale (a TTL expires them all), so the retry opens a new session even where another would take the prompt
    (here one that keeps as much as it drops)."""
    client = FakeClient()
    pool = SessionPool(client, max_sessions=4)
    other, gone = pool.acquire([1, 2, 3, 4]), pool.acquire([1, 2, 5, 6])
    finish(pool, other, [1, 2, 3, 4])
    finish(pool, gone, [1, 2, 5, 6, 7])
    tried = []

    def start(session):
        tried.append(session)
        if session.version:  # every committed session has expired on the server
            raise NotFound("no stored state for this session [NOT_FOUND]")
        yield "hello"

    answer = Answer(pool, [1, 2, 5, 6, 7, 8], start)
    assert answer.first() == "hello"
    assert tried == [gone, client.opened[2]] and client.deleted == [gone]
    answer.close()
    assert pool.stats.num_discarded == 1 and pool.num_sessions == 2  # `other` is left for its own conversation


def test_the_bound_must_hold_a_session():
    with pytest.raises(ValueError):
        SessionPool(FakeClient(), max_sessions=0)
