"""Turns are atomic when either side dies: a client cancelled or killed mid-turn, a server killed mid-turn.

After each failure the stored session is byte-for-byte at its last committed
version, and the session resumes from there (through the SDK, from a saved
session file where the client process died). A client that goes away while
its session is still loading leaves no page behind: the close waits for the
load, then wipes. SIGTERM shuts the server down
gracefully: an open turn may finish, then the process exits with code 0.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from tests.support.faults import wait_until
from tests.conftest import StoredSession, free_port, spawn_server

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.errors import StatusError
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.paged import PagedSequence
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import to_proto

pytestmark = pytest.mark.slow

SHORT = SamplingParams(max_new_tokens=3)
LONG_ANSWER = "Write a very long and detailed story about a dragon who learns to bake bread."


def blob_path(store, session) -> StoredSession:
    return StoredSession(store, session.id)


def in_turn(server, session) -> bool:
    """Whether the in-process server holds an open turn for this session."""
    return server.engine.sessions.is_in_turn(session.id)


def open_request(session, fingerprint: str) -> pb.TurnRequest:
    return pb.TurnRequest(open=pb.OpenTurn(session_id=session.id, session_key=session.key,
                                           expected_version=session.version, bundle_fingerprint=fingerprint))


def assert_resumes(session, path: Path, committed_blob: bytes) -> None:
    """The stored state is the committed one, and the session's next turn commits the next version."""
    assert path.read_bytes() == committed_blob
    before = session.version
    result = session.chat("Thanks. One more short answer?", SHORT)
    assert result.version == session.version == before + 1
    assert path.read_bytes() != committed_blob


# -- a client that goes away ---------------------------------------------------------------------
@pytest.mark.parametrize("when", ["after a step result", "while the server computes a step"])
def test_cancelled_turn_changes_nothing(server, client, when):
    session = client.new_session()
    session.chat("Hello there.", SHORT)
    path = blob_path(server.settings.store, session)
    blob = path.read_bytes()
    version, length = session.version, len(session.history_ids)

    requests: queue.Queue = queue.Queue()
    call = pb_grpc.InfemeralStub(client.channel).Turn(iter(requests.get, None), timeout=60)
    requests.put(open_request(session, client.bundle.server_fingerprint))
    opened = next(call).opened
    assert (opened.version, opened.cache_length) == (version, length)
    rows = 1 if when == "after a step result" else 512
    requests.put(pb.TurnRequest(step=pb.Step(hidden=to_proto(torch.randn(rows, client.model.hidden_size)),
                                             cache_length=length)))
    if rows == 1:
        assert next(call).step.cache_length == length + 1
    else:
        time.sleep(0.1)  # the step (about half a second of CPU work) is now running on the engine
    assert in_turn(server, session)
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    # The server ends the turn on its own (wiping it and releasing the session)...
    assert wait_until(lambda: not in_turn(server, session)), "the cancelled turn is still open on the server"
    # ...and nothing of it was stored.
    assert session.version == version and len(session.history_ids) == length
    assert_resumes(session, path, blob)


def test_a_turn_cancelled_while_its_session_loads_is_closed_after_the_load(server, client, monkeypatch):
    """The client goes away while the server still decrypts its session into pages. The close waits for that
    load: a load left running after the close would write plaintext into pages the close had already given
    back (or taken afresh from the pool, never to return)."""
    session = client.new_session()
    session.chat("Hello there.", SHORT)
    path = blob_path(server.settings.store, session)
    blob = path.read_bytes()
    pool = server.engine.pool
    loading, go_on = threading.Event(), threading.Event()
    written: set[int] = set()
    real_load = PagedSequence.load_layer

    def slow_load(self, slot, keys, values):
        if not loading.is_set():  # the first layer of the session's load: stall it until the client is gone
            loading.set()
            go_on.wait(30)
        real_load(self, slot, keys, values)
        written.update(self.pages)

    monkeypatch.setattr(PagedSequence, "load_layer", slow_load)
    loaded = threading.Event()
    real_load_turn = server.engine.load_turn

    def load_turn(turn, *args, **kwargs):
        try:
            return real_load_turn(turn, *args, **kwargs)
        finally:
            if turn.session_id == session.id:
                loaded.set()

    monkeypatch.setattr(server.engine, "load_turn", load_turn)
    requests: queue.Queue = queue.Queue()
    call = pb_grpc.InfemeralStub(client.channel).Turn(iter(requests.get, None), timeout=60)
    requests.put(open_request(session, client.bundle.server_fingerprint))
    try:
        assert loading.wait(30)
        call.cancel()
        time.sleep(0.5)
        assert in_turn(server, session)  # the close waits for the load...
        other = client.new_session()  # ...while everyone else is served
        assert other.chat("Hi!", SHORT).version == 1
    finally:
        go_on.set()
    assert loaded.wait(30)
    assert wait_until(lambda: not in_turn(server, session) and server.engine.active_turns == 0)
    assert written  # the load did write its pages; the close wiped them, and every page is back
    assert pool.free_pages == pool.num_pages and pool.promised_pages == 0
    pages = torch.tensor(sorted(written))
    assert all(not t[pages].any() for t in server.engine.kv.k + server.engine.kv.v), "a closed turn's pages still hold its keys/values"
    monkeypatch.undo()
    assert_resumes(session, path, blob)
    assert other.chat("And again?", SHORT).version == 2


CLIENT_SNIPPET = textwrap.dedent("""
    import sys
    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams

    address, bundle, session_file, question = sys.argv[1:5]
    client = Client(address, bundle, timeout=300)
    session = client.load_session(session_file)
    print("LOADED", session.version, flush=True)
    for i, delta in enumerate(session.stream(question, SamplingParams(max_new_tokens=4000))):
        if i == 5:
            print("STREAMING", flush=True)
    print("FINISHED", session.version, flush=True)
""")


def read_lines(proc: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"never saw {prefix!r}; output was:\n" + "\n".join(seen[-30:]))


def test_killed_client_process_changes_nothing(server, client, bundles, tmp_path):
    session = client.new_session()
    session.chat("Hello there.", SHORT)
    session_file = session.save(tmp_path / "chat.session")
    path = blob_path(server.settings.store, session)
    blob = path.read_bytes()

    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SNIPPET, f"127.0.0.1:{server.port}",
                             str(bundles.client_dir), str(session_file), LONG_ANSWER],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = read_lines(proc)
        assert wait_for_line(lines, "LOADED", 120) == "LOADED 1"
        wait_for_line(lines, "STREAMING", 120)
        assert in_turn(server, session)  # killed mid-turn, while it streams its answer
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert wait_until(lambda: not in_turn(server, session)), "the dead client's turn is still open"
    assert path.read_bytes() == blob
    resumed = client.load_session(session_file)
    assert resumed.version == 1 and resumed.history_ids == session.history_ids
    assert_resumes(resumed, path, blob)


# -- a server that goes away ---------------------------------------------------------------------
GRACE_SECONDS = 60  # the second server's --grace-seconds


def test_server_killed_mid_turn_then_sigterm_is_graceful(bundles, tmp_path):
    store = tmp_path / "store"
    procs: list[subprocess.Popen] = []
    clients: list[Client] = []
    try:
        port = free_port()
        procs.append(spawn_server(bundles.server_dir, store, port))
        clients.append(Client(f"127.0.0.1:{port}", bundles.client_dir, timeout=120))
        session = clients[0].new_session()
        session.chat("Hello there.", SHORT)
        session_file = session.save(tmp_path / "chat.session")
        path = blob_path(store, session)
        blob = path.read_bytes()
        state = (session.version, len(session.history_ids), session.cache.length)
        assert state[0] == 1

        # Turn 2 streams a long answer in a thread; SIGKILL the server while it does.
        streaming, errors = threading.Event(), []

        def second_turn():
            try:
                for i, _ in enumerate(session.stream(LONG_ANSWER, SamplingParams(max_new_tokens=4000))):
                    if i == 5:
                        streaming.set()
            except Exception as e:  # noqa: BLE001 - recorded for the test
                errors.append(e)
            finally:
                streaming.set()

        worker = threading.Thread(target=second_turn)
        worker.start()
        assert streaming.wait(120)
        assert not errors and worker.is_alive()
        procs[0].kill()
        procs[0].wait(timeout=30)
        worker.join(60)
        assert not worker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], StatusError)
        assert errors[0].code == grpc.StatusCode.UNAVAILABLE, errors[0]
        # The client rolled back; the store still holds the committed turn 1, nothing torn.
        assert (session.version, len(session.history_ids), session.cache.length) == state
        assert path.read_bytes() == blob
        assert [p.name for p in store.iterdir()] == [path.folder.name]
        assert not [p for p in path.folder.iterdir() if p.name.startswith(".tmp-")]

        # A new server on the same store: the session resumes from its saved file. Its grace after SIGTERM is
        # longer than the default 10 s: the turn open then must finish its 23 steps within it, after this test's
        # polling, on a machine that may be busy (graceful means it may finish, not how fast it does).
        port = free_port()
        procs.append(spawn_server(bundles.server_dir, store, port, INFEMERAL_GRACE_SECONDS=GRACE_SECONDS))
        clients.append(Client(f"127.0.0.1:{port}", bundles.client_dir, timeout=120))
        resumed = clients[1].load_session(session_file)
        assert resumed.version == 1
        assert_resumes(resumed, path, blob)

        # SIGTERM while a turn is open: the turn still commits, new turns are refused, the process exits 0.
        before = path.read_bytes()
        stream = resumed.stream("Now write a short poem.", SamplingParams(max_new_tokens=24))
        assert next(stream)
        procs[1].send_signal(signal.SIGTERM)
        stub = pb_grpc.InfemeralStub(clients[1].channel)
        other = clients[1].new_session()

        def refused() -> bool:
            try:
                list(stub.Turn(iter([open_request(other, clients[1].bundle.server_fingerprint)]), timeout=2))
            except grpc.RpcError as e:
                return e.code() == grpc.StatusCode.UNAVAILABLE
            return False

        assert wait_until(refused, 5), "new turns are still accepted after SIGTERM"
        "".join(stream)
        assert resumed.version == 3 and resumed.last_result.generated_tokens > 0
        assert path.read_bytes() != before
        started = time.monotonic()
        out, _ = procs[1].communicate(timeout=15)
        assert procs[1].returncode == 0, out
        assert time.monotonic() - started < 5
        assert "received SIGTERM" in out
    finally:
        for c in clients:
            c.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# -- the cache buffers ---------------------------------------------------------------------------
def test_cache_grown_inside_inference_mode_can_be_wiped_and_reloaded():
    """Regression: buffers that grew inside inference_mode became inference tensors, so wipe() failed
    outside it — which left the session locked in a turn and its plaintext unwiped after every turn
    that took a cache past its initial capacity."""
    cache = KVCache(0, 2, 1, 4, torch.float32, capacity=2)
    with torch.inference_mode():
        for layer in range(2):
            cache.update(torch.ones(1, 1, 5, 4), torch.ones(1, 1, 5, 4), layer)
        cache.finish_step(5)
    assert cache.capacity >= 5
    cache.load_layer(0, torch.zeros(1, 5, 4), torch.zeros(1, 5, 4))
    cache.wipe()
    assert cache.length == 0
    assert all(float(t.abs().sum()) == 0 for t in cache._k + cache._v)


def test_session_past_the_initial_cache_capacity(server, client):
    """A turn that grows the cache past its initial 256 slots commits, and the session carries on."""
    session = client.new_session()
    result = session.chat("Summarise this text: " + "the quick brown fox jumps over the lazy dog. " * 30, SHORT)
    assert len(session.history_ids) > 256
    assert result.version == 1
    assert not in_turn(server, session)
    path = blob_path(server.settings.store, session)
    assert_resumes(session, path, path.read_bytes())
