"""Ranks > 0: load a shard of the served layers, then run whatever rank 0 sends, in order, until it says stop.

A worker holds its share of the layers and of every page (its KV heads) and nothing else: no gRPC, no
store, no keys. It follows rank 0: it exits when told to, and also when rank 0 is gone (its sockets
close) or silent for longer than the timeout (rank 0 pings every few idle seconds). It ignores SIGINT and
SIGTERM, which a terminal or a launcher may send the whole process group: rank 0 decides when to stop.

    python -m infemeral.server.parallel.worker --device cpu --timeout 120   # started by rank 0, with the
                                                                             # RANK/WORLD_SIZE/MASTER_* variables
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import replace

import torch

from infemeral.cloak.bundle import ServerBundle
from infemeral.kvcache.paged import PagedBatch
from infemeral.logs import configure as configure_logging
from infemeral.server.layer_runner import LayerRunner
from infemeral.server.parallel import ops
from infemeral.server.parallel.group import START_TIMEOUT, Group, Launch, env_store, rank_device, torchrun_rank
from infemeral.server.parallel.shard import Shard, ShardedBundle, attach_all_reduce, parameter_bytes

log = logging.getLogger("infemeral.server.parallel.worker")  # also when run as __main__


def nonfinite_flag(batch: PagedBatch, device: torch.device) -> torch.Tensor:
    """1.0 if this rank wrote a key or value that is not finite in the batch, else 0.0 (left on the device)."""
    if not batch.kv_sums:
        return torch.zeros(1, device=device)
    return (~torch.isfinite(torch.stack(batch.kv_sums)).all()).float().reshape(1)


class Worker:
    def __init__(self, group: Group, runner: LayerRunner):
        self.group, self.runner, self.kv = group, runner, runner.kv
        self.hidden_size = runner.layers.config.hidden_size
        self.handlers = {ops.Forward: self.forward, ops.Read: self.read, ops.Write: self.write, ops.Move: self.move,
                         ops.Zero: self.zero, ops.Ping: self.ping}

    def serve(self) -> None:
        while not isinstance(message := self.group.receive(), ops.Stop):
            self.handlers[type(message)](message)

    def forward(self, op: ops.Forward) -> None:
        runner = self.runner
        hidden = self.group.broadcast(torch.empty(op.num_tokens, self.hidden_size, dtype=runner.dtype,
                                                  device=runner.device))
        batch = PagedBatch(self.kv, op.sequences, op.new_tokens, runner.backend, op.trees)
        runner.forward(hidden, batch)
        self.group.all_reduce(nonfinite_flag(batch, runner.device))

    def read(self, op: ops.Read) -> None:
        k, v = self.kv.read(op.slot, op.pages, op.start, op.end)
        self.group.gather(torch.stack([k, v]).contiguous())

    def write(self, op: ops.Write) -> None:
        kv = self.group.scatter(torch.empty(2, self.kv.kv_heads, op.num_tokens, self.kv.head_dim,
                                            dtype=self.kv.dtype, device=self.kv.device))
        self.kv.write(op.slot, op.pages, op.start, kv[0], kv[1])

    def move(self, op: ops.Move) -> None:
        self.kv.move(op.pages, op.start, op.end, op.to, op.rekey)

    def zero(self, op: ops.Zero) -> None:
        self.kv.zero(op.pages)

    def ping(self, op: ops.Ping) -> None:
        self.group.all_reduce(torch.zeros(1, device=self.group.device))


def serve(launch: Launch, device_kind: str, timeout: float) -> int:
    """Join rank 0, load this rank's shard, serve until stopped; the process's exit status."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    device = rank_device(device_kind, launch.local_rank)
    rank = launch.rank
    try:
        group = Group.join(env_store(launch, START_TIMEOUT), rank, launch.world, device, timeout, START_TIMEOUT)
        setup: ops.Setup = group.receive()
    except Exception as e:  # noqa: BLE001 - nothing to serve without rank 0
        print(f"infemeral tensor-parallel rank {rank}: could not join rank 0: {e}", file=sys.stderr, flush=True)
        return 1
    configure_logging(setup.log_level, setup.log_format)
    if device.type == "cpu":
        torch.set_num_threads(setup.threads)
    runner = None
    try:
        bundle = ServerBundle.open(setup.bundle, verify=False)  # rank 0 verified it
        runner = LayerRunner(ShardedBundle(bundle, Shard(rank, launch.world)),
                             replace(setup.config, device=str(device)))
        attach_all_reduce(runner.layers, group.all_reduce)
    except Exception:
        log.exception("rank %d could not load its shard of the served layers", rank)
    report = torch.tensor([1.0 if runner else 0.0, parameter_bytes(runner.layers) if runner else 0,
                           runner.kv.nbytes if runner else 0],
                          dtype=torch.float64)
    try:
        group.gather(report, timeout=max(timeout, START_TIMEOUT))
        if runner is None:
            return 1
        log.info("rank %d ready on %s", rank, device)
        Worker(group, runner).serve()
    except Exception as e:  # noqa: BLE001 - rank 0 is gone, silent, or this rank failed: stop either way
        log.error("rank %d stops: %s: %s", rank, type(e).__name__, e)
        return 1
    finally:
        group.close()
    log.info("rank %d stopped", rank)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infemeral.server.parallel.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True, help="where the ranks run")
    parser.add_argument("--timeout", type=float, required=True, help="seconds a collective may wait for a rank")
    args = parser.parse_args(argv)
    launch = torchrun_rank()
    if launch is None or launch.rank == 0:
        parser.error("start tensor-parallel ranks with `infemeral-server --tensor-parallel N` (or torchrun); "
                     "this is rank > 0 of one")
    return serve(launch, args.device, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
