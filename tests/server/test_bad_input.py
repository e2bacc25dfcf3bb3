"""Everything a peer or the storage can get wrong is refused with a clear status and never damages a session.

Each case starts from a real committed session (made with the SDK), sends the
bad input over raw gRPC (the SDK would refuse to build most of it), and then
checks three things: the gRPC status (and that its message names the
problem), that the stored blob is byte-for-byte unchanged, and that the
session still works (another SDK turn commits and bumps the version).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import grpc
import pytest
import torch
from tests.conftest import StoredSession, start_server

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.client.session import Session
from infemeral.errors import OutOfRange, PermissionDenied
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import E4M3, INT8, to_proto

pytestmark = pytest.mark.slow

SHORT = SamplingParams(max_new_tokens=3)
MAX_STEP, MAX_CONTEXT = 64, 200  # limits of the `limited` server


# -- fixtures and helpers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limited(bundles, tmp_path_factory):
    """A second real server, on its own store, with small limits; and an SDK client for it."""
    srv = start_server(bundles, tmp_path_factory.mktemp("limited-store"), max_step_tokens=MAX_STEP,
                       max_context=MAX_CONTEXT, window=False)
    c = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120)
    yield srv, c
    c.close()
    srv.stop(0)


@dataclass
class Committed:
    """A committed SDK session plus what was true of it right after its last commit."""

    server: object
    client: Client
    session: Session
    stub: pb_grpc.InfemeralStub
    path: StoredSession
    blob: bytes
    version: int
    history: int
    cache_length: int
    messages: int

    @property
    def sid(self) -> bytes:
        return self.session.id

    @property
    def key(self) -> bytes:
        return self.session.key

    @property
    def fp(self) -> str:
        return self.client.bundle.server_fingerprint

    @property
    def hidden(self) -> int:
        return self.client.model.hidden_size

    def open(self, **over) -> pb.TurnRequest:
        fields = dict(session_id=self.sid, session_key=self.key, expected_version=self.version,
                      bundle_fingerprint=self.fp)
        fields.update(over)
        return pb.TurnRequest(open=pb.OpenTurn(**fields))

    def assert_client_unchanged(self) -> None:
        s = self.session
        assert s.version == self.version
        assert len(s.history_ids) == self.history
        assert s.cache.length == self.cache_length
        assert s.cache.committed_length == self.cache_length
        assert len(s.messages) == self.messages

    def assert_intact_and_usable(self) -> None:
        """Stored bytes untouched, SDK state untouched, and the next SDK turn commits."""
        assert self.path.read_bytes() == self.blob, "the stored session was modified by a refused turn"
        self.assert_client_unchanged()
        result = self.session.chat("And one more thing?", SHORT)
        assert result.version == self.version + 1
        assert self.session.version == self.version + 1
        assert len(self.session.history_ids) > self.history
        assert self.path.read_bytes() != self.blob


def commit_session(server, client: Client) -> Committed:
    session = client.new_session()
    result = session.chat("Hello! Say something short.", SHORT)
    assert result.version == session.version == 1
    return snapshot(server, client, session)


def snapshot(server, client: Client, session: Session) -> Committed:
    path = StoredSession(server.settings.store, session.id)
    return Committed(server, client, session, pb_grpc.InfemeralStub(client.channel), path, path.read_bytes(),
                     session.version, len(session.history_ids), session.cache.length, len(session.messages))


@pytest.fixture
def committed(server, client) -> Committed:
    return commit_session(server, client)


def rows(n: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, width).to(dtype)


def tensor(data: bytes | torch.Tensor, dtype: str = "float32", shape: list[int] | None = None) -> pb.Tensor:
    if isinstance(data, torch.Tensor):
        shape = list(data.shape) if shape is None else shape
        data = data.contiguous().view(torch.uint8).numpy().tobytes()
    return pb.Tensor(data=data, dtype=dtype, shape=shape)


def step(t: pb.Tensor, cache_length: int, outputs: int = 0) -> pb.TurnRequest:
    return pb.TurnRequest(step=pb.Step(hidden=t, cache_length=cache_length, outputs=outputs))


def turn_error(stub, requests: list[pb.TurnRequest]) -> tuple[list[str], grpc.RpcError]:
    """Send `requests` on one Turn stream; return the kinds answered before the error, and the error."""
    call = stub.Turn(iter(requests), timeout=60)
    kinds = []
    with pytest.raises(grpc.RpcError) as info:
        for response in call:
            kinds.append(response.WhichOneof("kind"))
    return kinds, info.value


def assert_status(err: grpc.RpcError, code: grpc.StatusCode, *fragments: str) -> None:
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {err.details()}"
    for fragment in fragments:
        assert fragment in err.details(), f"{fragment!r} not in {err.details()!r}"


# -- opening a turn ---------------------------------------------------------------------------------
OPEN_CASES = {
    # name: (c -> the whole request list, code, message fragments)
    "wrong session key": (lambda c: [c.open(session_key=secrets.token_bytes(32))],
                          grpc.StatusCode.PERMISSION_DENIED, ["session key does not match"]),
    "fingerprint mismatch": (lambda c: [c.open(bundle_fingerprint="sha256:" + "0" * 64)],
                             grpc.StatusCode.FAILED_PRECONDITION, ["different server bundle", "sha256:" + "0" * 64]),
    "no fingerprint": (lambda c: [c.open(bundle_fingerprint="")],
                       grpc.StatusCode.FAILED_PRECONDITION, ["different server bundle"]),
    "stale expected_version": (lambda c: [c.open(expected_version=c.version - 1)],
                               grpc.StatusCode.ABORTED, ["stored session is at version 1", "expects version 0"]),
    "future expected_version": (lambda c: [c.open(expected_version=c.version + 4)],
                                grpc.StatusCode.ABORTED, ["stored session is at version 1", "expects version 5"]),
    "short session id": (lambda c: [c.open(session_id=c.sid[:15])],
                         grpc.StatusCode.INVALID_ARGUMENT, ["session_id must be 16 bytes, got 15"]),
    "long session id": (lambda c: [c.open(session_id=c.sid + b"\0")],
                        grpc.StatusCode.INVALID_ARGUMENT, ["session_id must be 16 bytes, got 17"]),
    "empty session id": (lambda c: [c.open(session_id=b"")],
                         grpc.StatusCode.INVALID_ARGUMENT, ["session_id must be 16 bytes, got 0"]),
    "short session key": (lambda c: [c.open(session_key=c.key[:31])],
                          grpc.StatusCode.INVALID_ARGUMENT, ["session_key must be 32 bytes, got 31"]),
    "long session key": (lambda c: [c.open(session_key=c.key + b"\0")],
                         grpc.StatusCode.INVALID_ARGUMENT, ["session_key must be 32 bytes, got 33"]),
    "first message is a step": (lambda c: [step(tensor(rows(1, c.hidden)), c.history), c.open()],
                                grpc.StatusCode.INVALID_ARGUMENT, ["must start with an `open`"]),
    "first message is a commit": (lambda c: [pb.TurnRequest(commit=pb.Commit()), c.open()],
                                  grpc.StatusCode.INVALID_ARGUMENT, ["must start with an `open`"]),
    "first message is empty": (lambda c: [pb.TurnRequest(), c.open()],
                               grpc.StatusCode.INVALID_ARGUMENT, ["must start with an `open`"]),
    "no message at all": (lambda c: [], grpc.StatusCode.INVALID_ARGUMENT, ["must start with an `open`"]),
}


@pytest.mark.parametrize("case", OPEN_CASES)
def test_bad_open(committed, case):
    build, code, fragments = OPEN_CASES[case]
    kinds, err = turn_error(committed.stub, build(committed))
    assert_status(err, code, *fragments)
    assert kinds == []
    committed.assert_intact_and_usable()


def test_wrong_key_reveals_nothing_about_the_stored_version(committed):
    """Ownership is checked first: a wrong key with a wrong version is PERMISSION_DENIED, not ABORTED."""
    kinds, err = turn_error(committed.stub, [committed.open(session_key=secrets.token_bytes(32),
                                                            expected_version=7)])
    assert_status(err, grpc.StatusCode.PERMISSION_DENIED)
    assert "version" not in err.details()
    committed.assert_intact_and_usable()


def test_expected_version_for_a_session_with_nothing_stored(committed):
    sid, key = secrets.token_bytes(16), secrets.token_bytes(32)
    path = StoredSession(committed.server.settings.store, sid)
    kinds, err = turn_error(committed.stub, [committed.open(session_id=sid, session_key=key, expected_version=1)])
    assert_status(err, grpc.StatusCode.NOT_FOUND, "no stored state", "version 1")
    assert not path.exists()
    # Version 0 does open it (empty); a turn that ends without commit still stores nothing.
    responses = list(committed.stub.Turn(iter([committed.open(session_id=sid, session_key=key, expected_version=0)]),
                                         timeout=60))
    assert [(r.opened.version, r.opened.cache_length) for r in responses] == [(0, 0)]
    assert not path.exists()
    committed.assert_intact_and_usable()


# -- inside a turn ----------------------------------------------------------------------------------
def _valid(c: Committed, n: int = 1) -> pb.Tensor:
    return tensor(rows(n, c.hidden))


def _case(requests, code, *fragments):
    return requests, code, fragments


STEP_CASES = {
    # name: c -> (requests after `open`, code, message fragments)
    "byte length short of the shape": lambda c: _case(
        [step(tensor(_valid(c).data[:-1], shape=[1, c.hidden]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "2303 bytes do not match shape [1, 576]"),
    "byte length over the shape": lambda c: _case(
        [step(tensor(_valid(c).data + b"\0\0\0\0", shape=[1, c.hidden]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "2308 bytes do not match shape [1, 576]"),
    "bfloat16 label on float32 bytes": lambda c: _case(
        [step(tensor(_valid(c).data, dtype="bfloat16", shape=[1, c.hidden]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "2304 bytes do not match shape [1, 576] of bfloat16"),
    "wrong last dimension": lambda c: _case(
        [step(tensor(rows(1, c.hidden - 1)), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "last dimension is 575", "hidden size is 576"),
    "NaN": lambda c: _case(
        [step(tensor(torch.where(torch.arange(c.hidden) == 7, float("nan"), rows(1, c.hidden))), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "NaN or infinite"),
    "infinity": lambda c: _case(
        [step(tensor(torch.full((2, c.hidden), float("-inf"))), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "NaN or infinite"),
    "int64 dtype": lambda c: _case(
        [step(tensor(torch.arange(c.hidden, dtype=torch.int64).view(1, -1), dtype="int64"), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "dtype 'int64' is not allowed"),
    "no dtype": lambda c: _case(
        [step(tensor(_valid(c).data, dtype="", shape=[1, c.hidden]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "dtype '' is not allowed"),
    "rank 3": lambda c: _case(
        [step(tensor(rows(2, c.hidden).view(1, 2, c.hidden)), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "expected a 2-D tensor", "[1, 2, 576]"),
    "rank 1": lambda c: _case(
        [step(tensor(rows(1, c.hidden).view(-1)), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "expected a 2-D tensor", "got shape [576]"),
    "zero rows": lambda c: _case(
        [step(tensor(b"", shape=[0, c.hidden]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "at least one token"),
    "absurd row count": lambda c: _case(
        [step(tensor(_valid(c).data, shape=[1 << 40, c.hidden]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, f"{1 << 40} tokens in one step exceed"),
    "step with a stale cache_length": lambda c: _case(
        [step(_valid(c), c.history - 1)],
        grpc.StatusCode.ABORTED, f"client thinks the cache holds {c.history - 1} tokens but it holds {c.history}"),
    "step with a future cache_length": lambda c: _case(
        [step(_valid(c), c.history + 1)],
        grpc.StatusCode.ABORTED, f"client thinks the cache holds {c.history + 1} tokens but it holds {c.history}"),
    "cache_length mismatch after a good step": lambda c: _case(
        [step(_valid(c, 3), c.history), step(_valid(c), c.history)],
        grpc.StatusCode.ABORTED, f"client thinks the cache holds {c.history} tokens but it holds {c.history + 3}"),
    "more outputs than rows": lambda c: _case(
        [step(_valid(c, 2), c.history, outputs=3)],
        grpc.StatusCode.INVALID_ARGUMENT, "outputs must be between 1 and the step's 2 tokens, got 3"),
    "truncate more than the cache": lambda c: _case(
        [pb.TurnRequest(truncate=pb.Truncate(tokens=c.history + 1, cache_length=c.history))],
        grpc.StatusCode.INVALID_ARGUMENT, f"cannot drop {c.history + 1} tokens from a cache of {c.history}"),
    "truncate with a stale cache_length": lambda c: _case(
        [pb.TurnRequest(truncate=pb.Truncate(tokens=1, cache_length=c.history - 1))],
        grpc.StatusCode.ABORTED, f"client thinks the cache holds {c.history - 1} tokens but it holds {c.history}"),
    "e4m3 with one scale for two rows": lambda c: _case(
        [step(pb.Tensor(data=bytes(2 * c.hidden), dtype=E4M3, shape=[2, c.hidden], scale=[1.0]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "float8_e4m3fn needs one scale per row: 1 scales for 2 rows"),
    "e4m3 with a NaN scale": lambda c: _case(
        [step(pb.Tensor(data=bytes(c.hidden), dtype=E4M3, shape=[1, c.hidden], scale=[float("nan")]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "scales must be finite and positive"),
    "e4m3 bytes short of the shape": lambda c: _case(
        [step(pb.Tensor(data=bytes(c.hidden - 1), dtype=E4M3, shape=[1, c.hidden], scale=[1.0]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "575 bytes do not match shape [1, 576] of float8_e4m3fn (576 bytes"),
    "answer dtype asked by a plain step": lambda c: _case(
        [pb.TurnRequest(step=pb.Step(hidden=_valid(c), cache_length=c.history, answer_dtype="float32"))],
        grpc.StatusCode.INVALID_ARGUMENT, "only a step sent in 8 bits (float8_e4m3fn or int8) may ask"),
    "int8 with one scale for two rows": lambda c: _case(
        [step(pb.Tensor(data=bytes(2 * c.hidden), dtype=INT8, shape=[2, c.hidden], scale=[1.0]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "int8 needs one scale per row: 1 scales for 2 rows"),
    "int8 without scales": lambda c: _case(
        [step(pb.Tensor(data=bytes(c.hidden), dtype=INT8, shape=[1, c.hidden]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "int8 needs one scale per row: 0 scales for 1 rows"),
    "int8 with a zero scale": lambda c: _case(
        [step(pb.Tensor(data=bytes(c.hidden), dtype=INT8, shape=[1, c.hidden], scale=[0.0]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "int8 scales must be finite and positive"),
    "int8 bytes short of the shape": lambda c: _case(
        [step(pb.Tensor(data=bytes(c.hidden - 1), dtype=INT8, shape=[1, c.hidden], scale=[1.0]), c.history)],
        grpc.StatusCode.INVALID_ARGUMENT, "575 bytes do not match shape [1, 576] of int8 (576 bytes"),
    "int8 step asking for another dtype than the server's": lambda c: _case(
        [pb.TurnRequest(step=pb.Step(hidden=to_proto(rows(1, c.hidden), INT8), cache_length=c.history,
                                     answer_dtype="bfloat16"))],
        grpc.StatusCode.INVALID_ARGUMENT, "answer_dtype 'bfloat16'", "this server's (float32)"),
    "e4m3 step asking for another dtype than the server's": lambda c: _case(
        [pb.TurnRequest(step=pb.Step(hidden=to_proto(rows(1, c.hidden), E4M3), cache_length=c.history,
                                     answer_dtype="float16"))],
        grpc.StatusCode.INVALID_ARGUMENT, "answer_dtype 'float16'", "this server's (float32)"),
    "draft tree with a parent per row missing": lambda c: _case(
        [pb.TurnRequest(step=pb.Step(hidden=_valid(c, 3), cache_length=c.history, parents=[-1, 0]))],
        grpc.StatusCode.INVALID_ARGUMENT, "one parent per row: 2 parents for 3 rows"),
    "draft tree whose first row is not the root": lambda c: _case(
        [pb.TurnRequest(step=pb.Step(hidden=_valid(c, 2), cache_length=c.history, parents=[0, 0]))],
        grpc.StatusCode.INVALID_ARGUMENT, "parents[0] must be -1"),
    "draft tree with a parent after its child": lambda c: _case(
        [pb.TurnRequest(step=pb.Step(hidden=_valid(c, 3), cache_length=c.history, parents=[-1, 2, 0]))],
        grpc.StatusCode.INVALID_ARGUMENT, "parents[1] = 2: every row's parent must be an earlier row"),
    "keeping positions out of order after a tree": lambda c: _case(
        [pb.TurnRequest(step=pb.Step(hidden=_valid(c, 3), cache_length=c.history, parents=[-1, 0, 0])),
         pb.TurnRequest(truncate=pb.Truncate(tokens=3, cache_length=c.history + 3, keep=[2, 0]))],
        grpc.StatusCode.INVALID_ARGUMENT, "Truncate.keep must list ascending offsets among the 3 positions"),
    "keeping a position it does not drop": lambda c: _case(
        [pb.TurnRequest(truncate=pb.Truncate(tokens=1, cache_length=c.history, keep=[0, 1]))],
        grpc.StatusCode.INVALID_ARGUMENT, "Truncate.keep must list ascending offsets among the 1 positions"),
    "second open": lambda c: _case(
        [c.open()], grpc.StatusCode.INVALID_ARGUMENT, "unexpected message 'open'"),
    "empty message": lambda c: _case(
        [pb.TurnRequest()], grpc.StatusCode.INVALID_ARGUMENT, "unexpected message None"),
}


@pytest.mark.parametrize("case", STEP_CASES)
def test_bad_message_inside_a_turn(committed, case):
    c = committed
    bad, code, fragments = STEP_CASES[case](c)
    kinds, err = turn_error(c.stub, [c.open()] + bad)
    assert_status(err, code, *fragments)
    # Everything before the bad message was answered: opened, then one result per good step.
    assert kinds == ["opened"] + ["step"] * (len(bad) - 1)
    c.assert_intact_and_usable()


# -- limits -----------------------------------------------------------------------------------------
def test_step_over_max_step_tokens(limited):
    srv, cl = limited
    c = commit_session(srv, cl)
    assert cl.server_info().max_step_tokens == MAX_STEP
    kinds, err = turn_error(c.stub, [c.open(), step(_valid(c, MAX_STEP), c.history),
                                     step(_valid(c, MAX_STEP + 1), c.history + MAX_STEP)])
    assert_status(err, grpc.StatusCode.INVALID_ARGUMENT, f"{MAX_STEP + 1} tokens in one step exceed",
                  f"limit of {MAX_STEP}")
    assert kinds == ["opened", "step"]  # exactly max_step_tokens is fine
    c.assert_intact_and_usable()


def test_message_over_the_grpc_size_limit(limited):
    """Far over the limit, gRPC itself refuses the message before it is parsed."""
    srv, cl = limited
    c = commit_session(srv, cl)
    big = _valid(c, 4 * MAX_STEP)
    assert big.ByteSize() > srv.max_message_bytes
    kinds, err = turn_error(c.stub, [c.open(), step(big, c.history)])
    assert_status(err, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert kinds == ["opened"]
    c.assert_intact_and_usable()


def test_growing_past_max_context(limited):
    srv, cl = limited
    c = commit_session(srv, cl)
    fill = MAX_CONTEXT - c.history - 2 * MAX_STEP
    assert 0 < fill <= MAX_STEP
    requests = [c.open(), step(_valid(c, MAX_STEP), c.history), step(_valid(c, MAX_STEP), c.history + MAX_STEP),
                step(_valid(c, fill), c.history + 2 * MAX_STEP),  # exactly max_context: allowed
                step(_valid(c, 1), MAX_CONTEXT)]
    kinds, err = turn_error(c.stub, requests)
    assert_status(err, grpc.StatusCode.OUT_OF_RANGE, f"grow the session to {MAX_CONTEXT + 1} tokens",
                  f"max_context of {MAX_CONTEXT}")
    assert kinds == ["opened", "step", "step", "step"]
    c.assert_intact_and_usable()


def test_sdk_turn_over_max_context_leaves_both_sides_unchanged(limited):
    """The SDK sends a long prompt in max_step_tokens chunks; the server refuses one mid-way."""
    srv, cl = limited
    c = commit_session(srv, cl)
    with pytest.raises(OutOfRange, match="max_context"):
        c.session.chat("Please repeat: " + "apple banana cherry " * 60, SHORT)
    c.assert_intact_and_usable()


# -- deleting ---------------------------------------------------------------------------------------
def test_delete_refusals_and_delete(committed):
    c = committed
    unknown = pb.DeleteSessionRequest(session_id=secrets.token_bytes(16), session_key=secrets.token_bytes(32))
    cases = [
        (unknown, grpc.StatusCode.NOT_FOUND, "no such session"),
        (pb.DeleteSessionRequest(session_id=c.sid, session_key=secrets.token_bytes(32)),
         grpc.StatusCode.PERMISSION_DENIED, "session key does not match"),
        (pb.DeleteSessionRequest(session_id=c.sid[:8], session_key=c.key), grpc.StatusCode.INVALID_ARGUMENT,
         "16 bytes"),
        (pb.DeleteSessionRequest(session_id=c.sid, session_key=c.key[:16]), grpc.StatusCode.INVALID_ARGUMENT,
         "32 bytes"),
    ]
    for request, code, fragment in cases:
        with pytest.raises(grpc.RpcError) as info:
            c.stub.DeleteSession(request, timeout=30)
        assert_status(info.value, code, fragment)
        assert c.path.read_bytes() == c.blob
    c.assert_intact_and_usable()
    # The owner's delete works, and then the session is gone for good.
    c.stub.DeleteSession(pb.DeleteSessionRequest(session_id=c.sid, session_key=c.key), timeout=30)
    assert not c.path.exists()
    kinds, err = turn_error(c.stub, [c.open(expected_version=c.version + 1)])
    assert_status(err, grpc.StatusCode.NOT_FOUND)


# -- concurrency ------------------------------------------------------------------------------------
def test_concurrent_open_is_aborted_and_the_first_turn_commits(committed):
    c = committed
    stream = c.session.stream("Write a long story about a cat.", SamplingParams(max_new_tokens=12))
    first = next(stream)  # the SDK's turn is now open on the server, mid-decode
    assert first
    assert c.server.engine.sessions.is_in_turn(c.sid)
    kinds, err = turn_error(c.stub, [c.open()])
    assert_status(err, grpc.StatusCode.ABORTED, "already in a turn")
    with pytest.raises(grpc.RpcError) as info:
        c.stub.DeleteSession(pb.DeleteSessionRequest(session_id=c.sid, session_key=c.key), timeout=30)
    assert_status(info.value, grpc.StatusCode.ABORTED, "in a turn")
    assert c.path.read_bytes() == c.blob
    rest = "".join(stream)  # the first turn carries on and commits
    assert c.session.version == c.version + 1
    assert c.session.last_result.text == first + rest
    assert c.session.last_result.generated_tokens == 12
    assert c.session.last_result.finish_reason == "length"
    assert c.path.read_bytes() != c.blob
    # ... and the session carries on from there.
    after = snapshot(c.server, c.client, c.session)
    after.assert_intact_and_usable()


def test_sdk_wrong_key_leaves_client_state_unchanged(committed):
    c = committed
    real = c.session.key
    c.session.key = secrets.token_bytes(32)
    with pytest.raises(PermissionDenied):
        c.session.chat("Who am I?", SHORT)
    c.assert_client_unchanged()
    c.session.key = real
    c.assert_intact_and_usable()
