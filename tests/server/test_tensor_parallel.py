"""Tensor parallelism (docs/design.md §14) on the CPU: gloo ranks in separate processes, the test process as rank 0.

The sharding itself is checked without processes (the ranks as threads summing their partial outputs);
then 2 ranks serve tiny random Llama and Qwen2 models with even head counts, and 3 ranks the default model
(9 heads, 3 KV heads), against a single-rank server: the same answers, sessions that move between rank
counts, window slides, truncations, batches of sessions; then ranks that die or hang. The all-reduces sum
the partial outputs in another order than one matrix product does, so outputs are compared within a
tolerance and greedy tokens for equality, never bits. Each rank uses one torch thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import queue
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import psutil
import pytest
import torch
from tests.conftest import free_port, start_server, wait_serving
from tests.cloak.test_tiny_models import CONFIGS, build

from infemeral.cloak.bundle import ClientBundle, ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.client_half.half import ClientModel
from infemeral.errors import Unavailable
from infemeral.kvcache.window import WindowPolicy, apply_window
from infemeral.layers.stack import LayerStack
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import to_proto
from infemeral.server.config import EngineConfig
from infemeral.server.engine import Engine
from infemeral.server.parallel.driver import RankFailure, TensorParallel
from infemeral.server.parallel.shard import Shard, ShardedBundle, attach_all_reduce, check_divisible, shard_layer
from infemeral.storage.directory import DirectoryStore

WINDOW = WindowPolicy(576, sink_tokens=4, page_size=16)
CONFIG = EngineConfig(device="cpu", dtype="float32", window=WINDOW, kv_pool_tokens=8192, max_step_tokens=512)
OUTPUT_TOLERANCE = 1e-4  # |residual| differences between rank counts (fp32; values of order 10)
LOGIT_TOLERANCE = 1e-3


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread per rank (the ranks started here copy this process's count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def prepared(family: str, out: Path, seed: int = 7):
    model = build(CONFIGS[family](), seed=seed)
    b = prepare(output=out, source=ModelSource(model), progress=False)
    return ServerBundle.open(b.server_dir), ClientModel(ClientBundle.open(b.client_dir))


def random_ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Conversation:
    """One session driven straight through an engine, as the SDK drives it: the client's own layer cache
    (with the same window), cloaked steps, greedy tokens from the logits."""

    def __init__(self, client: ClientModel, session_id: bytes, key: bytes = b"k" * 32):
        self.client, self.session_id, self.key = client, session_id, key
        self.cache = client.new_cache()
        self.version = 0
        self.engine = self.turn = None

    def open(self, engine: Engine) -> None:
        self.engine = engine
        self.turn = engine.open_turn(self.session_id, self.key, self.version, engine.bundle.fingerprint,
                                     reserve_tokens=WINDOW.max_context)
        assert self.turn.cache.length == self.cache.length

    def submit(self, ids: list[int], outputs: int = 1):
        before = self.cache.length
        evict = WINDOW.tokens_to_evict(before, len(ids))
        if evict:
            apply_window(self.cache, WINDOW, len(ids), self.client.inv_freq)
        hidden = self.client.cloak(ids, self.cache)
        return self.engine.submit_step(self.turn, hidden, before, outputs, evict)

    def step(self, ids: list[int], outputs: int = 1) -> torch.Tensor:
        return self.submit(ids, outputs).result().hidden

    def greedy(self, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        tokens, residuals = [], []
        for _ in range(n):
            residual = self.step(ids)
            residuals.append(residual)
            ids = [int(self.client.logits(residual)[-1].argmax())]
            tokens.append(ids[0])
        return tokens, torch.cat(residuals)

    def truncate(self, n: int) -> None:
        self.engine.truncate(self.turn, n, self.cache.length)
        self.cache.truncate(n)

    def commit(self) -> None:
        self.version = self.engine.commit(self.turn)
        self.cache.commit()
        self.engine.close_turn(self.turn)


def agreement(client: ClientModel, a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, largest logit difference) of two residuals [n, d] through the client's head."""
    la, lb = client.logits(a), client.logits(b)
    return float((la.argmax(-1) == lb.argmax(-1)).float().mean()), float((la - lb).abs().max())


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# -- the sharding, without processes ---------------------------------------------------------------
def test_head_counts_that_do_not_divide_are_refused_in_one_line():
    from transformers import LlamaConfig

    default_like = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    check_divisible(default_like, 3)
    with pytest.raises(ValueError) as info:
        check_divisible(default_like, 2)
    message = str(info.value)
    assert "\n" not in message and "9 attention heads and 3 KV heads" in message and "1, 3" in message
    with pytest.raises(ValueError, match="8 attention heads and 2 KV heads"):
        check_divisible(LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2), 4)


def test_shards_put_back_together_are_the_layer(tmp_path):
    bundle, _ = prepared("llama-bias", tmp_path)
    full = bundle.layer_weights(bundle.first_layer)
    shards = [shard_layer(full, bundle.config, Shard(r, 2)) for r in range(2)]
    for name, t in full.items():
        if name.startswith(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                            "mlp.up_proj")):
            assert torch.equal(torch.cat([s[name] for s in shards], dim=0), t), name  # output rows
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat([s[name] for s in shards], dim=1), t), name  # input columns
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            assert torch.equal(shards[0][name], t) and not shards[1][name].any(), name  # added once
        else:
            assert all(torch.equal(s[name], t) for s in shards), name  # norms: replicated


class ThreadRanks:
    """Ranks as threads of this process: an all-reduce sums their partial outputs in rank order."""

    def __init__(self, world: int):
        self.world, self.parts, self.barrier = world, [None] * world, threading.Barrier(world)

    def all_reduce(self, rank: int):
        def reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            return t.copy_(total)
        return reduce

    def run(self, fn) -> list:
        out = [None] * self.world
        threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, fn(r))) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_sharded_layers_compute_the_whole_layers(family, tmp_path):
    """Every supported family (biases, tied heads, Qwen3's q/k norms, native sliding windows): each rank's
    heads and MLP columns, summed after o_proj and down_proj, give what the whole layers give."""
    bundle, _ = prepared(family, tmp_path)

    def stack(b) -> LayerStack:
        first = b.first_layer
        return LayerStack(b.config, first, [b.layer_weights(i) for i in range(first, first + b.num_layers)])

    whole, ranks = stack(bundle), ThreadRanks(2)
    shards = [stack(ShardedBundle(bundle, Shard(r, 2))) for r in range(2)]
    for r, s in enumerate(shards):
        attach_all_reduce(s, ranks.all_reduce(r))
    x = torch.randn(12, bundle.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cache = whole.new_cache()
    expected = torch.cat([whole(x, cache), whole(x[:3], cache)])  # a prompt, then a step of three tokens

    def run(rank: int) -> torch.Tensor:
        c = shards[rank].new_cache()
        return torch.cat([shards[rank](x, c), shards[rank](x[:3], c)])

    outs = ranks.run(run)
    assert torch.equal(outs[0], outs[1])  # the residual stream is the same on every rank
    assert largest_difference(outs[0], expected) < OUTPUT_TOLERANCE


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32)])
def test_quantized_layers_shard_the_same_way(scheme, group_size, tmp_path):
    """int8 codes with per-row scales and int4 codes with per-group scales and zeros are cut by the same output
    rows and input columns as dense weights: the ranks' partial sums give what the whole quantized layers give."""
    from infemeral.quant.served import load_stack

    model = build(CONFIGS["llama-bias"](), seed=7)
    b = prepare(output=tmp_path, source=ModelSource(model), progress=False, server_quant=scheme,
                group_size=group_size, quant_method="rtn")
    bundle, ranks = ServerBundle.open(b.server_dir), ThreadRanks(2)
    whole = load_stack(bundle, torch.float32)
    shards = [load_stack(ShardedBundle(bundle, Shard(r, 2)), torch.float32) for r in range(2)]
    for r, s in enumerate(shards):
        attach_all_reduce(s, ranks.all_reduce(r))
    x = torch.randn(12, bundle.config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = whole(x, whole.new_cache())
    outs = ranks.run(lambda r: shards[r](x, shards[r].new_cache()))
    assert largest_difference(outs[0], expected) < OUTPUT_TOLERANCE


# -- two gloo ranks, tiny random models --------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama-bias", "qwen2"])
def two_ranks(request, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    bundle, client = prepared(request.param, tmp_path_factory.mktemp(request.param))
    tp = TensorParallel.start(bundle, CONFIG, 2, timeout=60)
    torch.set_num_threads(threads)
    yield SimpleNamespace(family=request.param, bundle=bundle, client=client, tp=tp)
    tp.close()


def test_two_ranks_serve_what_one_rank_serves(two_ranks, tmp_path):
    """A 512-token prompt, greedy decoding, a commit; then each session reopens on the other rank count
    (1 -> 2 and 2 -> 1) and goes on past the window (evictions re-rotate every rank's keys), through a
    truncation, to another commit."""
    bundle, client, tp = two_ranks.bundle, two_ranks.client, two_ranks.tp
    one = Engine(bundle, DirectoryStore(tmp_path / "one"), CONFIG)
    two = Engine(bundle, DirectoryStore(tmp_path / "two"), CONFIG, runner=tp.runner)
    engines = [one, two]
    a, b = Conversation(client, b"a" * 16), Conversation(client, b"a" * 16)  # the same session, two stores
    try:
        a.open(one)
        b.open(two)
        prompt = random_ids(512, seed=1)
        ra, rb = a.step(prompt, outputs=512), b.step(prompt, outputs=512)
        top1, logit_diff = agreement(client, ra, rb)
        print(f"\n{two_ranks.family}: 2 ranks vs 1 over 512 positions: top-1 agreement {top1:.4f}, largest logit "
              f"difference {logit_diff:.2e}, largest residual difference {largest_difference(ra, rb):.2e}")
        assert top1 == 1.0 and logit_diff < LOGIT_TOLERANCE
        first = [int(client.logits(ra)[-1].argmax())]
        (ta, ga), (tb, gb) = a.greedy(first, 8), b.greedy(first, 8)
        assert ta == tb and largest_difference(ga, gb) < OUTPUT_TOLERANCE
        a.commit()
        b.commit()

        # Swap: the session one rank committed reopens on two ranks, and the other way round.
        one.stop()
        two.stop()
        one_again = Engine(bundle, DirectoryStore(tmp_path / "two"), CONFIG)
        two_again = Engine(bundle, DirectoryStore(tmp_path / "one"), CONFIG, runner=tp.runner)
        engines += [one_again, two_again]
        a.open(two_again)  # 1 -> 2
        b.open(one_again)  # 2 -> 1
        evicted_before = a.turn.cache.length
        for i in range(3):
            chunk = random_ids(48, seed=10 + i)
            assert largest_difference(a.step(chunk, outputs=48), b.step(chunk, outputs=48)) < OUTPUT_TOLERANCE
        assert a.turn.cache.length < evicted_before + 3 * 48  # the window slid
        a.truncate(5)
        b.truncate(5)
        (ta, ga), (tb, gb) = a.greedy([ta[-1]], 8), b.greedy([tb[-1]], 8)
        assert ta == tb and largest_difference(ga, gb) < OUTPUT_TOLERANCE
        held = list(a.turn.cache.pages)
        a.commit()
        b.commit()
        assert a.version == b.version == 2
    finally:
        for e in engines:
            e.stop()
    pool, kv = tp.runner.pool, tp.runner.kv
    assert pool.free_pages == pool.num_pages
    for slot in range(kv.num_layers):  # the pages the session held, read back from both ranks: zeroed
        k, v = kv.read(slot, held, 0, len(held) * kv.page_size)
        assert k.shape[0] == bundle.config.num_key_value_heads and not k.any() and not v.any()


def test_a_batch_of_sessions_on_two_ranks(two_ranks, tmp_path):
    """Sessions of different lengths sharing forward passes get what each gets alone on one rank."""
    bundle, client, tp = two_ranks.bundle, two_ranks.client, two_ranks.tp
    one = Engine(bundle, DirectoryStore(tmp_path / "one"), CONFIG)
    two = Engine(bundle, DirectoryStore(tmp_path / "two"), CONFIG, runner=tp.runner)
    try:
        results = {}
        for name, engine in (("one", one), ("two", two)):
            talks = [Conversation(client, bytes([i]) * 16) for i in range(4)]
            for talk in talks:
                talk.open(engine)
            outs = [[] for _ in talks]
            for step in range(3):
                futures = [talk.submit(random_ids(1 if step else 5 + 17 * i, seed=100 * step + i))
                           for i, talk in enumerate(talks)]  # all queued before the first is answered
                for out, future in zip(outs, futures):
                    out.append(future.result().hidden)
            for talk in talks:
                engine.close_turn(talk.turn)
            results[name] = [torch.cat(o) for o in outs]
        assert all(largest_difference(x, y) < OUTPUT_TOLERANCE for x, y in zip(results["one"], results["two"]))
    finally:
        one.stop()
        two.stop()


# -- lost ranks --------------------------------------------------------------------------------------
def test_a_hung_rank_times_out(tmp_path):
    """A rank that is alive but silent (SIGSTOP): the step waiting for it fails with UNAVAILABLE once the
    timeout runs out, the failure is reported once, nothing runs on the ranks any more, and closing kills the
    stopped rank."""
    bundle, client = prepared("llama", tmp_path / "bundles")
    tp = TensorParallel.start(bundle, CONFIG, 2, timeout=3)
    failures: list[str] = []
    tp.on_failure(failures.append)
    engine = Engine(bundle, DirectoryStore(tmp_path / "store"), CONFIG, runner=tp.runner)
    talk = Conversation(client, b"h" * 16)
    try:
        talk.open(engine)
        talk.step(random_ids(20, seed=3))
        tp.procs[0].send_signal(signal.SIGSTOP)
        with pytest.raises(Unavailable, match="tensor-parallel rank"):
            talk.step([1, 2, 3])
        engine.close_turn(talk.turn)
        assert len(failures) == 1
        other = Conversation(client, b"i" * 16)
        other.open(engine)
        with pytest.raises(RankFailure):  # nothing runs on lost ranks any more
            other.step([1, 2, 3])
        engine.close_turn(other.turn)
    finally:
        engine.stop()
        tp.close()
    assert tp.procs[0].poll() is not None  # never left behind


# -- the command line ----------------------------------------------------------------------------------
def test_the_server_refuses_a_rank_count_its_heads_do_not_divide_by(tmp_path, capsys):
    from infemeral.server.main import main

    bundle, _ = prepared("llama", tmp_path)  # 4 heads, 2 KV heads
    capsys.readouterr()  # what preparing the bundle logged is not the server's answer
    assert main(["--bundle", str(bundle.directory), "--tensor-parallel", "4", "--store", str(tmp_path / "s"),
                 "--metrics-port", "0", "--listen", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "4 attention heads and 2 KV heads" in err and "1, 2" in err


class RawTurn:
    """One Turn stream, message by message."""

    def __init__(self, stub):
        self.requests: queue.Queue = queue.Queue()
        self.call = stub.Turn(iter(self.requests.get, None), timeout=60)

    def send(self, request: pb.TurnRequest) -> pb.TurnResponse:
        self.requests.put(request)
        return next(self.call)


@pytest.mark.slow
def test_server_with_a_killed_rank_exits_non_zero_and_committed_sessions_are_intact(tmp_path):
    """`infemeral-server --tensor-parallel 2` as its own process: a rank killed mid-turn fails the turn with
    UNAVAILABLE and the server exits with status 1, leaving no rank behind; the version committed before
    reopens on a single rank as it was."""
    bundle, _ = prepared("llama", tmp_path)
    port, d = free_port(), bundle.config.hidden_size
    env = dict(os.environ, INFEMERAL_BUNDLE=str(bundle.directory), INFEMERAL_STORE=str(tmp_path / "store"),
               INFEMERAL_LISTEN=f"127.0.0.1:{port}", INFEMERAL_DEVICE="cpu", INFEMERAL_DTYPE="float32",
               INFEMERAL_METRICS_PORT="0", INFEMERAL_TENSOR_PARALLEL="2", INFEMERAL_TENSOR_PARALLEL_TIMEOUT="10",
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "infemeral.server.main"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    gen = torch.Generator().manual_seed(5)
    first, second = torch.randn(20, d, generator=gen), torch.randn(4, d, generator=gen)
    sid, key = b"s" * 16, b"k" * 32

    def open_request(version: int) -> pb.TurnRequest:
        return pb.TurnRequest(open=pb.OpenTurn(session_id=sid, session_key=key, expected_version=version,
                                               bundle_fingerprint=bundle.fingerprint))

    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        (worker,) = psutil.Process(proc.pid).children()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InfemeralStub(channel)
            turn = RawTurn(stub)
            turn.send(open_request(0))
            turn.send(pb.TurnRequest(step=pb.Step(hidden=to_proto(first), cache_length=0)))
            assert turn.send(pb.TurnRequest(commit=pb.Commit())).committed.version == 1
            turn = RawTurn(stub)
            turn.send(open_request(1))
            turn.send(pb.TurnRequest(step=pb.Step(hidden=to_proto(second), cache_length=20)))
            worker.kill()
            with pytest.raises(grpc.RpcError) as info:
                turn.send(pb.TurnRequest(step=pb.Step(hidden=to_proto(second), cache_length=24)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert proc.wait(timeout=60) == 1
        log = proc.stdout.read()
        assert "tensor parallelism failed" in log and "exits" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    one = Engine(bundle, DirectoryStore(tmp_path / "store"), CONFIG)
    try:
        resumed = one.open_turn(sid, key, 1, bundle.fingerprint)
        fresh = one.open_turn(b"f" * 16, key, 0, bundle.fingerprint)
        one.step(fresh, first, 0)
        assert resumed.cache.length == 20
        assert largest_difference(one.step(resumed, second, 20).hidden,
                                  one.step(fresh, second, 20).hidden) < OUTPUT_TOLERANCE
    finally:
        one.stop()


@pytest.mark.slow
def test_torchrun_starts_the_ranks_instead(tmp_path):
    """`torchrun --nproc-per-node 2 infemeral-server`: rank 0 serves (its WORLD_SIZE is the rank count), rank 1
    works for it, and a SIGINT to the launcher's process group stops both cleanly."""
    bundle, _ = prepared("llama", tmp_path)
    port, d = free_port(), bundle.config.hidden_size
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, INFEMERAL_STORE=str(tmp_path / "store"), INFEMERAL_METRICS_PORT="0")
    # --standalone: the launcher's rendezvous on a free port, not the fixed 29500 another job may hold
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "infemeral.server.main",
                             "--bundle", str(bundle.directory), "--listen", f"127.0.0.1:{port}", "--device", "cpu",
                             "--dtype", "float32"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            turn = RawTurn(pb_grpc.InfemeralStub(channel))
            turn.send(pb.TurnRequest(open=pb.OpenTurn(session_id=b"t" * 16, session_key=b"k" * 32,
                                                      bundle_fingerprint=bundle.fingerprint)))
            answer = turn.send(pb.TurnRequest(step=pb.Step(hidden=to_proto(torch.randn(5, d)), cache_length=0)))
            assert answer.step.cache_length == 5
            assert turn.send(pb.TurnRequest(commit=pb.Commit())).committed.version == 1
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in a terminal: every process of the group
        proc.wait(timeout=60)
        psutil.wait_procs(ranks, timeout=30)
        log = proc.stdout.read()
        assert "rank 1 stopped" in log and "infemeral.server.app: stopped" in log, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- three gloo ranks, the default model ---------------------------------------------------------------
@pytest.mark.slow
def test_three_ranks_serve_the_default_model_as_one_rank_does(bundles, server, client, tmp_path):
    """9 heads and 3 KV heads over 3 ranks: a 520-token prompt's logits agree with the single-rank server's
    at every position; a conversation goes on 3 -> 1 and 1 -> 3 ranks, token for token as on one rank."""
    from infemeral.client.sampling import SamplingParams

    Client = type(client)
    params = SamplingParams(max_new_tokens=10, speculate="off")
    # The same store as the single-rank server's: a session committed by one reopens on the other.
    srv = start_server(bundles, Path(server.settings.store), tensor_parallel=3, kv_pool_tokens=8192)
    three = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=300)
    try:
        # Teacher-forced: every position of one long prompt, both servers' engines directly.
        ids = client.text_ids("It was the best of times, it was the worst of times. " * 40)[:520]
        residuals = []
        for engine in (server.engine, srv.engine):
            turn = engine.open_turn(os.urandom(16), os.urandom(32), 0, engine.bundle.fingerprint,
                                    reserve_tokens=len(ids))
            try:
                hidden = client.model.cloak(ids, client.model.new_cache())
                residuals.append(engine.step(turn, hidden, 0, len(ids)).hidden)
            finally:
                engine.close_turn(turn)
        top1, logit_diff = agreement(client.model, *residuals)
        print(f"\ndefault model: 3 ranks vs 1 over {len(ids)} positions: top-1 agreement {top1:.4f}, largest logit "
              f"difference {logit_diff:.2e}")
        assert len(ids) >= 512 and top1 >= 0.99 and logit_diff < 1e-2

        # Greedy chat: one rank all along, against 3 ranks then 1, and 1 then 3.
        first, then = "Tell me about the sea.", "And about the sky?"
        alone = client.new_session()
        expected = [alone.chat(first, params).token_ids, alone.chat(then, params).token_ids]
        for before, after in ((three, client), (client, three)):
            moved = before.new_session()
            assert moved.chat(first, params).token_ids == expected[0]
            resumed = after.load_session(moved.save(tmp_path / "moved.session"))
            assert resumed.chat(then, params).token_ids == expected[1]
    finally:
        three.close()
        srv.stop(0)
    assert srv.tensor_parallel.procs and all(p.poll() == 0 for p in srv.tensor_parallel.procs)
