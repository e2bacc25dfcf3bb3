"""What actually crosses the wire, seen by a client-side gRPC interceptor.

Only floating-point hidden states of shape [n, hidden_size] travel, only the
turn's new tokens are sent, a decode round trip carrying k drafts is k+1
hidden vectors each way plus framing (one vector without drafts), and what is
sent is in the secret basis, not the model's plain residual stream.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from google.protobuf.unknown_fields import UnknownFieldSet

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.protocol import pb
from infemeral.protocol.tensors import E4M3, EIGHT_BIT, INT8, WIRE_DTYPES, Wire, from_proto

pytestmark = pytest.mark.slow

NEW_TOKENS = 16
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

# Every field a TurnRequest may carry, per message type; anything else is a leak.
ALLOWED = {
    "infemeral.v1.TurnRequest": {"open", "step", "truncate", "commit", "keepalive"},
    # turn ids are 16 random bytes naming a turn; reserve_tokens, evict, cache_length and outputs are counts,
    # not token data
    "infemeral.v1.OpenTurn": {"session_id", "session_key", "expected_version", "bundle_fingerprint", "turn_id",
                              "pending_turn_id", "reserve_tokens"},
    # answer_dtype names a dtype; an 8-bit tensor's scales are its rows' magnitudes, which its values carry anyway
    "infemeral.v1.Step": {"hidden", "cache_length", "outputs", "evict", "answer_dtype"},
    "infemeral.v1.Tensor": {"data", "dtype", "shape", "scale"},
    "infemeral.v1.Truncate": {"tokens", "cache_length"},
    "infemeral.v1.Commit": set(),
    "infemeral.v1.KeepAlive": set(),  # sent while a slow client computes: carries nothing
}


class TurnRecorder(grpc.StreamStreamClientInterceptor):
    """Records every TurnRequest and TurnResponse as the serialized bytes that cross the wire, one list
    per Turn call each way."""

    def __init__(self):
        self.turns: list[list[bytes]] = []
        self.replies: list[list[bytes]] = []

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        method = client_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        if not method.endswith("/Turn"):
            return continuation(client_call_details, request_iterator)
        sent: list[bytes] = []
        received: list[bytes] = []
        self.turns.append(sent)
        self.replies.append(received)

        def tap():
            for request in request_iterator:
                sent.append(request.SerializeToString())
                yield request

        return _RecordedCall(continuation(client_call_details, tap()), received)


class _RecordedCall:
    """The response stream, recording each response's bytes as the client reads it."""

    def __init__(self, call, received: list[bytes]):
        self._call, self._received = call, received

    def __iter__(self):
        return self

    def __next__(self):
        response = next(self._call)
        self._received.append(response.SerializeToString())
        return response

    def __getattr__(self, name):
        return getattr(self._call, name)


PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at six. He trimmed the wick, polished the "
           "great lens until it shone, and wrote the weather in a leather book.")


@pytest.fixture(scope="module")
def recorded(server, bundles):
    """A 2-turn chat (the second quotes the first, so drafts are sent) through a client whose channel records
    every TurnRequest and TurnResponse."""
    recorder = TurnRecorder()
    client = Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[recorder])
    session = client.new_session()
    lengths, results = [], []
    for question in ("Tell me a story about a lighthouse.", f"Repeat this passage exactly:\n\n{PASSAGE}"):
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
        # what the turn may add: its prompt, its answer, and room for the drafts of one step
        assert turn[0].open.reserve_tokens == results[t].prompt_tokens + NEW_TOKENS + SamplingParams().max_draft
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
    assert tensors >= sum(r.round_trips for r in results)


def test_decode_round_trips_stay_within_the_wire_budget(recorded):
    """A round trip with k drafts costs at most (k+1)·2·d·bytes-per-element + 512 bytes (both ways, the
    Truncate of rejected drafts that travels with the step included); one without drafts is byte for byte
    the plain decode step: one vector, no `outputs`."""
    recorder, client, session, results, lengths = recorded
    hidden, itemsize = client.server_info().hidden_size, ITEMSIZE[client.server_info().dtype]
    round_trips = drafted = 0
    for sent, received, result in zip(recorder.turns, recorder.replies, results):
        requests = [pb.TurnRequest.FromString(raw) for raw in sent]
        replies = [pb.TurnResponse.FromString(raw) for raw in received]
        assert len(replies) == len(requests)  # one reply per request, in order
        step_at = [i for i, r in enumerate(requests) if r.WhichOneof("kind") == "step"]
        for i in step_at[len(step_at) - (result.round_trips - 1):]:  # the decode steps, after the prompt's
            step, k = requests[i].step, requests[i].step.hidden.shape[0] - 1
            assert step.outputs == (k + 1 if k else 0)  # every position's output is asked for, or just the last
            reply = replies[i]
            assert reply.WhichOneof("kind") == "step" and reply.step.hidden.shape[0] == k + 1
            truncate = len(sent[i - 1]) if requests[i - 1].WhichOneof("kind") == "truncate" else 0
            truncated = len(received[i - 1]) if truncate else 0
            wire = len(sent[i]) + len(received[i]) + truncate + truncated
            assert wire <= (k + 1) * 2 * hidden * itemsize + 512, f"a round trip with {k} drafts took {wire} bytes"
            assert len(sent[i]) >= (k + 1) * hidden * itemsize  # and it really carries the hidden vectors
            round_trips += 1
            drafted += k
    assert round_trips >= 2 and drafted > 0  # plain steps and steps with drafts were both checked
    assert drafted == sum(r.drafted_tokens for r in results)  # the results count what really went out


def test_second_turn_sends_only_its_new_tokens(recorded):
    recorder, client, session, results, lengths = recorded
    turns = parsed(recorder)
    sent = [sum(s.hidden.shape[0] for s in steps(turn)) for turn in turns]
    first_step = [next(i for i, r in enumerate(turn) if r.WhichOneof("kind") == "step") for turn in turns]
    rewound = [sum(r.truncate.tokens for r in turn[:f] if r.WhichOneof("kind") == "truncate")
               for turn, f in zip(turns, first_step)]
    rejected = [sum(r.truncate.tokens for r in turn[f:] if r.WhichOneof("kind") == "truncate")
                for turn, f in zip(turns, first_step)]
    assert rewound[0] == 0 and rewound[1] == results[1].truncated_tokens
    # how many drafts go out depends on the measured step cost (fewer on a loaded machine), and all of them may be
    # accepted: every rejected one is dropped again, whatever their number
    assert rejected[1] >= results[1].drafted_tokens - results[1].accepted_drafts
    # Turn 1 sends everything it stores; turn 2 only what it adds (plus any re-tokenised tail it replaced);
    # rejected drafts are sent and dropped again.
    assert sent[0] - rejected[0] == lengths[0]
    assert sent[1] - rejected[1] == lengths[1] - lengths[0] + rewound[1]
    assert sent[1] - rejected[1] == (results[1].prompt_tokens + results[1].generated_tokens
                                     - (results[1].finish_reason == "length"))
    assert sum(sent) - sum(rejected) == lengths[1] + rewound[1]  # the history is not resent
    first = steps(turns[1])[0]
    assert first.cache_length == lengths[0] - rewound[1]


def test_hidden_states_are_rotated_not_plain(recorded, reference):
    """The prompt's rows are the model's residual stream after the client's layers, in the secret basis:
    the same norms (an orthogonal map keeps them) but not the same vectors."""
    recorder, client, session, results, lengths = recorded
    model, _ = reference
    turn = parsed(recorder)[0]
    hidden = client.server_info().hidden_size
    prompt_steps = steps(turn)[:len(steps(turn)) - (results[0].round_trips - 1)]  # not the drafts' steps
    sent = torch.cat([from_proto(s.hidden, hidden, 1 << 20) for s in prompt_steps])
    ids = session.history_ids[:sent.shape[0]]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    plain = out.hidden_states[client.server_info().first_layer][0]
    assert plain.shape == sent.shape
    torch.testing.assert_close(sent.norm(dim=-1), plain.norm(dim=-1), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(sent @ sent.T, plain @ plain.T, rtol=1e-3, atol=1e-2)  # same Gram matrix
    cos = torch.nn.functional.cosine_similarity(sent, plain, dim=-1)
    assert cos.abs().max() < 0.5, "sent hidden states are (close to) the plain residual stream"


@pytest.mark.parametrize("wire", ["int8", "int8-up", "e4m3", "e4m3-up"])
def test_the_8bit_wire_sends_a_byte_per_element_and_is_answered_in_the_wire_asked_for(server, bundles, wire):
    recorder = TurnRecorder()
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[recorder],
                wire=wire) as client:
        result = client.generate("Tell me a story about a lighthouse.", SamplingParams(max_new_tokens=4))
        info = client.server_info()
    hidden = info.hidden_size
    requests = [pb.TurnRequest.FromString(raw) for raw in recorder.turns[0]]
    replies = [pb.TurnResponse.FromString(raw) for raw in recorder.replies[0]]
    for i, request in enumerate(requests):
        check_fields(request, f"message {i}")
    code = INT8 if wire.startswith("int8") else E4M3
    answer = code if wire in ("int8", "e4m3") else info.dtype
    sent_rows = 0
    for s in steps(requests):
        rows = s.hidden.shape[0]
        assert s.hidden.dtype == code and len(s.hidden.data) == rows * hidden and len(s.hidden.scale) == rows
        assert s.answer_dtype == ("" if answer == code else info.dtype)
        sent_rows += rows
    assert sent_rows >= result.prompt_tokens
    answers = [r.step.hidden for r in replies if r.WhichOneof("kind") == "step"]
    assert answers and {a.dtype for a in answers} == {answer}
    assert all(len(a.scale) == (a.shape[0] if answer in EIGHT_BIT else 0) for a in answers)


@pytest.mark.parametrize("wire", ["int8", "int8-up"])
def test_over_the_int8_wire_greedy_decoding_gives_the_exact_wires_tokens(server, bundles, wire):
    """Rounded to 255 levels per token, the prompt (and with int8 the answers) still lead the float32 server to the
    exact wire's greedy tokens on the default model: the wire is encoded, decoded and answered as it should be."""
    prompt, params = "Tell me a story about a lighthouse.", SamplingParams(max_new_tokens=12, speculate="off")
    tokens = {}
    for mode in ("server", wire):
        recorder = TurnRecorder()
        with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[recorder],
                    wire=mode) as client:
            tokens[mode] = client.generate(prompt, params).token_ids
            assert client.wire == Wire.choose(mode, "float32")
        sent = {s.hidden.dtype for s in steps([pb.TurnRequest.FromString(raw) for raw in recorder.turns[0]])}
        assert sent == ({INT8} if mode == wire else {"float32"})
    assert len(tokens["server"]) == 12 and tokens[wire] == tokens["server"]
