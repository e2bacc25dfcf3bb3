"""A prompt goes up in steps sent without waiting (docs/design.md §4): the answer does not change, the steps fit
the link and the window, progress is reported, and a turn cancelled mid-upload leaves the session as it was.

The pipelining itself runs on a tiny model against an in-process pod (the served layers behind a stream-like
object, answering in order as a server does), so that several steps, a window slide and the replies' checks
cost well under a second; the cancel and the server's read-ahead run against the real server.
"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
import torch

from infemeral.client.sampling import SamplingParams
from infemeral.client.turn_link import TurnLink
from infemeral.client import upload
from infemeral.client.upload import ChunkSizer, UploadProgress, free_tokens
from infemeral.errors import Aborted
from infemeral.kvcache.window import WindowPolicy, apply_window
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import Wire, from_proto, to_proto
from tests.cloak.test_tiny_models import CONFIGS, build, plain_logits, prepared, token_ids

MAX_CONTEXT, SINKS, PAGE = 48, 4, 4


# -- the plan: sizes, limits, where the window slides ----------------------------------------------
def window(enabled: bool = True) -> WindowPolicy:
    return WindowPolicy(MAX_CONTEXT, SINKS, PAGE, enabled=enabled)


def sizes(sizer: ChunkSizer, rate: float | None = None) -> list[int]:
    """Every step's size for one prompt; with `rate` (tokens a second), as if each step were answered at it."""
    out, sent = [], 0
    while sent < sizer.total:
        out.append(sizer.next(sent))
        sent += out[-1]
        if rate is not None:
            sizer.measured(sent, sent / rate)
    return out


def test_steps_that_would_slide_the_window_are_whole_steps_of_max_chunk():
    max_chunk = window().max_step  # 44
    # onto 10 tokens: the first step of 44 would reach 54 > 48, so it and every later one are whole steps
    assert free_tokens(10, 100, window(), max_chunk) == 0
    # onto nothing: 44 tokens fit, the next 44 would not
    assert free_tokens(0, 100, window(), max_chunk) == 44
    assert free_tokens(0, 40, window(), max_chunk) == 40
    assert free_tokens(30, 100, window(enabled=False), max_chunk) == 100  # no window: nothing slides
    sizer = ChunkSizer(100, 44, max_chunk, bytes_per_token=upload.FIRST_CHUNK_BYTES // 3)
    steps = sizes(sizer)
    assert sum(steps) == 100 and steps[-2:] == [44, 12]  # from token 44 on: the steps of max_chunk
    assert steps[:4] == [3, 3, 3, 3]  # the first size until the pod has answered


@pytest.mark.parametrize("rate", [200.0, 20_000.0])
def test_step_sizes_follow_the_measured_rate_within_the_limits(rate):
    max_chunk = 2048
    sizer = ChunkSizer(20_000, 20_000, max_chunk, bytes_per_token=upload.FIRST_CHUNK_BYTES // 16)
    steps = sizes(sizer, rate)
    assert sum(steps) == 20_000 and steps[0] == 16
    assert max(steps) <= max_chunk and min(steps[:-1]) >= 16
    assert all(b <= 2 * a for a, b in zip(steps, steps[1:]))  # grows at most twofold a step
    want = min(max_chunk, max(16, int(rate * upload.CHUNK_SECONDS)))
    settled = steps[len(steps) // 2:-(want // 16).bit_length() - 2]  # before the end's halving
    assert settled and all(abs(s - want) <= 1 for s in settled), (want, steps)
    assert max(steps[-2:]) <= 16  # the pod's work after the last byte is one small step


# -- pipelining against an in-process pod ------------------------------------------------------------
class InProcessPod:
    """The served layers behind a TurnStream's interface: requests queue up as on the wire, and each `receive`
    answers the oldest one, checked as the engine checks it (cache length, eviction)."""

    def __init__(self, stack, inv_freq: torch.Tensor, hidden_size: int, policy: WindowPolicy):
        self.stack, self.inv_freq, self.hidden_size, self.window = stack, inv_freq, hidden_size, policy
        self.cache = stack.new_cache()
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.steps: list[int] = []  # the size of every step answered, in order
        self.corrupt_step: int | None = None  # answer this step with the wrong cache length
        self.hold_replies_until = 0  # answer nothing before this many tokens were sent (a link that holds them)
        self.tokens_sent = 0
        self._sent = threading.Condition()

    def send(self, request: pb.TurnRequest) -> None:
        with self._sent:
            self.tokens_sent += request.step.hidden.shape[0]
            self._sent.notify_all()
        self.requests.put(request)

    def receive(self, expect: str):
        with self._sent:
            assert self._sent.wait_for(lambda: self.tokens_sent >= self.hold_replies_until, timeout=10), \
                f"the client waited for a reply before sending the rest ({self.tokens_sent} tokens sent)"
        step = self.requests.get(timeout=30).step
        hidden = from_proto(step.hidden, self.hidden_size, 10**6)
        assert step.cache_length == self.cache.length, "steps answered out of order"
        evict = apply_window(self.cache, self.window, hidden.shape[0], self.inv_freq)
        assert evict == step.evict
        with torch.no_grad():
            out = self.stack(hidden, self.cache)[-(step.outputs or 1):]
        self.steps.append(hidden.shape[0])
        length = self.cache.length + (len(self.steps) == self.corrupt_step)
        return pb.StepResult(hidden=to_proto(out), cache_length=length, evicted=evict)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = build(CONFIGS["llama-bias"](), seed=7)
    client, server = prepared(model, tmp_path_factory.mktemp("tiny"))
    return model, client, server


def link_for(tiny, policy: WindowPolicy) -> tuple[TurnLink, InProcessPod]:
    _, client, server = tiny
    pod = InProcessPod(server, client.inv_freq, client.hidden_size, policy)
    info = pb.ServerInfo(max_step_tokens=2048, max_context=policy.max_context, sink_tokens=policy.sink_tokens,
                         page_size=policy.page_size, window=policy.enabled)
    return TurnLink(client, client.new_cache(), [], pod, info, Wire("float32")), pod


def reference_prefill(tiny, policy: WindowPolicy, ids: list[int]) -> tuple[torch.Tensor, object]:
    """The prompt through both halves one step of max_chunk at a time, waiting for each: the old way."""
    _, client, server = tiny
    chunk = policy.max_step
    client_cache, server_cache = client.new_cache(), server.new_cache()
    with torch.no_grad():
        for i in range(0, len(ids), chunk):
            part = ids[i:i + chunk]
            for cache in (client_cache, server_cache):
                apply_window(cache, policy, len(part), client.inv_freq)
            residual = server(client.cloak(part, client_cache), server_cache)
    return client.logits(residual)[-1], client_cache


def cache_tensors(cache) -> list[torch.Tensor]:
    return [t[..., :cache.length, :] for slot in range(cache.num_layers) for t in cache.layer_tensors(slot)]


@pytest.mark.parametrize("prompt", [40, 130])
def test_a_pipelined_prompt_answers_as_one_step_at_a_time(tiny, monkeypatch, prompt):
    """Steps of 3 tokens and more, all sent before the first reply, give the logits and caches of the old
    max_chunk steps; the 130-token prompt slides the window twice (in the steps of max_chunk it then goes up in)."""
    monkeypatch.setattr(upload, "FIRST_CHUNK_BYTES", 3 * 64 * 4)  # 3 tokens of the tiny model in float32
    monkeypatch.setattr(upload, "MAX_IN_FLIGHT", 64)  # room for every step before the first reply
    policy = window()
    ids = token_ids(prompt, seed=8)
    link, pod = link_for(tiny, policy)
    pod.hold_replies_until = prompt  # every step goes up before the first reply comes
    seen: list[UploadProgress] = []
    with torch.no_grad():
        logits = link.prefill(ids, on_progress=seen.append)
    expected, expected_cache = reference_prefill(tiny, policy, ids)
    assert len(pod.steps) >= 4 and pod.steps[0] == 3
    assert (logits - expected).abs().max().item() < 1e-4
    assert torch.equal(logits.argmax(), expected.argmax())
    assert link.ids == ids and link.cache.length == expected_cache.length == pod.cache.length
    for got, want in zip(cache_tensors(link.cache), cache_tensors(expected_cache), strict=True):
        assert (got - want).abs().max().item() < 1e-4
    assert (link.num_evicted > 0) == (prompt > MAX_CONTEXT)
    if prompt <= MAX_CONTEXT:  # no slide: the plain model's own logits
        assert (logits - plain_logits(tiny[0], ids)[-1]).abs().max().item() < 1e-4
    # progress: one report per step, counting up to the totals
    assert [p.tokens_sent for p in seen] == [sum(pod.steps[:i + 1]) for i in range(len(pod.steps))]
    assert all(p.tokens_total == prompt and p.bytes_total == prompt * 64 * 4 for p in seen)
    assert all(a.seconds <= b.seconds and a.bytes_sent < b.bytes_sent for a, b in zip(seen, seen[1:]))
    assert seen[-1].bytes_sent == seen[-1].bytes_total and seen[-1].is_done
    assert all(p.rate > 0 and p.seconds_left is not None for p in seen)


def test_a_wrong_reply_mid_pipeline_ends_the_prefill(tiny, monkeypatch):
    """Replies read after the steps went up are checked as before: a wrong cache length in the third is refused."""
    monkeypatch.setattr(upload, "FIRST_CHUNK_BYTES", 3 * 64 * 4)
    link, pod = link_for(tiny, window())
    pod.corrupt_step = 3
    with pytest.raises(Aborted, match="server cache length"), torch.no_grad():
        link.prefill(token_ids(40, seed=9))
    assert len(link.ids) == sum(pod.steps[:2])  # the two steps answered before it


# -- against the real server ---------------------------------------------------------------------------
def state(session) -> tuple:
    cache = session.cache
    return (session.version, list(session.history_ids), list(session.messages), cache.length,
            cache.committed_length, [t.clone() for t in cache_tensors(cache)])


class StopUpload(Exception):
    pass


@pytest.mark.slow
def test_a_turn_cancelled_mid_upload_leaves_the_session_as_it_was(client, monkeypatch):
    """The progress callback raises after the pod answered the first steps: the session (version, ids, transcript,
    cache by content) is what it was, and its next turn answers as a session that never began the cancelled one."""
    monkeypatch.setattr(upload, "FIRST_CHUNK_BYTES", 4 * client.model.hidden_size * 4)  # 4 tokens in float32
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, speculate="off")
    session, reference = client.new_session(), client.new_session()
    for s in (session, reference):
        s.chat("Name a colour.", greedy)
    before = state(session)
    seen = []

    def cancel(progress):
        seen.append(progress)
        if len(seen) == 2:
            raise StopUpload

    with pytest.raises(StopUpload):
        session.chat("Tell me about the history of the lighthouse at Alexandria, in some detail. " * 3, greedy,
                     on_progress=cancel)
    assert seen[-1].tokens_sent < seen[-1].tokens_total  # stopped mid-upload
    after = state(session)
    assert after[:5] == before[:5] and session.pending_commit is None
    for got, want in zip(after[5], before[5], strict=True):
        assert torch.equal(got, want)
    result = session.chat("And a fruit?", greedy)
    assert result.token_ids == reference.chat("And a fruit?", greedy).token_ids
    assert session.version == 2 and session.history_ids == reference.history_ids


def raw_step(hidden: torch.Tensor, cache_length: int) -> pb.TurnRequest:
    return pb.TurnRequest(step=pb.Step(hidden=to_proto(hidden), cache_length=cache_length))


@pytest.mark.slow
def test_the_server_answers_queued_steps_in_order_and_a_bad_one_costs_nothing_committed(client):
    """Three steps sent at once are answered in order, as the same steps sent one at a time; a malformed one
    between good ones fails the turn with INVALID_ARGUMENT after the good one before it, and the session
    stays at its committed version and length."""
    stub = pb_grpc.InfemeralStub(client.channel)
    session = client.new_session()
    session.chat("Hi", SamplingParams(max_new_tokens=2, speculate="off"))
    length = session.cache.length
    cache = session.cache.clone()
    parts = [token_ids(5, seed=s) for s in (1, 2, 3)]
    with torch.no_grad():
        hidden = [client.model.cloak(p, cache) for p in parts]

    def open_turn() -> pb.TurnRequest:
        return pb.TurnRequest(open=pb.OpenTurn(session_id=session.id, session_key=session.key,
                                               expected_version=session.version,
                                               bundle_fingerprint=client.bundle.server_fingerprint))

    steps = [raw_step(h, length + 5 * i) for i, h in enumerate(hidden)]
    queued = [r.step for r in list(stub.Turn(iter([open_turn(), *steps]), timeout=60))[1:]]
    assert [r.cache_length for r in queued] == [length + 5, length + 10, length + 15]
    requests = queue.SimpleQueue()  # the same steps, each sent after the last one's reply
    requests.put(open_turn())
    call = stub.Turn(iter(requests.get, None), timeout=60)
    next(call)
    one_by_one = []
    for request in steps:
        requests.put(request)
        one_by_one.append(next(call).step)
    requests.put(None)
    list(call)
    for got, want in zip(queued, one_by_one, strict=True):
        assert got.hidden == want.hidden

    bad = pb.TurnRequest(step=pb.Step(hidden=pb.Tensor(data=b"\0" * 12, dtype="float32", shape=[1, 3]),
                                      cache_length=length + 5))
    call = stub.Turn(iter([open_turn(), steps[0], bad, steps[2]]), timeout=60)
    kinds = []
    with pytest.raises(grpc.RpcError) as failed:
        for response in call:
            kinds.append(response.WhichOneof("kind"))
    assert kinds == ["opened", "step"]
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hidden size" in failed.value.details()
    opened = list(stub.Turn(iter([open_turn()]), timeout=60))[0].opened
    assert (opened.version, opened.cache_length) == (session.version, length)
