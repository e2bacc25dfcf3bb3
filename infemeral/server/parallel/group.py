"""The ranks of one server and what they do together: start, connect, collectives that time out.

Rank 0 is the server process. It starts the other ranks itself (`spawn_workers`: `python -m
infemeral.server.parallel.worker`, one per device, rendezvous on a loopback port it picked), or
torchrun started every rank (`torchrun_rank`: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Either way
every rank joins one process group: gloo on the CPU; on CUDA NCCL for tensors on the GPUs and gloo for
the small messages rank 0 sends (a ProcessGroup routes each tensor by its device).

Every collective waits at most `timeout` seconds: a rank that died fails the next collective at once
(its sockets closed), a rank that hangs fails it when the timeout runs out (gloo raises; NCCL's watchdog
ends the process). Messages from rank 0 are pickled: the ranks are this server's own processes, joined
over an address only they were given.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0  # seconds a collective may wait for a rank
START_TIMEOUT = 1800.0   # seconds the ranks may take to start, join and load their shards
MESSAGE_BYTES = 16 << 10  # one broadcast carries a message up to this size; longer ones take a second
WORKER_MODULE = "infemeral.server.parallel.worker"


@dataclass(frozen=True)
class Launch:
    rank: int
    world: int
    local_rank: int


def torchrun_rank() -> Launch | None:
    """This process's rank when torchrun (or any launcher with torch's environment variables) started it."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    return Launch(rank, world, int(env.get("LOCAL_RANK", rank)))


def rank_device(kind: str, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if kind == "cuda" else torch.device("cpu")


class Group:
    """One rank's handle on the group: collectives rooted at rank 0, each bounded by `timeout`."""

    def __init__(self, pg, rank: int, world: int, device: torch.device, timeout: float):
        self.pg, self.rank, self.world, self.device = pg, rank, world, device
        self.timeout = timedelta(seconds=timeout)
        self.is_default_group = False

    @classmethod
    def join(cls, store, rank: int, world: int, device: torch.device, timeout: float,
             join_timeout: float) -> "Group":
        """Join the group (blocks until every rank has joined, at most `join_timeout`: starting a rank takes
        longer than any collective should)."""
        store = dist.PrefixStore("infemeral-tp", store)
        if device.type == "cpu":
            pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=join_timeout))
            return cls(pg, rank, world, device, timeout)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=join_timeout), device_id=device)
        group = cls(dist.group.WORLD, rank, world, device, timeout)
        group.is_default_group = True
        return group

    def close(self) -> None:
        if self.is_default_group and dist.is_initialized():
            dist.destroy_process_group()
        self.pg = None

    def _options(self, kind, timeout: float | None = None, **fields):
        """Options of one collective: its own timeout (the group's default is the longer joining one)."""
        opts = kind()
        opts.timeout = self.timeout if timeout is None else timedelta(seconds=timeout)
        for name, value in fields.items():
            setattr(opts, name, value)
        return opts

    # -- collectives (every rank calls each one, in the same order) -----------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place."""
        self.pg.allreduce([t], self._options(dist.AllreduceOptions, reduceOp=dist.ReduceOp.SUM)).wait()
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t`, in place."""
        self.pg.broadcast([t], self._options(dist.BroadcastOptions, rootRank=0, rootTensor=0)).wait()
        return t

    def scatter(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Rank 0's `parts[r]` into rank r's `out` (`parts` on rank 0 only)."""
        inputs = [parts] if self.rank == 0 else []
        self.pg.scatter([out], inputs, self._options(dist.ScatterOptions, rootRank=0)).wait()
        return out

    def gather(self, t: torch.Tensor, timeout: float | None = None) -> list[torch.Tensor] | None:
        """Every rank's `t` (same shape) into a list on rank 0; None on the others."""
        outputs = [[torch.empty_like(t) for _ in range(self.world)]] if self.rank == 0 else []
        self.pg.gather(outputs, [t], self._options(dist.GatherOptions, timeout, rootRank=0)).wait()
        return outputs[0] if self.rank == 0 else None

    # -- messages from rank 0 -------------------------------------------------------------------------
    def send(self, message) -> None:
        """Rank 0: hand a message to every other rank (they `receive` it)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
        head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
        first = data[:MESSAGE_BYTES - 8]
        head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        self.broadcast(head)
        if len(data) > len(first):
            self.broadcast(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8))

    def receive(self, timeout: float | None = None):
        """Ranks > 0: the next message rank 0 sends."""
        head = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
        self.pg.broadcast([head], self._options(dist.BroadcastOptions, timeout, rootRank=0, rootTensor=0)).wait()
        size = int(head[:8].view(torch.int64)[0])
        data = head[8:8 + size].numpy().tobytes()
        if size > len(data):
            rest = torch.empty(size - len(data), dtype=torch.uint8)
            self.broadcast(rest)
            data += rest.numpy().tobytes()
        return pickle.loads(data)


def spawn_workers(world: int, port: int, device_kind: str, timeout: float) -> list[subprocess.Popen]:
    """Ranks 1..world-1 as child processes of this one (rank 0), meeting it at 127.0.0.1:`port`."""
    procs = []
    for rank in range(1, world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(subprocess.Popen([sys.executable, "-m", WORKER_MODULE, "--device", device_kind,
                                       "--timeout", str(timeout)], env=env))
    return procs


def loopback_store(world: int, timeout: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`store.port`)."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def env_store(launch: Launch, timeout: float):
    """The store torchrun's environment points at (its agent's, or rank 0's)."""
    store, _, _ = next(dist.rendezvous("env://", launch.rank, launch.world, timeout=timedelta(seconds=timeout)))
    return store
