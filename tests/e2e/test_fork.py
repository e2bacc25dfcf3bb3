"""A session forked on the pod (docs/design.md §7): the prefix is not uploaded again, the copy is sealed under the
new session's id and key, the source is left as it was, and the fork continues exactly as the original would.

The store's part runs on small in-memory caches; the rest against a real server with the default model in
float32, where "exactly" is checked by content: tokens, the client's caches and the server's decrypted caches.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import threading
from types import SimpleNamespace

import grpc
import pytest
import torch
from tests.conftest import REPO, StoredSession, start_server
from tests.support.http_endpoint import Uvicorn
from tests.storage.test_store import FP, LAYERS, Conversation, new_cache, stored_files

from infemeral.cli.chat_repl import ChatRepl
from infemeral.cli.commands import _fork_source, session_path
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.client.session import Session
from infemeral.client.settings import ClientSettings
from infemeral.client.stream import open_turn
from infemeral.endpoint.app import create_app
from infemeral.endpoint.session_pool import MIN_FORK_TOKENS, SessionPool
from infemeral.errors import (Aborted, AlreadyExists, DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound,
                              PermissionDenied, ResourceExhausted, StatusError, UsageError)
from infemeral.kvcache import stored
from infemeral.kvcache.prefix import common_prefix
from infemeral.protocol import pb
from infemeral.storage.open import open_store


# -- the store: a copy sealed under the new session ------------------------------------------------------
@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "store")
    yield s
    s.close()


def fork(source: Conversation, drop: int = 0, *, key: bytes | None = None, version: int | None = None,
         target: Conversation | None = None) -> Conversation:
    """Fork `source` through SessionPersistence as the server does (both locks held); the fork as a Conversation."""
    target = target or Conversation(source.store)
    source_lock, lock = source.p.lock(source.id), target.p.lock(target.id)
    try:
        keys = source.keys if key is None else stored.SessionKeys.derive(source.id, key)
        target.manifest = source.p.fork(source.id, keys, source.manifest.version if version is None else version,
                                        target.id, target.keys, drop, lock)
    finally:
        lock.release()
        source_lock.release()
    return target


def layers(cache) -> list[torch.Tensor]:
    return [t[..., :cache.length, :] for slot in range(cache.num_layers) for t in cache.layer_tensors(slot)]


@pytest.mark.parametrize("drop", [0, 9])
def test_a_fork_holds_the_sources_cache_under_its_own_id_and_key(store, drop):
    """Three chunks forked whole, or less the last 9 positions (into the second chunk): the fork loads the
    source's tensors, as version 1, in one chunk bound to its own id; the source's stored bytes are unchanged."""
    source = Conversation(store)
    for n in (5, 8, 6):
        source.turn(n)
    before = stored_files(store, source.id)
    copy = fork(source, drop)
    assert stored_files(store, source.id) == before
    assert copy.manifest.version == 1 and copy.manifest.length == 19 - drop
    assert [(r.start, r.end) for r in copy.manifest.chunks] == [(0, 19 - drop)]
    expected = source.cache.clone()
    expected.truncate(drop)
    loaded = copy.load()
    assert loaded.length == 19 - drop
    for got, want in zip(layers(loaded), layers(expected), strict=True):
        assert torch.equal(got, want)
    source.assert_loads_equal()
    # the fork's chunk read as the source's (its id in the associated data) fails
    chunk = store.read_chunk(copy.id, copy.manifest.chunks[0].name)
    with pytest.raises(Exception, match="failed authentication"):
        list(stored.decrypt_layers([(copy.manifest.chunks[0], chunk)], copy.manifest, source.keys))
    copy.cache = loaded  # and it goes on as a session of its own
    copy.turn(3)
    copy.assert_loads_equal()


def test_a_fork_is_refused_cleanly(store):
    """Wrong key, stale version, no source, nothing committed, a target that exists, too many positions dropped:
    each refused with its status, nothing written for the target and the source unchanged."""
    source = Conversation(store)
    source.turn(4)
    source.turn(2)
    before = stored_files(store, source.id)
    cases = [(PermissionDenied, "session key does not match", dict(key=os.urandom(32))),
             (Aborted, "stored session is at version 2 but the client expects version 1", dict(version=1)),
             (FailedPrecondition, "nothing committed", dict(version=0)),
             (InvalidArgument, "cannot leave 7 positions off a session that holds 6", dict(drop=7))]
    for error, message, options in cases:
        target = Conversation(store)
        with pytest.raises(error, match=message):
            fork(source, target=target, **options)
        assert store.read_manifest(target.id) is None and store.list_chunks(target.id) == []
    taken = Conversation(store)
    taken.turn(1)
    taken_before = stored_files(store, taken.id)
    with pytest.raises(AlreadyExists):
        fork(source, target=taken)
    assert stored_files(store, taken.id) == taken_before
    missing = Conversation(store)
    missing.manifest = source.manifest
    with pytest.raises(NotFound):
        fork(missing)
    assert stored_files(store, source.id) == before


# -- against a real server ----------------------------------------------------------------------------
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, speculate="off")
DOCUMENT = ("The lighthouse at Alexandria stood on the island of Pharos for more than a thousand years. Its keeper "
            "lit a fire at the top every night, and ships steered by it into the harbour. ") * 2


@pytest.fixture(scope="module")
def pod(bundles, tmp_path_factory):
    """A server with two API keys (two turn slots each) and a 256-token window; a client per key."""
    root = tmp_path_factory.mktemp("fork-store")
    srv = start_server(bundles, root, api_keys="key-a,key-b", max_sessions=4, max_context=256, sink_tokens=4,
                       page_size=16, verify_bundle=False)
    clients = [Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120, api_key=key)
               for key in ("key-a", "key-b")]
    yield srv, root, clients
    for c in clients:
        c.close()
    srv.stop(0)


def server_cache(srv, session) -> list[torch.Tensor]:
    """The server's cache of `session`, decrypted with its key: keys and values per layer."""
    persistence = srv.engine.persistence
    keys = stored.SessionKeys.derive(session.id, session.key)
    manifest = persistence.read_manifest(session.id, keys)
    chunks = [(ref, persistence.store.read_chunk(session.id, ref.name)) for ref in manifest.chunks]
    return [t.clone() for _, k, v in stored.decrypt_layers(chunks, manifest, keys) for t in (k, v)]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def assert_same_sessions(srv, a, b) -> None:
    """Same history, transcript, client cache and server cache, by content."""
    assert a.history_ids == b.history_ids and a.messages == b.messages
    assert_same(layers(a.cache), layers(b.cache))
    assert_same(server_cache(srv, a), server_cache(srv, b))


@pytest.mark.slow
def test_a_fork_continues_exactly_as_the_original_and_leaves_it_untouched(pod):
    srv, root, (client, _) = pod
    original, control = client.new_session(), client.new_session()
    for s in (original, control):
        s.chat(DOCUMENT + "Who lit the fire?", GREEDY)
    stored_before = StoredSession(root, original.id).read_bytes()
    copy = original.fork()
    assert StoredSession(root, original.id).read_bytes() == stored_before  # nothing of the source changed
    assert (copy.id, copy.key) != (original.id, original.key) and copy.version == 1
    assert_same_sessions(srv, copy, original)
    answers = [s.chat("Where did it stand?", GREEDY) for s in (original, copy, control)]
    assert answers[0].token_ids == answers[1].token_ids == answers[2].token_ids
    assert answers[1].prompt_tokens == answers[0].prompt_tokens  # the fork sent only the new message
    assert_same_sessions(srv, copy, original)
    assert_same_sessions(srv, original, control)


@pytest.mark.slow
def test_a_fork_at_a_turn_continues_as_a_session_that_only_had_those_turns(pod):
    srv, _, (client, _) = pod
    questions = ("Name a colour.", "Name a fruit.", "Name a city.")
    original, reference = client.new_session(system_prompt="Answer briefly."), client.new_session(
        system_prompt="Answer briefly.")
    for q in questions:
        original.chat(q, GREEDY)
    for q in questions[:2]:
        reference.chat(q, GREEDY)
    copy = original.fork(at_turn=2)
    assert copy.turn_ends == reference.turn_ends and len(copy.messages) == 5
    assert_same_sessions(srv, copy, reference)
    answers = [s.chat("Name an animal.", GREEDY) for s in (copy, reference)]
    assert answers[0].token_ids == answers[1].token_ids
    assert_same_sessions(srv, copy, reference)
    assert len(original.messages) == 7 and original.version == 3  # the original keeps its third turn


@pytest.mark.slow
def test_a_fork_is_refused_for_a_wrong_key_an_evicted_prefix_and_past_the_quota(pod, monkeypatch):
    srv, _, (a, b) = pod
    session = a.new_session()
    session.chat("Name a colour.", GREEDY)
    # the wrong key: what a turn with it gets
    request = dict(source_id=session.id, source_version=1, bundle_fingerprint=a.bundle.server_fingerprint,
                   session_id=os.urandom(16), session_key=os.urandom(32))
    with pytest.raises(PermissionDenied, match="session key does not match this session's stored state"):
        a.link.fork_session(pb.ForkSessionRequest(source_key=os.urandom(32), **request), timeout=30)
    with pytest.raises(Aborted, match="expects version"):
        a.link.fork_session(pb.ForkSessionRequest(source_key=session.key, **{**request, "source_version": 2}),
                            timeout=30)
    in_turn = session.stream("Name a fruit.", GREEDY)  # the source in a turn: refused, whatever the client holds
    next(in_turn)
    try:
        with pytest.raises(Aborted, match="the session to fork is in a turn"):
            a.link.fork_session(pb.ForkSessionRequest(source_key=session.key, **request), timeout=30)
    finally:
        in_turn.close()
    # past the window: the first turn's tokens were evicted, so a fork at it is refused; a whole fork is not
    long = session.chat(DOCUMENT * 3 + "Summarise.", SamplingParams(max_new_tokens=2, temperature=0.0))
    assert long.evicted_tokens > 0 or len(session.history_ids) > session.cache.length
    with pytest.raises(FailedPrecondition, match="prefix is gone"):
        session.fork(at_turn=1)
    assert session.fork().cache.length == session.cache.length
    # the quota: key a holds its two turn slots, so its fork is refused (at once, with a timeout shorter than the
    # retry hint); key b's is served
    other = b.new_session()
    other.chat("Name a fruit.", GREEDY)
    held = [a.new_session().stream("Tell me a long story.", SamplingParams(max_new_tokens=200)) for _ in range(2)]
    try:
        for h in held:
            next(h)
        with monkeypatch.context() as patch, pytest.raises(ResourceExhausted,
                                                           match="this API key has its limit of 2 turns"):
            patch.setattr(a, "timeout", 0.5)
            session.fork()
        assert other.fork().version == 1
    finally:
        for h in held:
            h.close()
    assert session.fork().version == 1  # the slots are back


ONE_TOKEN = SamplingParams(max_new_tokens=1, temperature=0.0, speculate="off")


def hold_turns(client, n: int) -> list:
    """`n` turn slots of `client`'s key, held by turns opened on new sessions that then send nothing."""
    return [open_turn(client, pb.OpenTurn(session_id=os.urandom(16), session_key=os.urandom(32),
                                          bundle_fingerprint=client.bundle.server_fingerprint, reserve_tokens=1))[0]
            for _ in range(n)]


def test_a_fork_at_the_pods_limits_is_asked_again_within_the_timeout(pod, monkeypatch):
    """Every turn slot taken (two per key, four in all): the fork is refused with a retry hint, asked again, and
    made once a slot frees; with a timeout shorter than the hint it fails at once with RESOURCE_EXHAUSTED, though
    a slot frees before the hint would have it asked again."""
    srv, _, (a, b) = pod
    session = a.new_session()
    session.chat("Name a colour.", ONE_TOKEN)
    held, frees = hold_turns(a, 2) + hold_turns(b, 2), []
    try:
        assert srv.engine.active_turns == 4
        frees.append(threading.Timer(0.3, held.pop(0).close))
        frees[-1].start()
        assert session.fork().version == 1
        held[:0] = hold_turns(a, 1)
        frees.append(threading.Timer(0.3, held.pop(0).close))
        frees[-1].start()
        monkeypatch.setattr(a, "timeout", 0.5)
        with pytest.raises(ResourceExhausted, match="this API key has its limit of 2 turns"):
            session.fork()
    finally:
        for timer in frees:
            timer.join()
        for stream in held:
            stream.close()


def test_a_fork_whose_reply_is_lost_is_deleted_and_the_source_unchanged(pod, monkeypatch, caplog):
    """The pod makes the fork but its reply never comes: the client deletes the new session it had named, says
    so in its log by the short id, and raises the error with what to do; the source's stored bytes are as they
    were."""
    _, root, (client, _) = pod
    session = client.new_session()
    session.chat("Name a colour.", ONE_TOKEN)
    stored_before = StoredSession(root, session.id).read_bytes()
    made, fork_session = [], client.link.fork_session

    def reply_lost(request, timeout):
        fork_session(request, timeout)
        made.append((request.session_id, request.session_key, StoredSession(root, request.session_id).exists()))
        raise DeadlineExceeded("Deadline Exceeded [DEADLINE_EXCEEDED]", grpc.StatusCode.DEADLINE_EXCEEDED)

    monkeypatch.setattr(client.link, "fork_session", reply_lost)
    with caplog.at_level(logging.WARNING, logger="infemeral.client.session"), pytest.raises(
            DeadlineExceeded, match="reply never came.*the session it made was deleted.*fork it again"):
        session.fork()
    ((fork_id, fork_key, was_made),) = made
    assert was_made and not (root / fork_id.hex()).exists()
    assert StoredSession(root, session.id).read_bytes() == stored_before and session.version == 1
    assert fork_id.hex()[:8] in caplog.text
    assert not any(secret.hex() in caplog.text for secret in (fork_id, fork_key, session.key))


# -- the command line: chat --from NAME -----------------------------------------------------------------
def test_chat_from_is_refused_before_anything_loads(tmp_path):
    settings = ClientSettings(sessions_dir=tmp_path, chat_history="")
    (tmp_path / "work.session").write_bytes(b"")
    (tmp_path / "taken.session").write_bytes(b"")

    def source(**given):
        args = argparse.Namespace(**{"from_session": "work", "session": None, "system": None, **given})
        return _fork_source(settings, args, session_path(settings, args.session) if args.session else None)

    assert source() == tmp_path / "work.session" and source(session="new") == tmp_path / "work.session"
    for given, message in ((dict(from_session="nothing"), "no saved session named 'nothing'"),
                           (dict(session="taken"), "pick a new name for --session"),
                           (dict(system="Be brief."), "drop --system")):
        with pytest.raises(UsageError, match=message):
            source(**given)


@pytest.mark.slow
def test_chat_from_continues_a_copy_and_leaves_the_saved_session(pod):
    srv, root, (client, _) = pod
    settings = ClientSettings(sessions_dir=root / "saved", chat_history="")
    saved = client.new_session()
    saved.chat(DOCUMENT + "Who lit the fire?", GREEDY)
    source = saved.save(settings.sessions_dir / "work.session")
    source_bytes, stored_bytes = source.read_bytes(), StoredSession(root, saved.id).read_bytes()
    copy_path = settings.sessions_dir / "q2.session"
    repl = ChatRepl(client, settings, session_name="q2", session_path=copy_path, fork_of=source,
                    stream=io.StringIO("Where did it stand?\n"), params=GREEDY)
    assert repl.run() == 0
    copy = Session.load(client, copy_path)
    assert copy.id != saved.id and copy.version == 2 and copy.messages[:2] == saved.messages
    assert copy.messages[2]["content"] == "Where did it stand?"
    assert copy.history_ids[:len(saved.history_ids)] == saved.history_ids
    assert source.read_bytes() == source_bytes and StoredSession(root, saved.id).read_bytes() == stored_bytes
    assert saved.chat("Where did it stand?", GREEDY).text == copy.messages[3]["content"]


# -- the OpenAI endpoint: a request that departs from a pooled conversation forks it ---------------------
QUESTION_A = "Tell me, in some detail, how the keeper spent each night and what he saw from the top. " * 8


@pytest.mark.slow
def test_an_edited_message_forks_the_pooled_conversation_instead_of_uploading_it(client, monkeypatch):
    """Conversation A asks a long question about a document; request B asks another about the same document
    (A's question edited): the pool forks A at the document instead of opening a session that uploads it again,
    B sends only its new tokens, and A is left as it was and continues where it stood."""
    import openai

    pool = SessionPool(client, max_sessions=4, min_fork_tokens=64)  # the document's 120 tokens: cheap on this CPU
    http = Uvicorn(create_app(pool, "fork-test", defaults=SamplingParams(max_new_tokens=4, temperature=0.0)))
    forks = []
    fork = pool.fork
    monkeypatch.setattr(pool, "fork", lambda *a, **kw: forks.append(fork(*a, **kw)) or forks[-1])
    try:
        api = openai.OpenAI(base_url=http.url, api_key="unused", max_retries=0)

        def ask(messages):
            return api.chat.completions.create(model="fork-test", messages=messages, max_tokens=4)

        a = [{"role": "user", "content": DOCUMENT + QUESTION_A}]
        a.append({"role": "assistant", "content": ask(a).choices[0].message.content})
        (original,) = pool._idle.values()
        history, version = list(original.history_ids), original.version
        b = [{"role": "user", "content": DOCUMENT + "Where did it stand?"}]
        assert ask(b).choices[0].message.content
        assert pool.stats.num_forked == 1 and pool.stats.num_opened == 1 and len(forks) == 1
        target = client.chat_ids(b)
        shared = common_prefix(history, target)
        assert shared >= 64 and forks[0].last_result.prompt_tokens == len(target) - shared
        assert original.history_ids == history and original.version == version  # A as it was
        ask(a + [{"role": "user", "content": "And then?"}])
        assert original.version == version + 1 and pool.stats.num_reused == 1  # A went on in its own session
    finally:
        http.stop()
        pool.close()


class PooledSession:
    """A committed session as the pool sees it; `fork` records its arguments (or raises `refuse`)."""

    def __init__(self, history, refuse: Exception | None = None):
        self.history_ids, self.version, self.pending_commit, self.refuse = list(history), 1, None, refuse
        self.forked_at: list[int] = []

    def fork(self, at_turn=None, *, keep_tokens=None):
        if self.refuse:
            raise self.refuse
        self.forked_at.append(keep_tokens)
        return PooledSession(self.history_ids[:keep_tokens])


class PoolClient:
    def __init__(self):
        self.opened = []

    def new_session(self):
        self.opened.append(PooledSession([]))
        self.opened[-1].version = 0
        return self.opened[-1]


def test_the_pool_forks_a_long_shared_prefix_it_would_otherwise_upload_again():
    document, tail = list(range(300)), [5000] * 400  # A keeps 300 tokens and would drop 400: not continued
    client = PoolClient()
    pool = SessionPool(client, max_sessions=4)
    a = PooledSession(document + tail)
    pool._idle[id(a)] = a
    got = pool.acquire(document + [7, 8])
    assert a.forked_at == [300] and got.history_ids == document and not client.opened
    assert pool.stats.num_forked == 1 and pool.num_busy == 1 and pool.acquire(document + tail + [1]) is a
    pool.release(a)
    # a short shared prefix is sent again, in a new session
    short = document[:MIN_FORK_TOKENS - 1] + [9] * 600
    assert pool.acquire(short) is client.opened[0] and a.forked_at == [300]
    # a refused fork (the window evicted the prefix) opens a new session too, and leaves A idle
    b = PooledSession(document + tail, refuse=FailedPrecondition("the window has evicted tokens of the prefix"))
    pool._idle = type(pool._idle)({id(b): b})
    assert pool.acquire(document + [7]) is client.opened[1] and pool.acquire(document + tail + [2]) is b


def test_a_pod_that_cannot_fork_is_not_asked_again():
    """An older pod answers a fork UNIMPLEMENTED: the request opens a session, and later ones do not try (the chat
    page's /v1/pod says so: `pod_forks`)."""
    document, tail = list(range(300)), [5000] * 400
    client = PoolClient()
    pool = SessionPool(client, max_sessions=4)
    a = PooledSession(document + tail, refuse=StatusError("the server at pod:1 is older than this client and cannot "
                                                          "fork sessions", grpc.StatusCode.UNIMPLEMENTED))
    pool._idle[id(a)] = a
    assert pool.pod_forks is None
    assert pool.acquire(document + [7]) is client.opened[0] and pool.pod_forks is False
    a.refuse = None
    assert pool.acquire(document + [8]) is client.opened[1] and a.forked_at == []


# -- the bench's row: a second conversation about the same document -----------------------------------------
def upload_section():
    sys.path.insert(0, str(REPO / "scripts"))
    from bench.sections import upload

    return upload


def test_the_fork_target_needs_the_whole_document_and_the_ratio():
    upload = upload_section()
    facts = [{"ratio_to_bf16": {}, "top1": {}, "fork": fork}
             for fork in ({"4100/20": 0.05}, {"4100/20": 0.2}, {"600/20": 0.05}, {})]
    lines = [next(t.line() for t in upload.targets(f) if " fork:" in t.line()) for f in facts]
    assert lines[0] == "TARGET upload fork: PASS (0.050x at 4100 tokens)"
    assert [line.split(": ")[1][:4] for line in lines[1:]] == ["MISS"] * 3


@pytest.mark.slow
def test_the_bench_forks_a_second_conversation_through_the_link(server, bundles, client):
    """measure_fork through the rate-limited proxy on a 700-token document: the second conversation starts in
    under half the first's time to first token (a second upload of the document would take about as long)."""
    upload = upload_section()
    text = DOCUMENT * 8
    split = SimpleNamespace(address=f"127.0.0.1:{server.port}", prompt_of_length=lambda n: (text, None))
    row = upload.measure_fork(SimpleNamespace(client_dir=bundles.client_dir), split, 0, 20)
    assert row.document_tokens >= len(client.chat_ids([{"role": "user", "content": text}]))
    assert 0 < row.fork_seconds and row.ratio < 0.5, row
    assert row.first_ttft_seconds >= row.document_tokens * client.model.hidden_size * 4 * 8 / 20e6  # the upload
