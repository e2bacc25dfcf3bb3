"""What actually crosses the wire, seen by a client-side gRPC interceptor.

Only floating-point hidden states of shape [n, hidden_size] travel, only the
turn's new tokens are sent, a decode step is one hidden vector plus framing,
and what is sent is in the secret basis, not the model's plain residual stream.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from google.protobuf.unknown_fields import UnknownFieldSet

from infemeral.client.sampling import SamplingParams
from infemeral.client.sdk import Client
from infemeral.protocol import pb
from infemeral.protocol.tensors import WIRE_DTYPES, from_proto

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

# Every field a TurnRequest may carry, per message type; anything else is a leak.
ALLOWED = {
    "infemeral.v1.TurnRequest": {"open", "step", "truncate", "commit"},
    # turn ids are 16 random bytes naming a turn; reserve_tokens, evict and cache_length are counts, not token data
    "infemeral.v1.OpenTurn": {"session_id", "session_key", "expected_version", "bundle_fingerprint", "turn_id",
                              "pending_turn_id", "reserve_tokens"},
    "infemeral.v1.Step": {"hidden", "cache_length", "outputs", "evict"},
    "infemeral.v1.Tensor": {"data", "dtype", "shape"},
    "infemeral.v1.Truncate": {"tokens", "cache_length"},
    "infemeral.v1.Commit": set(),
}


class TurnRecorder(grpc.StreamStreamClientInterceptor):
    """Records every TurnRequest as the serialized bytes that go on the wire, one list per Turn call."""

    def __init__(self):
        self.turns: list[list[bytes]] = []

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        if not method.endswith("/Turn"):
            return continuation(client_call_details, request_iterator)
        sent: list[bytes] = []
        self.turns.append(sent)

        def tap():
            for request in request_iterator:
                sent.append(request.SerializeToString())
                yield request

        return continuation(client_call_details, tap())


@pytest.fixture(scope="module")
def recorded(server, bundles):
    """A 2-turn chat through a client whose channel records every TurnRequest."""
    recorder = TurnRecorder()
    client = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[recorder])
    session = client.new_session()
    lengths, results = [], []
    for question in ("Tell me a story about a lighthouse.", "What happened next?"):
        results.append(session.chat(question, SamplingParams(max_new_tokens=NEW_TOKENS)))
        lengths.append(len(session.history_ids))
    yield recorder, client, session, results, lengths
    client.close()


def parsed(recorder: TurnRecorder) -> list[list[pb.TurnRequest]]:
    return [[pb.TurnRequest.FromString(raw) for raw in turn] for turn in recorder.turns]


def check_fields(message, path: str = "") -> None:
    name = message.DESCRIPTOR.full_name
    assert name in ALLOWED, f"{path}: unexpected message type {name}"
    assert len(UnknownFieldSet(message)) == 0, f"{path}: unknown fields on the wire"
    for field, value in message.ListFields():
        assert field.name in ALLOWED[name], f"{path}: {name}.{field.name} is not allowed on the wire"
        if field.message_type is not None:
            check_fields(value, f"{path}.{field.name}")


def steps(turn: list[pb.TurnRequest]) -> list[pb.Step]:
    return [r.step for r in turn if r.WhichOneof("kind") == "step"]


def test_only_turn_fields_and_float_hidden_states(recorded):
    recorder, client, session, results, lengths = recorded
    hidden = client.server_info().hidden_size
    turns = parsed(recorder)
    assert len(turns) == 2
    tensors = 0
    for t, turn in enumerate(turns):
        kinds = [r.WhichOneof("kind") for r in turn]
        assert kinds[0] == "open" and kinds[-1] == "commit"
        assert set(kinds[1:-1]) <= {"step", "truncate"}
        for i, request in enumerate(turn):
            check_fields(request, f"turn {t} message {i}")
            assert request.WhichOneof("kind") is not None
        assert turn[0].open.expected_version == t
        assert turn[0].open.reserve_tokens == results[t].prompt_tokens + NEW_TOKENS  # what the turn may add
        assert len(turn[0].open.session_id) == 16 and len(turn[0].open.session_key) == 32
        for s in steps(turn):
            x = s.hidden
            assert x.dtype in WIRE_DTYPES  # float32 / float16 / bfloat16, never an integer type
            assert x.dtype == client.server_info().dtype
            assert len(x.shape) == 2 and x.shape[0] >= 1 and x.shape[1] == hidden
            assert len(x.data) == x.shape[0] * hidden * ITEMSIZE[x.dtype]
            values = from_proto(x, hidden, 1 << 20, "sent")
            assert values.is_floating_point()
            assert not torch.equal(values, values.round()), "hidden states look like integers (token ids?)"
            tensors += 1
    assert tensors >= 2 * (NEW_TOKENS - 1)


def test_decode_steps_are_one_vector_plus_framing(recorded):
    recorder, client, session, results, lengths = recorded
    hidden = client.server_info().hidden_size
    limit = 2 * hidden * 4 + 512
    decode = [raw for turn in recorder.turns for raw in turn
              if (r := pb.TurnRequest.FromString(raw)).WhichOneof("kind") == "step" and r.step.hidden.shape[0] == 1]
    assert len(decode) >= 2 * (NEW_TOKENS - 1)  # every sampled token but the last of each turn
    sizes = [len(raw) for raw in decode]
    assert max(sizes) <= limit, f"a decode step is {max(sizes)} bytes on the wire, over {limit}"
    assert min(sizes) >= hidden * 4  # and it really carries the hidden vector


def test_second_turn_sends_only_its_new_tokens(recorded):
    recorder, client, session, results, lengths = recorded
    turns = parsed(recorder)
    sent = [sum(s.hidden.shape[0] for s in steps(turn)) for turn in turns]
    dropped = [sum(r.truncate.tokens for r in turn if r.WhichOneof("kind") == "truncate") for turn in turns]
    assert dropped[0] == 0 and dropped[1] == results[1].truncated_tokens
    # Turn 1 sends everything it stores; turn 2 only what it adds (plus any re-tokenised tail it replaced).
    assert sent[0] == lengths[0]
    assert sent[1] == lengths[1] - lengths[0] + dropped[1]
    assert sent[1] == results[1].prompt_tokens + results[1].generated_tokens - (results[1].finish_reason == "length")
    assert sent[1] < lengths[0]  # the history is not resent
    assert sum(sent) == lengths[1] + dropped[1]
    first = steps(turns[1])[0]
    assert first.cache_length == lengths[0] - dropped[1]


def test_hidden_states_are_rotated_not_plain(recorded, reference):
    """The prompt's rows are the model's residual stream after the client's layers, in the secret basis:
    the same norms (an orthogonal map keeps them) but not the same vectors."""
    recorder, client, session, results, lengths = recorded
    model, _ = reference
    turn = parsed(recorder)[0]
    hidden = client.server_info().hidden_size
    sent = torch.cat([from_proto(s.hidden, hidden, 1 << 20) for s in steps(turn)])
    ids = session.history_ids[:sent.shape[0]]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    plain = out.hidden_states[client.server_info().first_layer][0]
    assert plain.shape == sent.shape
    torch.testing.assert_close(sent.norm(dim=-1), plain.norm(dim=-1), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(sent @ sent.T, plain @ plain.T, rtol=1e-3, atol=1e-2)  # same Gram matrix
    cos = torch.nn.functional.cosine_similarity(sent, plain, dim=-1)
    assert cos.abs().max() < 0.5, "sent hidden states are (close to) the plain residual stream"
