"""The batched engine with the real default model: many sessions at once, exactly as alone."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tests.conftest import start_server
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.errors import ResourceExhausted
from infemeral.protocol import pb, pb_grpc

pytestmark = pytest.mark.slow

PROMPTS = [
    "Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Name a planet.", "What colour is the sky?",
    "Give me a word that rhymes with cat.", "What is the capital of Spain?", "Name an ocean.",
    "How many legs does a spider have?", "Name a musical instrument.", "What do bees make?",
    "Name a programming language.", "What is ice made of?", "Name a large animal.",
    "What is the opposite of hot?", "Say something kind.",
]
PARAMS = SamplingParams(max_new_tokens=12)


def test_sixteen_concurrent_clients_get_exactly_their_solo_tokens(bundles, tmp_path):
    # With batch holding on (the pacer): it may only change when a batch starts, never what anyone gets.
    srv = start_server(bundles, tmp_path / "store", max_batch_hold=0.05)
    clients = [Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=300) for _ in range(4)]
    try:
        solo = [clients[0].new_session().chat(p, PARAMS).token_ids for p in PROMPTS]
        assert srv.engine.stats["largest_batch"] == 1
        results: dict[int, list[int]] = {}
        errors = []
        start = threading.Barrier(len(PROMPTS))

        def run(i: int) -> None:
            try:
                session = clients[i % len(clients)].new_session()
                start.wait()
                results[i] = session.chat(PROMPTS[i], PARAMS).token_ids
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert [results[i] for i in range(len(PROMPTS))] == solo
        assert srv.engine.stats["largest_batch"] >= 4  # steps of several sessions really shared a forward pass
        assert srv.engine.pool.free_pages == srv.engine.pool.num_pages  # every page came back
    finally:
        for c in clients:
            c.close()
        srv.stop(0)


def test_full_pool_makes_new_turns_wait_then_refuse_with_a_retry_hint(bundles, tmp_path):
    # 6 pages of 16 tokens; one paused conversation was granted all of them (its prompt + answer).
    srv = start_server(bundles, tmp_path / "store", kv_pool_tokens=96, admission_wait=1.0, max_context=96,
                       page_size=16)
    client = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=120)
    long_prompt = "Please write a short story about a lighthouse keeper, a storm, a lost ship and a cat " * 2
    pool = srv.engine.pool
    try:
        short_alone = client.new_session().chat("Name a colour.", PARAMS).token_ids
        long_alone = client.new_session().chat(long_prompt, PARAMS).token_ids
        hog = client.new_session()
        hog_stream = hog.stream(long_prompt, PARAMS)
        next(hog_stream)  # the hog's turn is open and holds its pages, mid-decode
        assert pool.spare_pages == 0 and pool.free_pages == 1  # one page is free but promised to the hog

        # A new turn waits (bounded) for pages, then gets RESOURCE_EXHAUSTED with a retry hint (the SDK retries
        # within its timeout: a short one gives up after the first refusal).
        started = time.monotonic()
        with Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=2) as impatient:
            with pytest.raises(ResourceExhausted, match="retry"):
                impatient.new_session().chat("Name a colour.", PARAMS)
        assert time.monotonic() - started >= 0.9
        stub = pb_grpc.InfemeralStub(client.channel)
        requests = [pb.TurnRequest(open=pb.OpenTurn(session_id=b"\1" * 16, session_key=b"\2" * 32,
                                                    bundle_fingerprint=client.bundle.server_fingerprint)),
                    pb.TurnRequest(step=pb.Step(hidden=pb.Tensor(data=b"\0" * 576 * 4 * 40, dtype="float32",
                                                                 shape=[40, 576]), cache_length=0))]
        call = stub.Turn(iter(requests), timeout=60)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in info.value.details()
        assert int(dict(call.trailing_metadata())["retry-after-ms"]) > 0
        assert pool.spare_pages == 0 and pool.free_pages == 1  # refused turns took nothing

        # The running turn was not disturbed: exactly the tokens it gets alone.
        "".join(hog_stream)
        assert hog.last_result.token_ids == long_alone
        assert client.new_session().chat("Name a colour.", PARAMS).token_ids == short_alone
        assert pool.free_pages == pool.num_pages and pool.promised_pages == 0
    finally:
        client.close()
        srv.stop(0)
