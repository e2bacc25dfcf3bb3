"""Commits are crash-safe: SIGKILL the server at random moments while sessions commit, many times over.

A tiny random Llama is served by real `infemeral-server` processes that all
share one directory store. Each round a fresh server is hammered by one
client thread per session (raw gRPC turns: open, sometimes a truncation into
committed tokens to force a compaction, a step of a few or of 50-200 rows,
commit; as fast as it goes), and is killed with SIGKILL once the round has
seen a few commits, after a random delay. Every sixth round the kill then
waits for a commit to be writing, and lands at once: in turn while a file is
being written (a new `.tmp-` file in a session's folder) and once a chunk is
in place, as the manifest is written (a new `chunk-` file). The kill follows
the server's progress, not the clock, so a loaded machine changes how long a
round takes, not what it covers; a server that makes no progress within a
generous deadline fails the test.
Then, with no server running, every session is read straight from the store
with its keys:

- the authenticated manifest is at the last version the client saw committed,
  or one past it (the commit landed but its reply was lost), and its length is
  the length that version's turn produced, and the manifest names that very
  turn (its turn id);
- the whole cache decrypts, and its keys/values for the tokens no turn has
  touched since the previous check are bit-for-bit the ones decrypted then;
- the manifest names only `chunk-*` files that exist. A kill inside a write can
  leave `.tmp-*` files and unreferenced chunks behind; that is acceptable
  because no manifest ever names them and the store only reads the manifest
  and the chunks it names (unreferenced chunks are removed by the next commit,
  `.tmp-*` files stay until the session is deleted).

Finally a last server runs a normal turn on every session, expecting the
stored version: its residuals equal those of the stored cache run locally
through the same layers, it commits version + 1, and leaves no unreferenced
chunk behind.

The run is reproducible up to thread timing: the seed is printed and can be
fixed with INFEMERAL_CRASH_SEED (INFEMERAL_CRASH_ROUNDS sets the round count).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from tests.conftest import free_port, wait_serving
from transformers import AutoModelForCausalLM, LlamaConfig

from infemeral.cloak.bundle import ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.errors import StatusError
from infemeral.kvcache import stored
from infemeral.kvcache.persistence import SessionPersistence
from infemeral.layers.stack import LayerStack
from infemeral.protocol import pb, pb_grpc
from infemeral.protocol.tensors import from_proto, to_proto
from infemeral.storage.directory import MANIFEST, DirectoryStore

pytestmark = pytest.mark.slow

HIDDEN = 64
ROUNDS = int(os.environ.get("INFEMERAL_CRASH_ROUNDS", "12"))
SESSIONS = 3
COMMITS = (1, 4)        # commits a round sees before the kill (the first round: every session's first too)
DELAY = (0.05, 0.6)     # seconds from those commits to SIGKILL (or to waiting for a commit's write)
AIM_EVERY = 6           # every sixth round's kill waits for a commit's write: `.tmp-`, then `chunk-`, in turn
AHEAD = 2               # servers booting while one is hammered (start-up is most of a round's time)
MAX_LENGTH = 1500       # past this, a turn truncates deep into the committed tokens
TURN_TIMEOUT = 120.0    # one turn; generous, for a loaded machine
PROGRESS_TIMEOUT = 300.0  # a server booting, or committing what a round waits for; generous, for a loaded machine
AIM_TIMEOUT = 10.0      # waiting for a commit's write to be under way (a round kills anyway after it)


# -- the model and its servers -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama prepared into bundles; the served layers as the engine builds them."""
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096,
                         initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    bundles = prepare(output=tmp_path_factory.mktemp("tiny-llama"), source=ModelSource(model), progress=False)
    bundle = ServerBundle.open(bundles.server_dir)
    first = bundle.first_layer
    weights = [bundle.layer_weights(i) for i in range(first, first + bundle.num_layers)]
    layers = LayerStack(bundle.config, first, weights, dtype=torch.float32)  # as the engine builds them
    return bundles, layers


class ServerProcess:
    """`infemeral-server` as a separate process (as conftest.spawn_server), started without waiting,
    so the next round's server boots while this round's is being hammered; its output is drained."""

    def __init__(self, bundle_dir: Path, store: Path):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = dict(os.environ, INFEMERAL_BUNDLE=str(bundle_dir), INFEMERAL_STORE=str(store),
                   INFEMERAL_LISTEN=self.address, INFEMERAL_DEVICE="cpu", INFEMERAL_DTYPE="float32",
                   INFEMERAL_METRICS_PORT="0")  # several servers live at once: no fixed metrics port
        self.proc = subprocess.Popen([sys.executable, "-m", "infemeral.server.main"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: deque[str] = deque(maxlen=40)
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line.rstrip("\n"))

    def wait_serving(self) -> bool:
        """Wait for SERVING; False if the port was taken meanwhile (free_port only finds a port free)."""
        try:
            wait_serving(self.address, self.proc, timeout=PROGRESS_TIMEOUT)
            return True
        except RuntimeError:
            self.proc.wait(timeout=30)
            time.sleep(0.2)  # let the drain thread catch up
            if any("Address already in use" in line for line in self.output):
                return False
            raise RuntimeError("server exited during start-up:\n" + "\n".join(self.output)) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


# -- the client's view of its sessions -----------------------------------------------------------
@dataclass
class Session:
    index: int
    id: bytes
    key: bytes
    keys: stored.SessionKeys
    version: int = 0                 # last version the client knows is committed
    length: int = 0                  # cache length at that version
    pending: tuple[int, int] | None = None  # (version, length) of a commit whose reply never came
    turn_id: bytes = b""             # the turn that committed `version` (as far as the client knows)
    pending_turn_id: bytes = b""     # the turn of `pending`
    low_water: int = 0               # tokens untouched by every turn since the last check
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # decrypted at the last check
    turns: Counter = field(default_factory=Counter)
    temp_files: set[str] = field(default_factory=set)  # `.tmp-*` leftovers of killed writes seen so far
    orphans: set[str] = field(default_factory=set)     # unreferenced chunks seen at the last check

    @classmethod
    def new(cls, index: int, rng: random.Random) -> "Session":
        sid, key = rng.randbytes(16), rng.randbytes(32)
        return cls(index, sid, key, stored.SessionKeys.derive(sid, key))

    def open_request(self, fingerprint: str, turn_id: bytes = b"") -> pb.TurnRequest:
        return pb.TurnRequest(open=pb.OpenTurn(session_id=self.id, session_key=self.key, expected_version=self.version,
                                               bundle_fingerprint=fingerprint, turn_id=turn_id))


def hidden_rows(n: int, gen: torch.Generator) -> pb.Tensor:
    return to_proto(torch.randn(n, HIDDEN, generator=gen))


def run_turn(stub, s: Session, fingerprint: str, rng: random.Random, gen: torch.Generator) -> None:
    """One turn sent in one go: open, maybe truncate, one or two steps, commit; every reply checked."""
    length = s.length
    turn_id = rng.randbytes(16)
    requests, expect = [s.open_request(fingerprint, turn_id)], []
    drop = 0
    if length > MAX_LENGTH:
        drop = rng.randint(length // 2, length)
    elif length and rng.random() < 0.2:  # into committed tokens: the commit must compact
        drop = rng.randint(1, min(length, 64))
    if drop:
        requests.append(pb.TurnRequest(truncate=pb.Truncate(tokens=drop, cache_length=length)))
        length -= drop
        expect.append(("truncated", length))
    low = length
    sizes = [rng.randint(50, 200)] if rng.random() < 0.25 else [rng.randint(1, 8)]
    if rng.random() < 0.3:
        sizes.append(rng.randint(1, 4))  # a decode step after the prompt
    for n in sizes:
        outputs = rng.randint(1, n)
        requests.append(pb.TurnRequest(step=pb.Step(hidden=hidden_rows(n, gen), cache_length=length,
                                                    outputs=outputs)))
        length += n
        expect.append(("step", (length, outputs)))
    requests.append(pb.TurnRequest(commit=pb.Commit()))
    expect.append(("committed", (s.version + 1, length)))

    # From here on the server may commit; until its reply arrives the client cannot tell whether it did.
    s.pending, s.pending_turn_id = (s.version + 1, length), turn_id
    s.low_water = min(s.low_water, low)
    s.turns["started"] += 1
    replies = stub.Turn(iter(requests), timeout=TURN_TIMEOUT)
    opened = next(replies)
    assert opened.WhichOneof("kind") == "opened"
    assert (opened.opened.version, opened.opened.cache_length) == (s.version, s.length)
    for (kind, want), reply in zip(expect, replies, strict=True):
        assert reply.WhichOneof("kind") == kind, reply
        if kind == "truncated":
            assert reply.truncated.cache_length == want
        elif kind == "step":
            assert reply.step.cache_length == want[0]
            out = from_proto(reply.step.hidden, HIDDEN, want[1])
            assert out.shape == (want[1], HIDDEN)
        else:
            assert (reply.committed.version, reply.committed.cache_length) == want
            s.version, s.length, s.pending, s.turn_id = want[0], want[1], None, turn_id
            s.turns["committed"] += 1
            if drop:
                s.turns["compacting"] += 1


def hammer(address: str, s: Session, fingerprint: str, seed: int, killed: threading.Event,
           errors: list[str]) -> None:
    """Run turns on one session until the server dies; anything failing before the kill is an error."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InfemeralStub(channel)
        while True:
            try:
                run_turn(stub, s, fingerprint, rng, gen)
            except grpc.RpcError as e:
                if not killed.is_set():
                    errors.append(f"session {s.index}: {e.code().name} before the kill: {e.details()}")
                return
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(f"session {s.index}: {type(e).__name__}: {e}")
                return
            if killed.is_set():
                return


def wait_for_commits(sessions: list[Session], before: int, target: int, server: ServerProcess,
                     errors: list[str]) -> None:
    """Until the round has `target` acknowledged commits and every session has committed at least once (or
    until a client failed or the server died: the caller reports that)."""
    deadline = time.monotonic() + PROGRESS_TIMEOUT
    while not errors and server.proc.poll() is None:
        done = sum(s.turns["committed"] for s in sessions) - before
        if done >= target and all(s.turns["committed"] for s in sessions):
            return
        assert time.monotonic() < deadline, (
            f"the server acknowledged {done} of {target} commits (sessions without any: "
            f"{[s.index for s in sessions if not s.turns['committed']]}) in {PROGRESS_TIMEOUT:.0f} s:\n"
            + "\n".join(server.output))
        time.sleep(0.005)


def aim(rnd: int) -> str | None:
    """What the kill of round `rnd` waits for to appear in a session's folder, if anything: `.tmp-` (a commit
    is writing a file) or `chunk-` (a commit's chunk is in place; its manifest is being written)."""
    if rnd % AIM_EVERY != AIM_EVERY - 1:
        return None
    return (".tmp-", "chunk-")[rnd // AIM_EVERY % 2]


def wait_for_a_write(root: Path, sessions: list[Session], prefix: str) -> bool:
    """Until a new file whose name starts with `prefix` appears in a session's folder; False after AIM_TIMEOUT
    without one. (A committed session's folder stays: only an uncommitted one's goes with its lock.)"""
    folders = [root / s.id.hex() for s in sessions]

    def names() -> set[str]:
        return {name for folder in folders if folder.exists() for name in os.listdir(folder)}

    before = names()
    deadline = time.monotonic() + AIM_TIMEOUT
    while time.monotonic() < deadline:
        if any(name.startswith(prefix) for name in names() - before):
            return True
        time.sleep(0.0005)  # a durable write keeps its temp file for about a millisecond on a disk
    return False


# -- what the store holds --------------------------------------------------------------------------
def check_stored(root: Path, s: Session, layers: LayerStack, fingerprint: str, where: str) -> dict:
    """Read the session straight from the store (no server running) and reconcile the client with it."""
    try:
        return _check_stored(root, s, layers, fingerprint, where)
    except StatusError as e:  # DataLoss, PermissionDenied, ...: the stored session does not open
        raise AssertionError(f"{where}: session {s.index} (client at version {s.version}, pending {s.pending}) "
                             f"does not open: {type(e).__name__}: {e}") from e


def _check_stored(root: Path, s: Session, layers: LayerStack, fingerprint: str, where: str) -> dict:
    store = DirectoryStore(root)
    folder = store.folder(s.id)
    files = sorted(os.listdir(folder)) if folder.exists() else []
    temp = {f for f in files if f.startswith(".tmp-")}
    leftovers = {"new_tmp": sorted(temp - s.temp_files), "orphans": [], "new_orphans": [], "lost_reply": False}
    s.temp_files = temp
    blob = store.read_manifest(s.id)
    if blob is None:
        assert (s.version, s.length) == (0, 0), f"{where}: session {s.index} at version {s.version} has no manifest"
        s.pending, s.low_water = None, 0
        return leftovers
    # A torn manifest, a temp file renamed too early or a partial write would fail to authenticate here.
    manifest = stored.open_manifest(blob, s.keys)
    if manifest.version == s.version:
        assert manifest.length == s.length, (
            f"{where}: session {s.index} is at the known version {s.version} but holds {manifest.length} tokens, "
            f"not {s.length}")
    else:
        assert manifest.version == s.version + 1, (
            f"{where}: session {s.index} is at version {manifest.version}; the client knows {s.version} "
            f"(only {s.version} or {s.version + 1} are possible)")
        assert s.pending is not None and (manifest.version, manifest.length) == s.pending, (
            f"{where}: session {s.index} is at version {manifest.version} with {manifest.length} tokens, but the "
            f"turn that would commit it had {s.pending}")
        leftovers["lost_reply"] = True
        s.turn_id = s.pending_turn_id
    assert manifest.turn_id == s.turn_id.hex(), f"{where}: session {s.index} was committed by another turn"
    assert manifest.fingerprint == fingerprint
    names = [ref.name for ref in manifest.chunks]
    assert all(n.startswith("chunk-") for n in names), f"{where}: manifest names non-chunk files {names}"
    assert set(names) <= set(files), f"{where}: manifest names missing chunks {sorted(set(names) - set(files))}"
    assert not set(names) & temp
    assert MANIFEST in files
    orphans = {f for f in files if f.startswith("chunk-") and f not in names}
    leftovers["orphans"], leftovers["new_orphans"] = sorted(orphans), sorted(orphans - s.orphans)
    s.orphans = orphans
    # Nothing reads a temp file: the manifest never names one, and GC sees them at most as garbage.
    assert set(store.list_chunks(s.id)) - temp == set(names) | orphans

    cache = layers.new_cache()
    loaded = SessionPersistence(store, fingerprint).load(s.id, s.keys, manifest.version, cache)
    assert loaded.version == manifest.version and cache.length == manifest.length
    kv = [tuple(t.clone() for t in cache.layer_tensors(slot)) for slot in range(cache.num_layers)]
    if s.kv is not None:
        keep = min(s.low_water, s.length, manifest.length)
        for slot, ((k, v), (k0, v0)) in enumerate(zip(kv, s.kv, strict=True)):
            assert torch.equal(k[:, :keep], k0[:, :keep]) and torch.equal(v[:, :keep], v0[:, :keep]), (
                f"{where}: session {s.index}, layer slot {slot}: the first {keep} tokens changed although no "
                "turn touched them")
    s.version, s.length, s.pending, s.low_water, s.kv = manifest.version, manifest.length, None, manifest.length, kv
    return leftovers


# -- the test ----------------------------------------------------------------------------------------
def test_sigkill_during_commits_leaves_old_or_new_version(tiny, tmp_path):
    bundles, layers = tiny
    fingerprint = bundles.fingerprint
    root = tmp_path / "store"
    seed = int(os.environ.get("INFEMERAL_CRASH_SEED", random.randrange(2**32)))
    print(f"crash-safety seed: {seed} (rerun with INFEMERAL_CRASH_SEED={seed})")
    rng = random.Random(seed)
    sessions = [Session.new(i, rng) for i in range(SESSIONS)]
    stats: Counter = Counter()
    inside_commit = 0  # kills that visibly landed inside a commit's writes
    started = time.monotonic()
    servers: list[ServerProcess] = []  # every one started, for clean-up
    booting: deque[ServerProcess] = deque()

    def next_server(retries: int = 3) -> ServerProcess:
        while len(servers) < ROUNDS + 1 and len(booting) < AHEAD + 1:
            servers.append(ServerProcess(bundles.server_dir, root))
            booting.append(servers[-1])
        server = booting.popleft()
        while not server.wait_serving():
            assert retries, "could not find a free port for the server:\n" + "\n".join(server.output)
            retries -= 1
            servers.append(server := ServerProcess(bundles.server_dir, root))
        return server

    try:
        for rnd in range(ROUNDS):
            server = next_server()
            killed, errors = threading.Event(), []
            before = sum(s.turns["committed"] for s in sessions)
            threads = [threading.Thread(target=hammer, args=(server.address, s, fingerprint, rng.randrange(2**32),
                                                             killed, errors), daemon=True) for s in sessions]
            for t in threads:
                t.start()
            wait_for_commits(sessions, before, rng.randint(*COMMITS), server, errors)
            time.sleep(rng.uniform(*DELAY))
            if aim(rnd) is not None:
                stats[f"kills aimed at a new {aim(rnd)} file"] += wait_for_a_write(root, sessions, aim(rnd))
            killed.set()
            server.kill()
            assert server.proc.returncode == -signal.SIGKILL, "\n".join(server.output)
            for t in threads:
                t.join(timeout=TURN_TIMEOUT)
                assert not t.is_alive(), f"round {rnd}: a client turn hangs after the server was killed"
            assert not errors, f"round {rnd} (seed {seed}): " + "\n".join(errors) + "\n" + "\n".join(server.output)
            stats["commits acknowledged"] += sum(s.turns["committed"] for s in sessions) - before
            stats["turns cut off"] += sum(s.pending is not None for s in sessions)
            for s in sessions:
                found = check_stored(root, s, layers, fingerprint, f"round {rnd} (seed {seed})")
                stats["commits whose reply was lost"] += found["lost_reply"]
                stats["kills leaving unreferenced chunks"] += bool(found["new_orphans"])
                stats["kills leaving .tmp- files"] += bool(found["new_tmp"])
                inside_commit += found["lost_reply"] or bool(found["new_orphans"]) or bool(found["new_tmp"])

        # A last server: every session resumes from exactly what is stored, and commits the next version.
        server = next_server()
        gen = torch.Generator().manual_seed(seed)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.InfemeralStub(channel)
            for s in sessions:
                version = s.version
                assert version >= 1, f"session {s.index} never committed in {ROUNDS} rounds"
                rows = torch.randn(5, HIDDEN, generator=gen)
                turn_id = rng.randbytes(16)
                replies = list(stub.Turn(iter([
                    s.open_request(fingerprint, turn_id),
                    pb.TurnRequest(step=pb.Step(hidden=to_proto(rows), cache_length=s.length, outputs=5)),
                    pb.TurnRequest(commit=pb.Commit())]), timeout=TURN_TIMEOUT))
                assert [r.WhichOneof("kind") for r in replies] == ["opened", "step", "committed"]
                assert (replies[0].opened.version, replies[0].opened.cache_length) == (version, s.length)
                assert (replies[2].committed.version, replies[2].committed.cache_length) == (version + 1, s.length + 5)
                # The server computed over exactly the cache that decrypts from the store.
                cache = layers.new_cache()
                for slot, (k, v) in enumerate(s.kv):
                    cache.load_layer(slot, k, v)
                cache.set_length(s.length)
                torch.testing.assert_close(from_proto(replies[1].step.hidden, HIDDEN, 5), layers(rows, cache),
                                           rtol=1e-4, atol=1e-4)
                s.version, s.length, s.turn_id = version + 1, s.length + 5, turn_id
                s.low_water = s.length - 5
        server.kill()
        for s in sessions:
            found = check_stored(root, s, layers, fingerprint, "after the last turn")
            assert not found["orphans"], f"session {s.index}: the last commit left unreferenced chunks behind"
    finally:
        for server in servers:
            server.kill()

    elapsed = time.monotonic() - started
    turns = Counter()
    for s in sessions:
        turns.update(s.turns)
    print(f"{ROUNDS} kills in {elapsed:.1f} s; {dict(stats)}; turns {dict(turns)}; "
          f"final versions {[s.version for s in sessions]}, lengths {[s.length for s in sessions]}")
    assert stats["commits acknowledged"] > ROUNDS, "the servers hardly committed anything before being killed"
    assert stats["turns cut off"] >= ROUNDS // 2, "the kills rarely landed during a turn"
    assert inside_commit >= 1, "no kill landed inside a commit's writes"
