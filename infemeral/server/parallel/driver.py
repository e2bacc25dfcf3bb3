"""Rank 0: everything a client talks to, and the driver of the other ranks.

The engine, the scheduler, turns, the store and its encryption all stay here, unchanged: they see a
`TensorParallelRunner` (a `LayerRunner` over rank 0's shard) and its `ShardedKVPages`. Whatever touches
pages goes to every rank, one operation at a time under one lock, in the same order everywhere:

* a forward pass: the batch's block tables, lengths and new tokens, then its hidden states (broadcast);
  every rank runs the same layers on its heads, the all-reduces after o_proj and down_proj keep the
  residual stream identical on all of them, and one more all-reduce says whether any rank wrote a key or
  value that is not finite;
* loading a session (a write per layer): rank 0 decrypts the whole layer and scatters the KV heads;
* committing it (a read per layer): every rank's KV heads are gathered to rank 0, which encrypts one
  ciphertext per layer as a single-rank server would (the stored format does not know the rank count);
* a window slide (a move, keys re-rotated by each rank on its own heads), and zeroing pages when a
  turn truncates, ends or is wiped.

A rank that is lost — a collective fails or times out, a rank process exits, or a heartbeat (a ping
every few idle seconds) goes unanswered — leaves the ranks out of step for good: the driver fails, every
later operation raises `RankFailure` (UNAVAILABLE), open turns fail with it, and `on_failure` tells the
server to exit non-zero so that its supervisor restarts it. Committed sessions are untouched: a commit
reads every layer before it writes anything.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from infemeral.cloak.bundle import ServerBundle
from infemeral.errors import Unavailable
from infemeral.kvcache.paged import KVPages, PagedBatch
from infemeral.server.config import EngineConfig
from infemeral.server.layer_runner import LayerRunner
from infemeral.server.parallel import ops
from infemeral.server.parallel.group import (DEFAULT_TIMEOUT, START_TIMEOUT, Group, env_store, loopback_store,
                                             rank_device, spawn_workers, torchrun_rank)
from infemeral.server.parallel.ranks import check
from infemeral.server.parallel.shard import Shard, ShardedBundle, attach_all_reduce, parameter_bytes

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 5.0          # at most this long between operations, so a lost rank shows up while idle
WATCH_SECONDS = 0.2              # how often rank 0 looks at the rank processes it started
STOP_SECONDS = 10.0              # how long stopped ranks get to exit before they are killed


class RankFailure(Unavailable):
    """A rank of this tensor-parallel server was lost; the server is going down."""

    def __init__(self, reason: str):
        super().__init__(f"a tensor-parallel rank of this server failed ({reason}); nothing was committed — the "
                         "server restarts: retry on another replica or in a moment")
        self.reason = reason


class Driver:
    """Rank 0's half of the protocol: operations one at a time, failure for good."""

    def __init__(self, group: Group, timeout: float):
        self.group, self.world, self.timeout = group, group.world, timeout
        self.failure: str | None = None
        self.is_closed = False
        self.on_failure: list = []  # callbacks, called once with the reason
        self.last_op = time.monotonic()
        self._lock = threading.Lock()
        self._fail_lock = threading.Lock()
        self._holder: int | None = None

    @property
    def shard(self) -> Shard:
        return Shard(0, self.world)

    def check(self) -> None:
        if self.failure is not None:
            raise RankFailure(self.failure)
        if self.is_closed:
            raise RankFailure("the server is stopping")

    @contextmanager
    def op(self, message, wait: float | None = None):
        """Send one operation to the other ranks; the body runs rank 0's part of it, collectives included.
        Anything that goes wrong once the message is out leaves the ranks out of step: the driver fails.
        `wait`: how long to wait for the operation before it (None: as long as it takes)."""
        if self._holder == threading.get_ident():
            raise RuntimeError("a tensor-parallel operation started inside another")
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            raise self.fail(f"{type(message).__name__.lower()}: the operation before it did not end in {wait:g} s")
        try:
            self.check()
            self._holder = threading.get_ident()
            try:
                self.group.send(message)
                yield
            except RankFailure:
                raise
            except BaseException as e:
                raise self.fail(f"{type(message).__name__.lower()}: {brief(e)}") from e
            finally:
                self._holder = None
                self.last_op = time.monotonic()
        finally:
            self._lock.release()

    def fail(self, reason: str) -> RankFailure:
        """Mark the ranks lost (the first reason sticks) and tell whoever listens, once."""
        with self._fail_lock:
            first = self.failure is None and not self.is_closed
            if self.failure is None:
                self.failure = reason
        if first:
            log.error("tensor parallelism failed: %s; failing open turns, the server exits", reason)
            for callback in self.on_failure:
                try:
                    callback(reason)
                except Exception:  # noqa: BLE001 - a listener must not stop the others
                    log.exception("a rank-failure listener failed")
        return RankFailure(self.failure or reason)

    def ping(self) -> None:
        with self.op(ops.Ping()):
            self.group.all_reduce(torch.zeros(1, device=self.group.device))


class ShardedKVPages:
    """Rank 0's keys and values in the pages: its own share of every page's KV heads (`local`), and every read
    and write of them on all ranks. The page pool, which counts pages, is the same as on one rank.

    Sequences see the model's full KV head count (the store records it, so a session moves between
    servers of any rank count); reads gather every rank's heads, writes scatter them, moves and zeroing
    run on every rank."""

    def __init__(self, driver: Driver, local: KVPages):
        self.driver, self.local = driver, local
        self.k, self.v = local.k, local.v  # what a forward pass on this rank attends over
        self.num_pages, self.page_size = local.num_pages, local.page_size
        self.first_layer, self.num_layers = local.first_layer, local.num_layers
        self.head_dim, self.dtype, self.device = local.head_dim, local.dtype, local.device
        self.local_kv_heads = local.kv_heads
        self.kv_heads = local.kv_heads * driver.world

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    def slots(self, pages: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local.slots(pages, start, end)

    def read(self, slot: int, pages: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.driver.op(ops.Read(slot, list(pages), start, end)):
            k, v = self.local.read(slot, pages, start, end)
            parts = self.driver.group.gather(torch.stack([k, v]).contiguous())
        kv = torch.cat(parts, dim=1)  # rank order is head order
        return kv[0], kv[1]

    def write(self, slot: int, pages: list[int], start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        kv = torch.stack([keys, values]).to(self.device, self.dtype)  # [2, kv_heads, n, head_dim]
        parts = [p.contiguous() for p in kv.chunk(self.driver.world, dim=1)]
        with self.driver.op(ops.Write(slot, list(pages), start, kv.shape[2])):
            mine = self.driver.group.scatter(torch.empty_like(parts[0]), parts)
            self.local.write(slot, pages, start, mine[0], mine[1])

    def move(self, pages: list[int], start: int, end: int, to: int, rekey) -> None:
        with self.driver.op(ops.Move(list(pages), start, end, to, rekey)):
            self.local.move(pages, start, end, to, rekey)

    def zero(self, pages: list[int]) -> None:
        self.local.zero(pages)  # rank 0's share, whatever happens to the others
        if not pages or self.driver.failure is not None or self.driver.is_closed:
            return  # lost or stopped ranks are killed or exit, and their pages with them
        try:
            with self.driver.op(ops.Zero(list(pages))):
                pass
        except RankFailure:
            pass  # zeroing never fails a close; the failure itself was reported


class TensorParallelRunner(LayerRunner):
    """Rank 0's model runner: its shard of the layers; each forward pass runs on every rank."""

    def __init__(self, bundle: ServerBundle, config: EngineConfig, driver: Driver):
        self.driver = driver
        super().__init__(ShardedBundle(bundle, driver.shard), config)
        attach_all_reduce(self.layers, driver.group.all_reduce)

    def new_kv_pages(self, *args) -> ShardedKVPages:
        return ShardedKVPages(self.driver, KVPages(*args))

    def forward(self, hidden: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        views = [ops.SequenceView(seq.pages[:self.pool.pages_for(seq.length + n)], seq.length)
                 for seq, n in zip(batch.sequences, batch.new_tokens)]
        hidden = hidden.to(self.device, self.dtype).contiguous()
        with self.driver.op(ops.Forward(views, list(batch.new_tokens), list(batch.trees))):
            self.driver.group.broadcast(hidden)
            out = super().forward(hidden, batch)
            elsewhere = self.driver.group.all_reduce(torch.zeros(1, device=self.device))
        if float(elsewhere) > 0:  # another rank wrote a non-finite key or value: check each step's, gathered
            batch.kv_sums.append(torch.tensor(float("nan"), device=self.device))
        return out


class TensorParallel:
    """A server's N ranks, this process being rank 0: start them, watch them, stop them."""

    def __init__(self, driver: Driver, runner: TensorParallelRunner, procs: list[subprocess.Popen],
                 rank_bytes: list[tuple[int, int]]):
        self.driver, self.runner, self.procs = driver, runner, procs
        self.rank_bytes = rank_bytes  # per rank: (weight bytes, page pool bytes)
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._heartbeat, name="infemeral-tp-heartbeat", daemon=True)]
        if procs:
            self._threads.append(threading.Thread(target=self._watch, name="infemeral-tp-watch", daemon=True))
        for t in self._threads:
            t.start()

    @property
    def world(self) -> int:
        return self.driver.world

    @property
    def failure(self) -> str | None:
        return self.driver.failure

    def on_failure(self, callback) -> None:
        """`callback(reason)` once the ranks are lost (from whichever thread noticed)."""
        self.driver.on_failure.append(callback)

    @classmethod
    def start(cls, bundle: ServerBundle, config: EngineConfig, world: int, timeout: float = DEFAULT_TIMEOUT, *,
              log_level: str = "INFO", log_format: str = "text") -> "TensorParallel":
        """Start (or, under torchrun, join) the other ranks, load every rank's shard, and return rank 0's side."""
        kind = check(bundle.config, config.device, world)
        launch = torchrun_rank()
        procs: list[subprocess.Popen] = []
        if launch is not None:
            if launch.world != world or launch.rank != 0:
                raise ValueError(f"torchrun started {launch.world} ranks (this is rank {launch.rank}) but the server "
                                 f"was told tensor_parallel={world}; give both the same count")
            store, local_rank = env_store(launch, START_TIMEOUT), launch.local_rank
        else:
            store, local_rank = loopback_store(world, START_TIMEOUT), 0
            procs = spawn_workers(world, store.port, kind, timeout)
        device = rank_device(kind, local_rank)
        try:
            group = join_watching(store, world, device, timeout, procs)
            driver = Driver(group, timeout)
            group.send(ops.Setup(str(bundle.directory), config, kind, torch.get_num_threads(), log_level, log_format))
            ok, runner, error = 1.0, None, None
            try:
                runner = TensorParallelRunner(bundle, replace(config, device=str(device)), driver)
            except Exception as e:  # noqa: BLE001 - reported once every rank has answered
                ok, error = 0.0, e
            report = torch.tensor([ok, parameter_bytes(runner.layers) if runner else 0,
                                   runner.kv.nbytes if runner else 0], dtype=torch.float64)
            reports = group.gather(report, timeout=max(timeout, START_TIMEOUT))
            if error is not None:
                raise error
            lost = [r for r, rep in enumerate(reports) if rep[0] < 1]
            if lost:
                raise RuntimeError(f"rank {lost[0]} could not load its shard of the served layers (its log says why)")
        except BaseException:
            stop_processes(procs, at_once=True)
            raise
        rank_bytes = [(int(rep[1]), int(rep[2])) for rep in reports]
        weights, pools = ("/".join(f"{b[i] / 2**20:.1f}" for b in rank_bytes) for i in (0, 1))
        log.info("tensor parallel: %d ranks on %s, served weights per rank %s MB, KV pool per rank %s MB", world,
                 "GPUs" if kind == "cuda" else "CPU processes (gloo)", weights, pools)
        return cls(driver, runner, procs, rank_bytes)

    def _heartbeat(self) -> None:
        interval = min(HEARTBEAT_SECONDS, self.driver.timeout / 4)
        while not self._stopped.wait(interval / 2):
            if self.driver.failure is not None or self.driver.is_closed:
                return
            if time.monotonic() - self.driver.last_op < interval:
                continue
            try:
                self.driver.ping()
            except RankFailure:
                return

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_SECONDS):
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    if not self.driver.is_closed:
                        self.driver.fail(f"rank {rank} exited with status {code}")
                    return

    def close(self) -> None:
        """Stop every rank: the other ranks exit (they are killed if they do not, and at once if the ranks
        were lost: a hung rank may still hold pages)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        failed = self.driver.failure is not None
        if not failed:
            try:
                with self.driver.op(ops.Stop(), wait=STOP_SECONDS):
                    pass
            except RankFailure:
                failed = True
        self.driver.is_closed = True
        stop_processes(self.procs, at_once=failed)
        self.driver.group.close()


def join_watching(store, world: int, device: torch.device, timeout: float, procs: list[subprocess.Popen]) -> Group:
    """Join the group while watching the rank processes this one started: one that exits fails the start at
    once instead of after the timeout."""
    result: dict = {}

    def join():
        try:
            result["group"] = Group.join(store, 0, world, device, timeout, START_TIMEOUT)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    thread = threading.Thread(target=join, name="infemeral-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(WATCH_SECONDS)
        for rank, proc in enumerate(procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(f"rank {rank} exited with status {proc.returncode} before joining")
    if "error" in result:
        raise RuntimeError(f"the ranks did not all join within {START_TIMEOUT:g} s: {result['error']}")
    return result["group"]


def stop_processes(procs: list[subprocess.Popen], at_once: bool = False) -> None:
    """Wait for rank processes to exit (killing any left after STOP_SECONDS), or kill them at once."""
    deadline = time.monotonic() + (0 if at_once else STOP_SECONDS)
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)  # works on a stopped (hung) process too
            proc.wait()


def brief(e: BaseException) -> str:
    """An exception in one short line (gloo's start with a source path and go on for a paragraph)."""
    text = (str(e).strip().splitlines() or [""])[0]
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    text = text.split(". ", 1)[0].rstrip(".")
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__
