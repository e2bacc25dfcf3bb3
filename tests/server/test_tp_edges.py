"""Edges of tensor parallelism that the rank-count and lost-rank tests pass over.

The sharding rules are checked as pure functions: an MLP width the rank count does not divide, and an int4
group that a shard boundary would cut. The protocol is checked with two gloo ranks as threads of this process
(rank 0's real driver, runner and heartbeat; rank 1's real worker loop), which costs no process start: a
non-finite key or value written on rank 1 alone must fail the step, an idle server must stay up past the
collective timeout, and a rank that freezes while the server is idle must be noticed without any step.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from tests.server.test_tensor_parallel import CONFIG, Conversation, ThreadRanks, largest_difference, prepared, random_ids
from tests.cloak.test_tiny_models import COMMON, build
from transformers import LlamaConfig

from infemeral.errors import InvalidArgument
from infemeral.layers.stack import LayerStack
from infemeral.quant.served import ServerQuant, quantize_layer
from infemeral.server.engine import Engine
from infemeral.server.layer_runner import LayerRunner
from infemeral.server.parallel import ops
from infemeral.server.parallel.driver import Driver, RankFailure, TensorParallel, TensorParallelRunner
from infemeral.server.parallel.group import Group
from infemeral.server.parallel.shard import Shard, ShardedBundle, attach_all_reduce, shard_config, shard_layer
from infemeral.server.parallel.worker import Worker
from infemeral.storage.directory import DirectoryStore

TIMEOUT = 1.0  # seconds a collective waits: the heartbeat pings every TIMEOUT / 4 while idle


# -- the sharding, without processes -----------------------------------------------------------------------
def layer_weights(model, config) -> list[dict[str, torch.Tensor]]:
    state = model.state_dict()
    return [{k[len(f"model.layers.{i}."):]: v for k, v in state.items() if k.startswith(f"model.layers.{i}.")}
            for i in range(config.num_hidden_layers)]


def test_an_mlp_width_the_ranks_do_not_divide_is_shared_out_unevenly():
    """97 intermediate units over 2 ranks: 49 and 48 (the first ranks take one more); the ranks' partial sums
    still give what the whole layers give."""
    config = LlamaConfig(**{**COMMON, "intermediate_size": 97, "num_hidden_layers": 2, "mlp_bias": True})
    weights = layer_weights(build(config, seed=3), config)
    ranks = ThreadRanks(2)
    stacks = []
    for rank in range(2):
        shard = Shard(rank, 2)
        stack = LayerStack(shard_config(config, shard), 0, [shard_layer(w, config, shard) for w in weights])
        attach_all_reduce(stack, ranks.all_reduce(rank))
        stacks.append(stack)
    assert [shard_config(config, Shard(r, 2)).intermediate_size for r in range(2)] == [49, 48]
    whole = LayerStack(config, 0, weights)
    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(0))
    expected = whole(x, whole.new_cache())
    outs = ranks.run(lambda r: stacks[r](x, stacks[r].new_cache()))
    assert largest_difference(outs[0], expected) < 1e-4 and torch.equal(outs[0], outs[1])


def test_a_shard_boundary_inside_an_int4_group_is_refused():
    """96 intermediate units in int4 groups of 32 over 2 ranks: each rank's 48 input columns of down_proj end
    half-way through a group, whose one scale and zero cannot be split; the cut is refused, naming the tensor.
    (128 units, 64 a rank, cut between groups.)"""
    fits = LlamaConfig(**{**COMMON, "num_hidden_layers": 1})
    straddles = LlamaConfig(**{**COMMON, "intermediate_size": 96, "num_hidden_layers": 1})
    quant = ServerQuant("int4", "rtn", 32, int8_linears=())
    for config in (fits, straddles):
        quant.check_shapes(config)  # the group divides the whole layer's widths either way
    (layer,) = layer_weights(build(fits, seed=3), fits)
    shard_layer(quantize_layer(layer, quant), fits, Shard(1, 2))
    (layer,) = layer_weights(build(straddles, seed=3), straddles)
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.(qweight|scales|zeros) .* cannot be cut at input columns "
                                         r"48\.\.96: its groups straddle the cut \(each rank must hold whole "
                                         r"groups\); serve this bundle on another rank count, or prepare it with a "
                                         r"--group-size that divides every rank's share"):
        shard_layer(quantize_layer(layer, quant), straddles, Shard(1, 2))


# -- two gloo ranks as threads -------------------------------------------------------------------------------
class RanksInThreads:
    """Rank 0 as a tensor-parallel server runs it (driver, runner, heartbeat) and rank 1's worker loop on a
    thread of this process, over a real gloo group."""

    def __init__(self, bundle, timeout: float = TIMEOUT):
        store = dist.HashStore()
        groups: list[Group | None] = [None, None]

        def join(rank: int) -> None:
            groups[rank] = Group.join(store, rank, 2, torch.device("cpu"), timeout, 30.0)

        joins = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
        for t in joins:
            t.start()
        for t in joins:
            t.join()
        self.groups = groups
        worker_runner = LayerRunner(ShardedBundle(bundle, Shard(1, 2)), CONFIG)
        attach_all_reduce(worker_runner.layers, groups[1].all_reduce)
        self.worker = Worker(groups[1], worker_runner)
        self.worker_error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="rank-1", daemon=True)
        self.thread.start()
        driver = Driver(groups[0], timeout)
        self.tp = TensorParallel(driver, TensorParallelRunner(bundle, CONFIG, driver), [], [])
        self.failures: list[str] = []
        self.tp.on_failure(self.failures.append)

    def _serve(self) -> None:
        try:
            self.worker.serve()
        except Exception as e:  # noqa: BLE001 - what the test looks at
            self.worker_error = e

    def close(self) -> None:
        self.tp.close()  # tells rank 1 to stop unless the ranks were lost
        self.thread.join(timeout=10)
        self.groups[1].close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return prepared("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture
def ranks(tiny):
    ranks = RanksInThreads(tiny[0])
    yield ranks
    ranks.close()


def open_conversation(tiny, ranks, tmp_path, session_id: bytes = b"t" * 16):
    bundle, client = tiny
    engine = Engine(bundle, DirectoryStore(tmp_path), CONFIG, runner=ranks.tp.runner)
    talk = Conversation(client, session_id)
    talk.open(engine)
    return engine, talk


def test_a_non_finite_key_or_value_on_the_other_rank_alone_fails_the_step(tiny, ranks, tmp_path):
    """Rank 1's values overflow in the last layer where its residual did not (rank 0's keys, values and the
    summed output stay finite): only rank 1's flag says so, and the step fails as on one rank."""
    forward = ranks.worker.runner.forward
    overflow = threading.Event()

    def overflowing(hidden, batch):
        out = forward(hidden, batch)
        if overflow.is_set():
            last = batch.kv.num_layers - 1
            batch.kv.v[last][batch.write_pages, batch.write_offsets] = float("inf")
            batch.kv_sums.append(batch.kv.v[last][batch.write_pages].sum(dtype=torch.float32))
        return out

    ranks.worker.runner.forward = overflowing
    engine, talk = open_conversation(tiny, ranks, tmp_path)
    try:
        talk.step(random_ids(5, seed=1))
        overflow.set()
        with pytest.raises(InvalidArgument, match="overflowed to inf/NaN"):
            talk.step([1, 2, 3])
    finally:
        engine.close_turn(talk.turn)
        engine.stop()
    assert ranks.failures == []  # a bad step, not a lost rank


def test_an_idle_server_outlives_the_collective_timeout(tiny, ranks, tmp_path):
    """Rank 1 gives up on rank 0 after the timeout without a message: the heartbeat keeps it listening through
    an idle spell longer than that, and the next step is served."""
    engine, talk = open_conversation(tiny, ranks, tmp_path)
    try:
        talk.step(random_ids(5, seed=1))
        time.sleep(1.5 * TIMEOUT)
        talk.step([1, 2, 3])
    finally:
        engine.close_turn(talk.turn)
        engine.stop()
    assert ranks.failures == [] and ranks.worker_error is None and ranks.thread.is_alive()


def test_a_rank_that_freezes_while_the_server_is_idle_is_noticed(tiny, ranks, tmp_path):
    """Rank 1 stops answering while no turn runs: a heartbeat goes unanswered within the timeout, the failure is
    reported once, and the next step fails at once instead of waiting out a timeout of its own."""
    receive, thaw = ranks.worker.group.receive, threading.Event()
    frozen = threading.Event()

    def freezing_receive(*args, **kwargs):
        message = receive(*args, **kwargs)
        if frozen.is_set() and isinstance(message, ops.Ping):
            thaw.wait(30)  # as if stopped (SIGSTOP) with the ping in its socket
        return message

    ranks.worker.group.receive = freezing_receive
    engine, talk = open_conversation(tiny, ranks, tmp_path)
    try:
        talk.step(random_ids(5, seed=1))
        frozen.set()
        deadline = time.monotonic() + 4 * TIMEOUT
        while not ranks.failures and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(ranks.failures) == 1 and "ping" in ranks.failures[0], ranks.failures
        started = time.monotonic()
        with pytest.raises(RankFailure):
            talk.step([1, 2, 3])
        assert time.monotonic() - started < TIMEOUT / 2
    finally:
        thaw.set()
        engine.close_turn(talk.turn)
        engine.stop()
    assert len(ranks.failures) == 1
