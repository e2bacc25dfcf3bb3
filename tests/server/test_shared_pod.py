"""A shared pod faces misbehaving clients and a flaky store (docs/design.md §11), and keeps serving.

Against real servers with the default model:
- 100 streams that send nothing leave health checks, server info, a normal turn and a delete prompt;
- past --max-streams or --max-sessions a new turn is refused at once (RESOURCE_EXHAUSTED, retry hint);
- a turn that goes quiet is aborted after --turn-idle-seconds (DEADLINE_EXCEEDED) and gives back its
  session, its slot and every page; one kept open past --max-turn-seconds likewise; a slow client and a
  reader that pauses between streamed pieces keep their turns (the SDK's keep-alives);
- a store whose lock release fails, and a real Redis killed and restarted: the next turn works without a
  server restart and the stored session is intact;
- a step whose activations overflow is refused, nothing is stored, and the server serves on — also when
  they overflow only in the dtype the answer is sent back in (float16 from a float32 server);
- eight turns that declare no reserve_tokens do not take the KV pool from a normal generate;
- with several API keys one key cannot take every turn slot, stream or the pool: past its share it is
  refused at once with a retry hint while another key is served;
- an address (or the metrics port) that cannot be bound whole stops the server with one line and exit
  code 2 before the model loads.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
import redis
import torch
from tests.support.faults import wait_until
from tests.conftest import StoredSession, free_port, start_server
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.errors import DeadlineExceeded, StatusError
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import to_proto

pytestmark = pytest.mark.slow

ONE = SamplingParams(max_new_tokens=1)
SHORT = SamplingParams(max_new_tokens=3)
TWO = SamplingParams(max_new_tokens=2)
IDLE, MAX_TURN = 1.0, 6.0  # the impatient pod's deadlines


# -- helpers ----------------------------------------------------------------------------------------
class RawTurn:
    """One Turn stream driven message by message, as a careless or hostile client would."""

    def __init__(self, channel: grpc.Channel, timeout: float = 120):
        self.requests: queue.Queue = queue.Queue()
        self.call = pb_grpc.InfemeralStub(channel).Turn(iter(self.requests.get, None), timeout=timeout)

    def send(self, request: pb.TurnRequest) -> None:
        self.requests.put(request)

    def receive(self) -> pb.TurnResponse:
        return next(self.call)

    def open(self, session_id: bytes, key: bytes, fingerprint: str, version: int = 0, reserve: int = 16):
        self.send(pb.TurnRequest(open=pb.OpenTurn(session_id=session_id, session_key=key, expected_version=version,
                                                  bundle_fingerprint=fingerprint, reserve_tokens=reserve)))
        return self.receive().opened

    def error(self) -> grpc.RpcError:
        """Read until the server ends the call with an error; that error."""
        with pytest.raises(grpc.RpcError) as info:
            while True:
                self.receive()
        return info.value

    def cancel(self) -> None:
        self.call.cancel()


def retry_after_ms(err: grpc.RpcError) -> int:
    return int(dict(err.trailing_metadata() or ()).get("retry-after-ms", 0))


def timed(fn):
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def pool_is_whole(srv) -> bool:
    pool = srv.engine.pool
    return pool.free_pages == pool.num_pages and pool.promised_pages == 0


def new_ids() -> tuple[bytes, bytes]:
    return os.urandom(16), os.urandom(32)


@pytest.fixture(scope="module")
def small_pod(bundles, tmp_path_factory):
    """bfloat16 (its range overflows where float32 does not), two turn slots, four streams."""
    srv = start_server(bundles, tmp_path_factory.mktemp("small-store"), dtype="bfloat16", max_sessions=2,
                       max_streams=4, verify_bundle=False)
    c = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120)
    yield srv, c
    c.close()
    srv.stop(0)


@pytest.fixture(scope="module")
def impatient_pod(bundles, tmp_path_factory):
    """Short turn deadlines and a 2,048-token KV pool that one greedy turn can fill."""
    srv = start_server(bundles, tmp_path_factory.mktemp("impatient-store"), turn_idle_seconds=IDLE,
                       max_turn_seconds=MAX_TURN, kv_pool_tokens=2048, max_context=2048, admission_wait=0,
                       verify_bundle=False)
    c = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120)
    yield srv, c
    c.close()
    srv.stop(0)


# -- streams cost no thread; limits answer at once ----------------------------------------------------
def test_silent_streams_leave_health_info_turns_and_deletes_prompt(server, client):
    """(Old server: 32 worker threads, so these calls hung until the silent streams were cancelled.)"""
    client.new_session().chat("Hi!", ONE)  # warm: the first turn of a process pays for lazy set-up
    _, alone = timed(lambda: client.new_session().chat("Hi!", ONE))  # the same turn with nothing else open
    silent_channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    silent = [RawTurn(silent_channel) for _ in range(100)]
    try:
        assert wait_until(lambda: server.service.num_streams >= 100), server.service.num_streams
        health = health_pb2_grpc.HealthStub(client.channel)
        status, seconds = timed(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status)
        assert status == health_pb2.HealthCheckResponse.SERVING and seconds < 1, seconds
        info, seconds = timed(lambda: client.server_info(refresh=True))
        assert info.turn_idle_seconds == 30 and seconds < 1, seconds
        session = client.new_session()
        result, seconds = timed(lambda: session.chat("Hi!", ONE))
        assert result.version == 1 and seconds < alone + 1, (seconds, alone)  # within a second of its own time
        _, seconds = timed(session.delete)
        assert seconds < 1, seconds
        assert server.service.num_streams >= 100  # all of them were still open meanwhile
    finally:
        for s in silent:
            s.cancel()
        silent_channel.close()
    assert wait_until(lambda: server.service.num_streams == 0)


def test_limits_refuse_at_once_with_a_retry_hint(small_pod, bundles):
    srv, c = small_pod
    fp = c.bundle.server_fingerprint
    held = [RawTurn(c.channel) for _ in range(2)]
    try:
        for turn in held:
            assert turn.open(*new_ids(), fp).version == 0
        third = RawTurn(c.channel)
        third.send(pb.TurnRequest(open=pb.OpenTurn(session_id=os.urandom(16), session_key=os.urandom(32),
                                                   bundle_fingerprint=fp, reserve_tokens=16)))
        err, seconds = timed(third.error)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 2 turns" in err.details()
        assert seconds < 1 and retry_after_ms(err) > 0, (seconds, err.trailing_metadata())
        assert wait_until(lambda: srv.service.num_streams == 2)
        held += [RawTurn(c.channel) for _ in range(2)]  # two streams that never open a turn
        assert wait_until(lambda: srv.service.num_streams == 4)
        err, seconds = timed(RawTurn(c.channel).error)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 4 turn streams" in err.details()
        assert seconds < 1 and retry_after_ms(err) > 0, (seconds, err.trailing_metadata())
        with Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=2) as impatient:
            with pytest.raises(StatusError) as info:  # the SDK retries within its timeout, then reports it
                impatient.new_session().chat("Hello?", ONE)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for turn in held:
            turn.cancel()
    assert wait_until(lambda: srv.service.num_streams == 0 and srv.engine.active_turns == 0)
    assert c.new_session().chat("Hello?", ONE).version == 1


# -- turns that go quiet, turns that last too long, clients that are merely slow ------------------------
def test_idle_turn_is_aborted_and_frees_its_session_and_pages(impatient_pod, bundles, tmp_path):
    srv, c = impatient_pod
    fp = c.bundle.server_fingerprint
    session = c.new_session()
    session.chat("Hello there.", SHORT)
    path = StoredSession(srv.settings.store, session.id)
    blob = path.read_bytes()
    session_file = session.save(tmp_path / "chat.session")

    # A turn of that session takes (nearly) the whole pool, steps once, and goes quiet.
    hog = RawTurn(c.channel)
    opened = hog.open(session.id, session.key, fp, version=1, reserve=2000)
    hog.send(pb.TurnRequest(step=pb.Step(hidden=to_proto(torch.randn(64, c.model.hidden_size)),
                                         cache_length=opened.cache_length)))
    hog.receive()
    quiet_since = time.monotonic()
    other = RawTurn(c.channel)
    other.send(pb.TurnRequest(open=pb.OpenTurn(session_id=os.urandom(16), session_key=os.urandom(32),
                                               bundle_fingerprint=fp, reserve_tokens=512)))
    err = other.error()
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "pool is full" in err.details()

    err = hog.error()
    quiet_for = time.monotonic() - quiet_since
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
    assert "sent nothing for 1 s" in err.details() and "nothing was committed" in err.details()
    assert IDLE <= quiet_for < IDLE + 5, quiet_for
    # Everything is back: the slot, every page, and the stored session untouched...
    assert srv.engine.active_turns == 0
    assert pool_is_whole(srv)
    assert path.read_bytes() == blob
    # ...and another client opens the session at once, and carries on from the committed state.
    with Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120) as second:
        opened, seconds = timed(lambda: RawTurn(second.channel).open(session.id, session.key, fp, version=1))
        assert opened.version == 1 and seconds < 1, seconds
        resumed = second.load_session(session_file)
        assert wait_until(lambda: srv.engine.active_turns == 0)  # the probe above ended without a commit
        assert resumed.chat("And then?", SHORT).version == 2
    assert path.read_bytes() != blob and pool_is_whole(srv)


def test_turn_past_max_turn_seconds_is_aborted_even_if_kept_alive(impatient_pod):
    srv, c = impatient_pod
    turn = RawTurn(c.channel)
    turn.open(*new_ids(), c.bundle.server_fingerprint)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        while time.monotonic() - started < MAX_TURN + 10:
            turn.send(pb.TurnRequest(keepalive=pb.KeepAlive()))
            time.sleep(IDLE / 4)
            if turn.call.done():
                turn.receive()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert f"limit of {MAX_TURN:g} s" in info.value.details()
    assert time.monotonic() - started < MAX_TURN + 3
    assert wait_until(lambda: srv.engine.active_turns == 0) and pool_is_whole(srv)


def test_slow_client_and_paused_reader_keep_their_turn(impatient_pod, bundles, monkeypatch):
    srv, _ = impatient_pod
    with Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120) as slow:
        cloak = slow.model.cloak

        def slow_cloak(*args, **kwargs):  # a laptop that needs longer than the idle bound for its layers
            time.sleep(IDLE * 1.3)
            return cloak(*args, **kwargs)

        monkeypatch.setattr(slow.model, "cloak", slow_cloak)
        session = slow.new_session()
        assert session.chat("Name a colour.", TWO).version == 1
        monkeypatch.setattr(slow.model, "cloak", cloak)
        for _ in session.stream("Another one?", TWO):
            time.sleep(IDLE * 1.3)  # a reader that pauses between the pieces of the answer
        assert session.version == 2
        # Without its keep-alives the same slow client trips the idle bound.
        monkeypatch.setattr(slow.model, "cloak", slow_cloak)
        monkeypatch.setattr("infemeral.client.keepalive.KeepAlive.sent", lambda self: None)
        monkeypatch.setattr("infemeral.client.keepalive.KeepAlive._run", lambda self: None)
        with pytest.raises(DeadlineExceeded, match="sent nothing for 1 s"):
            session.chat("And a third?", TWO)
        assert session.version == 2
    assert wait_until(lambda: srv.engine.active_turns == 0) and pool_is_whole(srv)


# -- a flaky store -----------------------------------------------------------------------------------
class FlakyStore:
    """The server's real store, except that while `is_down` its writes and lock releases fail the way a
    Redis that went away fails (the lock stays held, as it would in Redis until its lease runs out)."""

    def __init__(self, store):
        self.store, self.is_down = store, False

    def __getattr__(self, name):
        return getattr(self.store, name)

    def _check(self) -> None:
        if self.is_down:
            raise ConnectionError("store went away")

    def lock(self, session_id, lease_seconds=60.0):
        return FlakyLock(self, self.store.lock(session_id, lease_seconds))

    def write_chunk(self, *args):
        self._check()
        return self.store.write_chunk(*args)

    def commit_manifest(self, *args):
        self._check()
        return self.store.commit_manifest(*args)

    def delete_session(self, *args):
        self._check()
        return self.store.delete_session(*args)


class FlakyLock:
    def __init__(self, flaky: FlakyStore, lock):
        self.flaky, self.lock, self.token = flaky, lock, lock.token

    def refresh(self):
        self.flaky._check()
        self.lock.refresh()

    def release(self):
        self.flaky._check()
        self.lock.release()


def committed_over_a_flaky_store(pod, monkeypatch):
    """The pod's store made flaky (up for now) and a session committed through it: (server, the flaky store, the
    session, its stored file, that file's bytes)."""
    srv, c = pod
    flaky = FlakyStore(srv.engine.store)
    monkeypatch.setattr(srv.engine, "store", flaky)
    monkeypatch.setattr(srv.engine.persistence, "store", flaky)
    session = c.new_session()
    session.chat("Hello there.", SHORT)
    path = StoredSession(srv.settings.store, session.id)
    return srv, flaky, session, path, path.read_bytes()


def test_failed_lock_release_leaves_nothing_stuck(impatient_pod, monkeypatch):
    srv, flaky, session, path, blob = committed_over_a_flaky_store(impatient_pod, monkeypatch)

    stream = session.stream("Tell me about the sea.", SHORT)
    next(stream)
    flaky.is_down = True  # the store goes away mid-turn: the commit fails, and so does the lock release
    with pytest.raises(StatusError) as info:
        list(stream)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
    assert session.version == 1 and path.read_bytes() == blob
    assert srv.engine.active_turns == 0 and pool_is_whole(srv)  # slot and pages freed all the same
    assert srv.engine.sessions.unreleased_locks  # the store still holds the session's lock (a lease, in Redis)
    with pytest.raises(StatusError) as info:  # while the store is down, a clear UNAVAILABLE, nothing stuck
        session.chat("Anyone there?", SHORT)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value

    flaky.is_down = False  # the store is back: no server restart, no waiting for a lease to run out
    assert session.chat("Still there?", SHORT).version == 2
    assert not srv.engine.sessions.unreleased_locks and path.read_bytes() != blob
    session.delete()
    assert not path.exists() and pool_is_whole(srv)


def test_delete_and_fork_while_the_store_is_down_answer_unavailable_and_lose_nothing(impatient_pod, monkeypatch):
    """Calls outside a turn map a store that went away as a turn does: UNAVAILABLE with a hint to retry, the
    committed session as it was, and both calls work once the store is back."""
    srv, flaky, session, path, blob = committed_over_a_flaky_store(impatient_pod, monkeypatch)

    flaky.is_down = True
    for call in (session.delete, session.fork):
        with pytest.raises(StatusError) as info:
            call()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        assert "session store is unavailable; retry" in str(info.value)
    assert path.read_bytes() == blob and srv.engine.active_turns == 0 and pool_is_whole(srv)

    flaky.is_down = False
    fork = session.fork()
    assert fork.chat("And then?", SHORT).version == 2 and session.version == 1
    for s in (fork, session):
        s.delete()
    assert not path.exists() and pool_is_whole(srv)


class RedisProcess:
    """A redis-server of our own on a fixed port, appending every write to disk, so it can be killed and
    brought back with its data (as a production Redis with AOF would be)."""

    def __init__(self, directory: Path):
        self.directory, self.port = directory, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                                      "--dir", str(self.directory)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = redis.Redis.from_url(self.url)
        assert wait_until(lambda: _pings(r), 20), "redis-server did not start"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def session_bytes(self, session_id: bytes) -> dict[bytes, bytes]:
        """Manifest and chunks of one session, read straight from Redis."""
        r = redis.Redis.from_url(self.url)
        keys = [k for k in r.keys(f"infemeral:{session_id.hex()}:*") if not k.endswith((b":lock", b":chunks"))]
        return {k: r.get(k) for k in sorted(keys)}


def _pings(r) -> bool:
    try:
        return r.ping()
    except redis.exceptions.ConnectionError:
        return False


def test_redis_killed_mid_turn_and_restarted(bundles, tmp_path):
    store = RedisProcess(tmp_path)
    store.start()
    srv = start_server(bundles, store.url, verify_bundle=False)
    c = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120)
    try:
        session = c.new_session()
        session.chat("Hello there.", SHORT)
        stored = store.session_bytes(session.id)
        assert len(stored) >= 2

        stream = session.stream("Tell me about the sea.", SHORT)
        next(stream)
        store.kill()  # mid-turn: its commit is the first thing to find the store gone
        with pytest.raises(StatusError) as info:
            list(stream)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        assert session.version == 1
        assert srv.engine.active_turns == 0 and pool_is_whole(srv)
        with pytest.raises(StatusError) as info:
            session.chat("Anyone there?", SHORT)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value

        store.start()  # back on the same port, with its data (and the dead turn's lock, 60 s lease)
        assert store.session_bytes(session.id) == stored  # the session is intact
        result, seconds = timed(lambda: session.chat("Still there?", SHORT))
        assert result.version == 2
        assert seconds < 30, "the next turn waited for the dead turn's lease instead of releasing it"
        other = c.new_session()
        other.chat("Hi!", ONE)
        other.delete()
        session.delete()
        assert store.session_bytes(session.id) == {}
    finally:
        c.close()
        srv.stop(0)
        if store.proc.poll() is None:
            store.proc.terminate()
            store.proc.wait(timeout=10)


# -- activations that overflow --------------------------------------------------------------------------
def test_overflowing_step_is_refused_and_changes_nothing(small_pod):
    srv, c = small_pod
    session = c.new_session()
    session.chat("Hello there.", SHORT)
    path = StoredSession(srv.settings.store, session.id)
    blob = path.read_bytes()
    for huge in (torch.full((4, c.model.hidden_size), 3.4e38),  # finite in float32, past bfloat16's range
                 torch.cat([torch.randn(3, c.model.hidden_size), torch.full((1, c.model.hidden_size), -3.4e38)])):
        turn = RawTurn(c.channel)
        opened = turn.open(session.id, session.key, c.bundle.server_fingerprint, version=1)
        turn.send(pb.TurnRequest(step=pb.Step(hidden=to_proto(huge), cache_length=opened.cache_length)))
        turn.send(pb.TurnRequest(commit=pb.Commit()))
        err = turn.error()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "overflowed to inf/NaN in the server's bfloat16" in err.details()
        assert "nothing was committed" in err.details()
        assert path.read_bytes() == blob
        assert wait_until(lambda: srv.engine.active_turns == 0) and pool_is_whole(srv)
    assert session.chat("Still fine?", SHORT).version == 2  # the session, and the server, carry on
    assert c.new_session().chat("Hi!", ONE).version == 1


def test_answer_past_the_wire_dtype_is_refused_and_changes_nothing(server, client):
    """float16 hidden states of 65504 to a float32 server: the layers' float32 answer is finite, but past
    float16's range (old code: it went back as +Inf, and the turn committed)."""
    session = client.new_session()
    session.chat("Hello there.", SHORT)
    path = StoredSession(server.settings.store, session.id)
    blob = path.read_bytes()
    turn = RawTurn(client.channel)
    opened = turn.open(session.id, session.key, client.bundle.server_fingerprint, version=1)
    huge = torch.full((4, client.model.hidden_size), 65504.0, dtype=torch.float16)
    turn.send(pb.TurnRequest(step=pb.Step(hidden=to_proto(huge), cache_length=opened.cache_length)))
    turn.send(pb.TurnRequest(commit=pb.Commit()))
    err = turn.error()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "overflows to inf/NaN in float16, the dtype the step was sent in" in err.details()
    assert "nothing was committed" in err.details()
    assert path.read_bytes() == blob
    assert wait_until(lambda: server.engine.active_turns == 0) and pool_is_whole(server)
    assert session.chat("Still fine?", SHORT).version == 2  # the session, and the server, carry on
    assert client.new_session().chat("Hi!", ONE).version == 1


def test_undeclared_turns_cannot_starve_a_normal_generate(bundles, tmp_path):
    """Eight raw turns that declare no reserve_tokens (old code: each was granted a whole 8,192-token window,
    so together they held the default 65,536-token pool, and a generate beside them was refused)."""
    srv = start_server(bundles, tmp_path / "store", admission_wait=1.0, verify_bundle=False)
    c = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=30)
    held = [RawTurn(c.channel) for _ in range(8)]
    try:
        for turn in held:
            assert turn.open(*new_ids(), c.bundle.server_fingerprint, reserve=0).version == 0
        assert srv.engine.active_turns == 8
        assert srv.engine.pool.spare_pages >= srv.engine.pool.num_pages // 2
        result, seconds = timed(lambda: c.new_session().chat("Name a colour.", ONE))
        assert result.version == 1 and seconds < 10, seconds
    finally:
        for turn in held:
            turn.cancel()
        c.close()
        srv.stop(0)


@pytest.fixture(scope="module")
def keyed_pod(bundles, tmp_path_factory):
    """Two API keys, four turn slots (two per key), a 4,096-token pool (2,048 per key: one window)."""
    srv = start_server(bundles, tmp_path_factory.mktemp("keyed-store"), api_keys="key-a,key-b", max_sessions=4,
                       kv_pool_tokens=4096, max_context=2048, admission_wait=1.0, verify_bundle=False)
    clients = [Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120, api_key=key)
               for key in ("key-a", "key-b")]
    yield srv, clients
    for c in clients:
        c.close()
    srv.stop(0)


def test_one_api_key_cannot_take_every_slot_or_the_pool(keyed_pod):
    srv, (a, b) = keyed_pod
    fp = a.bundle.server_fingerprint
    assert srv.engine.config.max_sessions_per_key == 2 and srv.engine.config.pages_per_key == 128
    held = []

    def refused(channel, reserve: int, *fragments: str) -> None:
        turn = RawTurn(channel)
        turn.send(pb.TurnRequest(open=pb.OpenTurn(session_id=os.urandom(16), session_key=os.urandom(32),
                                                  bundle_fingerprint=fp, reserve_tokens=reserve)))
        err, seconds = timed(turn.error)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert all(f in err.details() for f in fragments), err.details()
        assert seconds < 1 and retry_after_ms(err) > 0, (seconds, err.trailing_metadata())

    try:
        held.append(RawTurn(a.channel))
        assert held[-1].open(*new_ids(), fp, reserve=1900).version == 0  # 119 of key a's 128 pages
        refused(a.channel, 1000, "this API key hold 119 of the 128 KV pages")  # fits the pool, not its share
        held.append(RawTurn(a.channel))
        assert held[-1].open(*new_ids(), fp, reserve=16).version == 0
        refused(a.channel, 16, "this API key has its limit of 2 turns")  # its slots (two are still free)
        assert srv.engine.active_turns == 2
        result, seconds = timed(lambda: b.new_session().chat("Name a colour.", ONE))  # key b: served at once
        assert result.version == 1 and seconds < 10, seconds
        held.append(RawTurn(b.channel))
        assert held[-1].open(*new_ids(), fp, reserve=1900).version == 0  # and may take its own share
        # Streams too: a key holds at most its share (8 of 16); the other key's next stream is still served.
        held += [RawTurn(a.channel) for _ in range(6)]
        assert wait_until(lambda: srv.service.num_streams == 9)
        refused(a.channel, 16, "this API key has its limit of 8 turn streams")
        held.append(RawTurn(b.channel))
        assert held[-1].open(*new_ids(), fp, reserve=16).version == 0
    finally:
        for turn in held:
            turn.cancel()
    assert wait_until(lambda: srv.service.num_streams == 0 and srv.engine.active_turns == 0)
    assert pool_is_whole(srv)
    assert a.new_session().chat("Hi!", ONE).version == 1  # everything is back for key a


# -- binding whole or not at all, before the model loads ------------------------------------------------
RESOLVE_LOCALHOST_TO_BOTH = textwrap.dedent("""
    # A host whose `localhost` names both loopback addresses, as most dual-stack hosts files do.
    import socket, sys
    real = socket.getaddrinfo
    def getaddrinfo(host, *args, **kwargs):
        if host == "localhost":
            return real("::1", *args, **kwargs) + real("127.0.0.1", *args, **kwargs)
        return real(host, *args, **kwargs)
    socket.getaddrinfo = getaddrinfo
    from infemeral.server.main import main
    sys.exit(main())
""")


@pytest.fixture
def unloadable_bundle(bundles, tmp_path) -> Path:
    """The server bundle's manifest and config without its weights: any server that got as far as
    verifying or loading the model fails on it, so a refusal about the address proves it came first."""
    d = tmp_path / "bundle-without-weights"
    d.mkdir()
    for name in ("manifest.json", "config.json"):
        shutil.copy(bundles.server_dir / name, d / name)
    assert json.loads((d / "manifest.json").read_text())["files"]
    return d


def occupied(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.listen()
    return s


@pytest.mark.parametrize("case", ["same address", "localhost half-bind", "metrics port"])
def test_an_address_that_cannot_be_bound_whole_stops_the_server(case, unloadable_bundle, tmp_path):
    taken = occupied("127.0.0.1")
    port = taken.getsockname()[1]
    try:
        env = dict(os.environ, INFEMERAL_BUNDLE=str(unloadable_bundle), INFEMERAL_STORE=str(tmp_path / "store"),
                   INFEMERAL_DEVICE="cpu", INFEMERAL_METRICS_PORT="0", INFEMERAL_LISTEN=f"127.0.0.1:{port}")
        command = [sys.executable, "-m", "infemeral.server.main"]
        expected = f"infemeral-server: cannot listen on 127.0.0.1:{port}: address already in use"
        if case == "localhost half-bind":
            env["INFEMERAL_LISTEN"] = f"localhost:{port}"
            command = [sys.executable, "-c", RESOLVE_LOCALHOST_TO_BOTH]
            expected = f"infemeral-server: cannot listen on localhost:{port} (127.0.0.1:{port}): address already in use"
        elif case == "metrics port":
            env.update(INFEMERAL_LISTEN=f"127.0.0.1:{free_port()}", INFEMERAL_METRICS_PORT=str(port))
            expected = f"infemeral-server: cannot listen on the metrics port 127.0.0.1:{port}: address already in use"
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == expected + "\n"
    assert proc.stdout == ""
