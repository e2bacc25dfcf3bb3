"""The engine keeps session state true: what it stores, what it holds in the pool, and how it fails.

A tiny random Llama is served by an in-process `Engine` over a real store (no
gRPC), so these run in seconds. What they check:

- after every commit the cache reloaded from the store equals the live cache
  bit for bit, over random step sizes, truncations and window slides, on both
  store backends (a property test, seeded);
- truncations and evictions give pages back, on the worker, between batches;
  turns hold page quotas, so two turns decoding side by side never starve
  each other half-way; a turn that declares nothing gets a modest quota, not
  a window; turns waiting for pages wait in line and hold at most half the
  slots; one API key holds at most its share of the slots and the pool;
- a step whose eviction disagrees with the server's window is refused;
- a failed forward pass fails exactly the turns in its batch, with a clear
  status, and everyone else carries on; a step after the engine stopped is
  answered at once; a failed load leaves no thread holding decrypted state;
- closing a turn never waits for its running step (the worker wipes the
  pages afterwards); a step whose activations overflow to inf/NaN, in the
  layers or in the dtype its answer is sent in, fails only its own turn and
  stores nothing;
- the pacer keeps nothing about turns that closed.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from infemeral.cloak.bundle import ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.errors import Aborted, InvalidArgument, ResourceExhausted, Unavailable
from infemeral.kvcache import stored
from infemeral.kvcache.cache import KVCache
from infemeral.kvcache.paged import PagedSequence
from infemeral.kvcache.window import WindowPolicy
from infemeral.server.config import EngineConfig
from infemeral.server.engine import Engine
from infemeral.server.settings import ServerSettings
from infemeral.server.turn import TurnStatus
from infemeral.server.turn_call import peer_account
from infemeral.storage.open import open_store

HIDDEN = 64
WINDOW = WindowPolicy(max_context=48, sink_tokens=4, page_size=8)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> ServerBundle:
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=4096,
                         initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = prepare(output=tmp_path_factory.mktemp("tiny-engine"), source=ModelSource(model), progress=False)
    return ServerBundle.open(out.server_dir)


@pytest.fixture(params=["directory", "redis"])
def store(request, tmp_path):
    s = open_store(tmp_path / "store" if request.param == "directory" else request.getfixturevalue("redis_url"))
    yield s
    s.close()


def make_engine(bundle, store, **overrides) -> Engine:
    config = dict(device="cpu", dtype="float32", window=WINDOW, kv_pool_tokens=1024, admission_wait=2.0)
    return Engine(bundle, store, EngineConfig(**{**config, **overrides}))


@pytest.fixture
def engine(bundle, tmp_path):
    e = make_engine(bundle, open_store(tmp_path / "store"))
    yield e
    e.stop()


class Client:
    """One session as a client drives it: its id, key, version and view of the cache length."""

    def __init__(self, engine: Engine, seed: int = 0):
        self.engine, self.gen = engine, torch.Generator().manual_seed(seed)
        self.id, self.key = os.urandom(16), os.urandom(32)
        self.version, self.length = 0, 0

    def open(self, reserve_tokens: int = 0, account: str | None = None):
        turn = self.engine.open_turn(self.id, self.key, self.version, self.engine.bundle.fingerprint,
                                     os.urandom(16), reserve_tokens=reserve_tokens, account=account)
        assert turn.cache.length == self.length
        return turn

    def step(self, turn, n: int, num_outputs: int = 1):
        evict = self.engine.window.tokens_to_evict(self.length, n)
        out = self.engine.step(turn, torch.randn(n, HIDDEN, generator=self.gen), self.length, num_outputs, evict)
        self.length += n - evict
        assert (out.cache_length, out.num_evicted, out.hidden.shape) == (self.length, evict, (num_outputs, HIDDEN))
        return out

    def truncate(self, turn, n: int) -> None:
        self.length = self.engine.truncate(turn, n, self.length)

    def commit(self, turn) -> None:
        self.version = self.engine.commit(turn)

    def turn(self, *sizes: int, reserve_tokens: int = 0) -> None:
        turn = self.open(reserve_tokens)
        try:
            for n in sizes:
                self.step(turn, n)
            self.commit(turn)
        finally:
            self.engine.close_turn(turn)

    def stored_cache(self) -> KVCache:
        """The committed cache, decrypted straight from the store."""
        kv = self.engine.kv
        cache = KVCache(kv.first_layer, kv.num_layers, kv.kv_heads, kv.head_dim, kv.dtype)
        self.engine.persistence.load(self.id, stored.SessionKeys.derive(self.id, self.key), self.version, cache)
        return cache


def snapshot(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.clone() for t in cache.layer_tensors(slot)) for slot in range(cache.num_layers)]


def assert_same(a: list, b: list, what: str) -> None:
    assert len(a) == len(b)
    for slot, ((k, v), (k0, v0)) in enumerate(zip(a, b)):
        assert k.shape == k0.shape, f"{what}: layer slot {slot} holds {k.shape[1]} tokens, not {k0.shape[1]}"
        assert torch.equal(k, k0) and torch.equal(v, v0), (
            f"{what}: layer slot {slot} differs by up to {max((k - k0).abs().max(), (v - v0).abs().max()):.3g}")


# -- the stored cache stays true -----------------------------------------------------------------------
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reloaded_cache_equals_the_live_cache_after_every_commit(bundle, store, seed):
    """Random turns (prompt chunks, decode steps, truncations, window slides inside turns and across turn
    boundaries): after every commit the store decrypts to exactly the live cache, and the next turn opens
    on exactly it."""
    engine = make_engine(bundle, store)
    rng = random.Random(seed)
    c = Client(engine, seed)
    counts = {"evictions": 0, "truncations": 0}
    live = None
    try:
        for _ in range(10):
            turn = c.open(reserve_tokens=rng.choice([0, 40, 200]))
            if live is not None:
                assert_same(snapshot(turn.cache), live, "the reopened cache")
            try:
                for _ in range(rng.randint(1, 6)):
                    if c.length and rng.random() < 0.25:
                        c.truncate(turn, rng.randint(1, min(c.length, 12)))
                        counts["truncations"] += 1
                    else:
                        n = rng.choice([1, 1, 1, 2, 3, 7, 13, 21])
                        counts["evictions"] += bool(c.step(turn, n, rng.randint(1, n)).num_evicted)
                c.commit(turn)
                live = snapshot(turn.cache)
                assert_same(snapshot(c.stored_cache()), live, f"the stored cache at version {c.version}")
            finally:
                engine.close_turn(turn)
        assert counts["evictions"] >= 2 and counts["truncations"] >= 1, counts  # the run exercised both
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def test_window_slide_after_a_short_stored_history(engine):
    """The case the issue reproduced: a few stored tokens, then enough one-token steps in one turn that the
    window slides while the cache stays at least as long as what was stored."""
    c = Client(engine)
    c.turn(10)
    turn = c.open(reserve_tokens=60)
    evicted = sum(c.step(turn, 1).num_evicted for _ in range(60))
    assert evicted and c.length >= 10
    c.commit(turn)
    live = snapshot(turn.cache)
    engine.close_turn(turn)
    assert_same(snapshot(c.stored_cache()), live, "the stored cache after a slide")


# -- pages --------------------------------------------------------------------------------------------
def test_truncation_and_eviction_give_pages_back(engine):
    pool = engine.pool
    c = Client(engine)
    turn = c.open(reserve_tokens=100)
    c.step(turn, 40)  # 5 pages of 8
    assert len(turn.cache.pages) == 5 and pool.free_pages == pool.num_pages - 5
    c.truncate(turn, 17)  # 23 tokens: 3 pages
    assert len(turn.cache.pages) == 3 and pool.free_pages == pool.num_pages - 3
    c.step(turn, 25)  # 48 tokens: the window is full
    assert len(turn.cache.pages) == 6
    out = c.step(turn, 1)  # evicts one page, needs no new one
    assert out.num_evicted == 8 and c.length == 41
    assert len(turn.cache.pages) == 6 and pool.free_pages == pool.num_pages - 6
    c.truncate(turn, 30)
    assert len(turn.cache.pages) == 2 and pool.free_pages == pool.num_pages - 2
    engine.close_turn(turn)
    assert pool.free_pages == pool.num_pages and pool.promised_pages == 0


def test_paged_sequence_frees_pages_on_truncate_and_evict(engine):
    seq = PagedSequence(engine.pool, engine.kv)
    seq.reserve(30)  # 4 pages
    seq.length = seq.committed_length = 30
    seq.truncate(9)  # 21: 3 pages
    assert len(seq.pages) == 3 and engine.pool.free_pages == engine.pool.num_pages - 3
    seq.evict(4, 8, lambda k: k)  # 13: 2 pages
    assert len(seq.pages) == 2 and engine.pool.free_pages == engine.pool.num_pages - 2
    seq.wipe()
    assert engine.pool.free_pages == engine.pool.num_pages


def test_admitted_turns_finish_when_two_decode_side_by_side(bundle, tmp_path):
    """A pool too small for two answers at once: the second turn waits for its quota at open (instead of
    both starting and one failing half-way), then runs; both answers complete."""
    engine = make_engine(bundle, open_store(tmp_path / "store"), kv_pool_tokens=64, window=WindowPolicy(64, 4, 8),
                         admission_wait=10.0)
    results, errors, opened = {}, [], {}
    go = threading.Barrier(2)

    def answer(name: str) -> None:
        c = Client(engine, seed=len(name))
        try:
            go.wait()
            turn = c.open(reserve_tokens=40)  # 5 of the pool's 8 pages
            opened[name] = time.monotonic()
            try:
                c.step(turn, 8)
                for _ in range(32):
                    c.step(turn, 1)
                    time.sleep(0.002)  # let the other turn interleave
                c.commit(turn)
            finally:
                engine.close_turn(turn)
            results[name] = c.length
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=answer, args=(name,)) for name in ("a", "bb")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert results == {"a": 40, "bb": 40}
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def test_quota_guarantees_and_limits(bundle, tmp_path):
    """A turn that declares a whole window reserves it; a new turn that does not fit waits, then gets
    RESOURCE_EXHAUSTED with a retry hint; a turn may grow past its quota only into spare pages."""
    engine = make_engine(bundle, open_store(tmp_path / "store"), kv_pool_tokens=64, window=WindowPolicy(48, 4, 8),
                         admission_wait=0.3)
    try:
        a, b = Client(engine, 1), Client(engine, 2)
        whole = a.open(reserve_tokens=48)  # 48 tokens = 6 of 8 pages
        assert whole.cache.quota_tokens == 48 and engine.pool.spare_pages == 2
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match="retry") as info:
            b.open(reserve_tokens=48)
        assert time.monotonic() - started >= 0.25 and info.value.retry_after > 0
        assert engine.active_turns == 1 and engine.pool.spare_pages == 2  # the refused turn took nothing
        small = b.open(reserve_tokens=10)  # 2 pages fit
        assert engine.pool.spare_pages == 0
        b.step(small, 10)
        with pytest.raises(ResourceExhausted, match="grew past the 16 tokens it reserved"):
            b.step(small, 7)  # past its quota, and nobody has spare pages
        assert small.status is TurnStatus.FAILED
        engine.close_turn(small)
        a.step(whole, 40)  # the admitted turn is undisturbed
        a.step(whole, 8)
        a.commit(whole)
        engine.close_turn(whole)
        c = Client(engine, 3)
        turn = c.open(reserve_tokens=8)
        c.step(turn, 30)  # past its quota, into spare pages: allowed
        engine.close_turn(turn)
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def test_undeclared_turns_get_a_modest_quota_not_a_window(bundle, tmp_path):
    """(Old code: a turn declaring nothing was granted a whole window, so a few of them took the pool and a
    declared turn beside them waited, then was refused.)"""
    engine = make_engine(bundle, open_store(tmp_path / "store"), kv_pool_tokens=96, window=WindowPolicy(48, 4, 8),
                         admission_wait=0.3, default_reserve_tokens=8)
    try:
        undeclared = [Client(engine, i) for i in range(4)]
        turns = [c.open() for c in undeclared]  # 8 tokens each: one page, not six
        assert [t.cache.quota_tokens for t in turns] == [8] * 4
        declared = Client(engine, 9)
        started = time.monotonic()
        turn = declared.open(reserve_tokens=48)  # six pages still fit beside them, at once
        assert time.monotonic() - started < 0.2
        undeclared[0].step(turns[0], 20)  # past its quota, into spare pages: allowed
        declared.step(turn, 48)  # and the declared turn has all it was promised
        for t in turns + [turn]:
            engine.close_turn(t)
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def test_turns_waiting_for_pages_wait_in_line_and_hold_at_most_half_the_slots(bundle, tmp_path):
    """Of 4 turn slots at most 2 wait for pages; a third turn that does not fit is refused at once (old code:
    it waited too, so waiting turns could hold every slot); a turn that fits is admitted at once whoever
    waits (a waiting turn holds nobody back); pages that come back go to the oldest waiting turn."""
    engine = make_engine(bundle, open_store(tmp_path / "store"), kv_pool_tokens=64, window=WindowPolicy(48, 4, 8),
                         max_sessions=4, admission_wait=5.0)
    opened, errors = {}, []

    def wait_for_pages(name: str, client: Client, tokens: int) -> None:
        try:
            opened[name] = (client.open(reserve_tokens=tokens), time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {type(e).__name__}: {e}")

    try:
        hog = Client(engine, 1).open(reserve_tokens=48)  # 6 of 8 pages: 2 spare
        first, second = Client(engine, 2), Client(engine, 3)
        waiters = [threading.Thread(target=wait_for_pages, args=("first", first, 32))]  # 4 pages
        waiters[0].start()
        assert wait_for(lambda: engine.pool.num_waiting == 1)
        waiters.append(threading.Thread(target=wait_for_pages, args=("second", second, 32)))
        waiters[1].start()
        assert wait_for(lambda: engine.pool.num_waiting == 2)

        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match="2 turns already wait for pages") as info:
            Client(engine, 4).open(reserve_tokens=24)
        assert time.monotonic() - started < 1 and info.value.retry_after > 0
        started = time.monotonic()
        small = Client(engine, 5).open(reserve_tokens=8)  # fits beside the waiting turns: no waiting
        assert time.monotonic() - started < 1
        assert engine.active_turns == 4 and engine.pool.num_waiting == 2

        engine.close_turn(hog)  # 7 spare pages: enough for one waiting turn of 4, the first in line
        assert wait_for(lambda: "first" in opened)
        time.sleep(0.2)
        assert "second" not in opened and engine.pool.num_waiting == 1
        engine.close_turn(opened["first"][0])
        waiters[1].join(10)
        assert "second" in opened and not errors, errors
        engine.close_turn(opened["second"][0])
        engine.close_turn(small)
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()
        for t in waiters:
            t.join(10)


def test_one_api_key_holds_at_most_its_share_of_slots_and_pages(bundle, tmp_path):
    """Two turn slots and half the pool (6 of 12 pages) per key: past either, that key is refused at once with a
    retry hint, and another key is served; a turn grows past its quota only within its key's share."""
    engine = make_engine(bundle, open_store(tmp_path / "store"), kv_pool_tokens=96, window=WindowPolicy(48, 4, 8),
                         max_sessions=8, admission_wait=0.3, max_sessions_per_key=2, kv_pool_share_per_key=0.5)
    try:
        assert engine.config.pages_per_key == 6
        a1 = Client(engine, 1)
        big = a1.open(reserve_tokens=40, account="key-a")  # 5 of key a's 6 pages
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match="hold 5 of the 6 KV pages one key may use") as info:
            Client(engine, 2).open(reserve_tokens=16, account="key-a")  # 2 more pages: past its share
        assert time.monotonic() - started < 0.2 and info.value.retry_after > 0  # at once, though pages are spare
        a2 = Client(engine, 3)
        small = a2.open(reserve_tokens=8, account="key-a")  # the last page of its share
        with pytest.raises(ResourceExhausted, match="this API key has its limit of 2 turns") as info:
            Client(engine, 4).open(reserve_tokens=8, account="key-a")
        assert info.value.retry_after > 0
        b = Client(engine, 5)
        other = b.open(reserve_tokens=40, account="key-b")  # another key: served at once
        b.step(other, 40)
        with pytest.raises(ResourceExhausted, match="grew past the 8 tokens it reserved"):
            a2.step(small, 16)  # spare pages exist, but not within key a's share
        engine.close_turn(small)
        a1.step(big, 40)
        for t in (big, other):
            engine.close_turn(t)
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
        assert set(engine.sessions.pages_held_by_keys().values()) == {0}
        assert Client(engine, 6).open(reserve_tokens=48, account="key-a") is not None  # all back
    finally:
        engine.stop()


def test_without_api_keys_one_client_address_holds_at_most_its_turns(bundle, tmp_path):
    """Without API keys the client's address is the account: past `max_sessions_per_peer` turns it is refused at
    once with a retry hint, while another address and the pod's own (loopback) clients are served."""
    settings = ServerSettings(max_sessions=8, max_sessions_per_peer=2)
    assert settings.engine_config(num_api_keys=0).max_sessions_per_peer == 2
    assert settings.engine_config(num_api_keys=1).max_sessions_per_peer == 0  # keys tell clients apart instead
    assert settings.service_limits().max_streams_per_peer == 8  # the same share of the 32 streams
    quiet = peer_account("ipv4:10.0.0.7:40001")
    assert quiet == peer_account("ipv4:10.0.0.7:40002") == "ipv4:10.0.0.7"  # the port does not count
    assert peer_account("ipv6:%5B2001:db8::1%5D:40001") == "ipv6:2001:db8::1"
    assert peer_account("ipv4:127.0.0.1:40001") is peer_account("ipv6:%5B::1%5D:40001") is None
    engine = make_engine(bundle, open_store(tmp_path / "store"), max_sessions=8,
                         max_sessions_per_peer=settings.engine_config().max_sessions_per_peer)
    try:
        held = [Client(engine, i).open(8, account=quiet) for i in (1, 2)]  # opened, then silent
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match="your address has its limit of 2 turns") as info:
            Client(engine, 3).open(8, account=quiet)
        assert time.monotonic() - started < 0.2 and info.value.retry_after > 0
        others = [Client(engine, 4).open(8, account=peer_account("ipv4:10.0.0.8:40001")),
                  *(Client(engine, i).open(8) for i in (5, 6, 7))]
        engine.close_turn(held.pop())
        held.append(Client(engine, 3).open(8, account=quiet))  # its slot back
        for turn in held + others:
            engine.close_turn(turn)
    finally:
        engine.stop()


def test_truncation_frees_pages_on_the_worker_between_batches(engine, monkeypatch):
    """(Old code: `Truncate` freed and zeroed pages on the calling thread, racing a running batch.)"""
    a, b = Client(engine, 1), Client(engine, 2)
    ta, tb = a.open(reserve_tokens=40), b.open(reserve_tokens=40)
    a.step(ta, 20)
    b.step(tb, 20)
    released = []
    real_release = engine.pool.release

    def recording_release(pages, regrant=0):
        if pages:
            released.append(threading.current_thread().name)
        return real_release(pages, regrant)

    monkeypatch.setattr(engine.pool, "release", recording_release)
    running, go_on = threading.Event(), threading.Event()
    real_run = engine.runner.run

    def slow_run(caches, hidden, num_outputs):
        running.set()
        go_on.wait(10)
        return real_run(caches, hidden, num_outputs)

    monkeypatch.setattr(engine.runner, "run", slow_run)
    step = engine.submit_step(ta, torch.randn(1, HIDDEN), a.length)
    assert running.wait(5)
    truncated = engine.submit_truncate(tb, 12, b.length)  # another turn's truncation, during a's batch
    time.sleep(0.2)
    assert not truncated.done() and released == [] and len(tb.cache.pages) == 3
    go_on.set()
    assert truncated.result(timeout=10) == 8 and step.result(timeout=10).cache_length == 21
    assert released == ["infemeral-engine"] and len(tb.cache.pages) == 1
    monkeypatch.setattr(engine.runner, "run", real_run)
    b.length = 8
    b.step(tb, 2)  # the turn carries on from the truncated cache
    b.truncate(tb, 5)
    assert released == ["infemeral-engine"] * 2 and tb.cache.length == 5
    engine.close_turn(ta)
    engine.close_turn(tb)
    assert engine.pool.free_pages == engine.pool.num_pages


@pytest.mark.parametrize("hold", [0.0, 0.05])
def test_the_pacer_forgets_every_turn_that_closed(bundle, tmp_path, hold):
    """(Old code: it kept an entry per turn ever served — with holding off, the default, for ever.)"""
    engine = make_engine(bundle, open_store(tmp_path / "store"), max_batch_hold=hold)
    try:
        clients = [Client(engine, i) for i in range(3)]
        for _ in range(4):
            for c in clients:
                c.turn(3, 1, 1)
        pacer = engine.scheduler.pacer
        assert wait_for(lambda: pacer.num_known == 0), pacer.num_known
        if hold:
            turn = clients[0].open()
            clients[0].step(turn, 1)
            assert pacer.num_known == 1  # holding on: it does learn about open turns
            engine.close_turn(turn)
            assert wait_for(lambda: pacer.num_known == 0)
    finally:
        engine.stop()


# -- refusals ------------------------------------------------------------------------------------------
def test_step_whose_eviction_disagrees_with_the_window_is_refused(engine):
    c = Client(engine)
    turn = c.open()
    c.step(turn, 40)
    for wrong in (0, 1, 16):  # the window evicts 8 before a step of 9 at 40 tokens
        with pytest.raises(Aborted, match=f"client's window evicts {wrong} tokens before this step but the "
                                          "server's evicts 8"):
            engine.step(turn, torch.randn(9, HIDDEN), 40, 1, wrong)
    assert turn.status is TurnStatus.OPEN and turn.cache.length == 40
    with pytest.raises(Aborted, match="client's window evicts 8 tokens before this step but the server's evicts 0"):
        engine.step(turn, torch.randn(1, HIDDEN), 40, 1, 8)
    assert c.step(turn, 9).num_evicted == 8
    engine.close_turn(turn)


def test_step_after_the_engine_stopped_is_answered_at_once(bundle, tmp_path):
    engine = make_engine(bundle, open_store(tmp_path / "store"), kv_pool_tokens=64, admission_wait=30.0)
    a, b = Client(engine, 1), Client(engine, 2)
    hog, small = a.open(reserve_tokens=40), b.open(reserve_tokens=8)
    b.step(small, 8)
    waiting = engine.submit_step(small, torch.randn(20, HIDDEN), 8)  # past its quota: waits for spare pages
    time.sleep(0.2)
    assert not waiting.done()
    engine.stop()
    with pytest.raises(Unavailable, match="shutting down"):
        waiting.result(timeout=5)  # a step waiting in the scheduler is answered
    with pytest.raises(Unavailable, match="shutting down"):
        engine.submit_step(hog, torch.randn(1, HIDDEN), 0).result(timeout=5)  # and one submitted afterwards
    with pytest.raises(Unavailable, match="shutting down"):
        a.open()
    engine.close_turn(hog)
    engine.close_turn(small)


def test_a_failed_forward_fails_only_its_batch(bundle, store, monkeypatch):
    engine = make_engine(bundle, store)
    try:
        a, b = Client(engine, 1), Client(engine, 2)
        a.turn(12)
        b.turn(9)
        b_committed = snapshot(b.stored_cache())
        ta, tb = a.open(), b.open()
        real_run = engine.runner.run

        def out_of_memory(caches, hidden, num_outputs):
            if tb.cache in caches:
                raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return real_run(caches, hidden, num_outputs)

        monkeypatch.setattr(engine.runner, "run", out_of_memory)
        with pytest.raises(Unavailable, match=r"failed to run this step \(RuntimeError; out of memory\?\); "
                                              "nothing was committed — retry"):
            b.step(tb, 3)
        assert tb.status is TurnStatus.FAILED
        with pytest.raises(Aborted, match="this turn failed"):
            engine.step(tb, torch.randn(1, HIDDEN), b.length)
        with pytest.raises(Aborted, match="this turn failed"):
            engine.commit(tb)
        engine.close_turn(tb)
        for _ in range(3):  # the other session carries on, and commits
            a.step(ta, 2)
        a.commit(ta)
        engine.close_turn(ta)
        monkeypatch.setattr(engine.runner, "run", real_run)
        assert_same(snapshot(b.stored_cache()), b_committed, "the failed session's committed state")
        b.length = 9
        b.turn(1)  # and the failed session itself goes on from its last commit
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


# -- loading -------------------------------------------------------------------------------------------
def decrypt_threads() -> int:
    return sum(t.name == "infemeral-decrypt" for t in threading.enumerate())


def test_a_failed_load_leaves_no_thread_behind(engine, monkeypatch):
    """Filling the pages fails (say, the device is out of memory): the decrypting thread must stop too,
    rather than block forever on its queue holding ciphertext and decrypted layers."""
    c = Client(engine)
    c.turn(20)
    before = decrypt_threads()

    def no_memory(self, slot, keys, values):
        raise torch.OutOfMemoryError("no room for this layer")

    monkeypatch.setattr(PagedSequence, "load_layer", no_memory)
    for _ in range(3):
        with pytest.raises(torch.OutOfMemoryError):
            c.open()
    deadline = time.monotonic() + 5
    while decrypt_threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decrypt_threads() == before
    monkeypatch.undo()
    assert engine.active_turns == 0 and engine.pool.free_pages == engine.pool.num_pages
    c.turn(1)  # nothing was left locked or half-loaded


# -- closing and overflowing ----------------------------------------------------------------------------
def test_closing_a_turn_never_waits_for_its_running_step(bundle, tmp_path, monkeypatch):
    """The client vanished while the worker computes its step: the session and its slot are released at
    once (a reconnect opens it), and the worker wipes the pages when it is done with them."""
    engine = make_engine(bundle, open_store(tmp_path / "store"))
    try:
        c = Client(engine)
        c.turn(10)
        running, release = threading.Event(), threading.Event()
        real_run = engine.runner.run

        def slow_run(caches, hidden, num_outputs):
            running.set()
            release.wait(10)
            return real_run(caches, hidden, num_outputs)

        monkeypatch.setattr(engine.runner, "run", slow_run)
        turn = c.open()
        future = engine.submit_step(turn, torch.randn(3, HIDDEN), c.length)
        assert running.wait(5)
        started = time.monotonic()
        engine.close_turn(turn)
        assert time.monotonic() - started < 1
        assert turn.status is TurnStatus.CLOSED and engine.active_turns == 0
        assert engine.pool.free_pages < engine.pool.num_pages  # the worker still writes into those pages
        again = c.open()  # the session is free again at once
        release.set()
        future.result(timeout=10)  # the orphaned step finishes...
        assert wait_for(lambda: engine.pool.free_pages == engine.pool.num_pages - len(again.cache.pages))
        monkeypatch.setattr(engine.runner, "run", real_run)
        c.step(again, 2)  # ...its pages are wiped, and the new turn is undisturbed
        c.commit(again)
        engine.close_turn(again)
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


@contextlib.contextmanager
def arriving_together(engine):
    """Steps submitted inside reach the engine's worker in one go when the block ends (held back, then queued
    under the queue's own lock), instead of racing it one by one: whether two steps share a forward pass no
    longer depends on how fast the worker wakes."""
    q, held = engine._queue, []
    q.put = held.append
    try:
        yield
    finally:
        del q.put
        with q.mutex:
            for item in held:
                q._put(item)
            q.unfinished_tasks += len(held)
            q.not_empty.notify()


def test_an_overflowed_step_fails_only_its_turn(bundle, tmp_path):
    """Rows that are finite as sent (float32) but past float16's range overflow in a float16 server. That turn
    fails (INVALID_ARGUMENT) and stores nothing; a turn stepping beside it, in the same batches, carries on."""
    engine = make_engine(bundle, open_store(tmp_path / "store"), dtype="float16")
    try:
        a, b = Client(engine, 1), Client(engine, 2)
        a.turn(6)
        b.turn(6)
        b_committed = snapshot(b.stored_cache())
        ta, tb = a.open(), b.open()
        batches = []
        real_run = engine.runner.run

        def recording_run(caches, hidden, num_outputs):
            batches.append({id(cache) for cache in caches})
            return real_run(caches, hidden, num_outputs)

        engine.runner.run = recording_run
        with arriving_together(engine):  # both steps reach the worker at once, so they share one forward pass
            healthy = engine.submit_step(ta, torch.randn(1, HIDDEN, dtype=torch.float16), a.length)
            huge = engine.submit_step(tb, torch.full((2, HIDDEN), 1e5), b.length)
        with pytest.raises(InvalidArgument, match=r"overflowed to inf/NaN in the server's float16.*nothing "
                                                  "was committed"):
            huge.result(timeout=10)
        assert torch.isfinite(healthy.result(timeout=10).hidden).all()
        a.length += 1
        assert tb.status is TurnStatus.FAILED
        with pytest.raises(Aborted, match="this turn failed"):
            engine.commit(tb)
        engine.close_turn(tb)
        assert {id(ta.cache), id(tb.cache)} <= batches[-1], "the two steps never shared a batch"
        a.commit(ta)
        engine.close_turn(ta)
        assert_same(snapshot(b.stored_cache()), b_committed, "the overflowed session's committed state")
        live = snapshot(a.stored_cache())
        assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in live)
        assert engine.pool.free_pages == engine.pool.num_pages and engine.pool.promised_pages == 0
    finally:
        engine.stop()


def test_an_answer_that_overflows_the_wire_dtype_fails_its_turn(engine, monkeypatch):
    """A float32 server whose answer is finite in float32 but past float16's range, for a step sent in float16:
    what would be sent is inf, so the step and its turn fail (old code: checked before the cast, and sent inf).
    The same answer for a step sent in float32 is fine."""
    a = Client(engine, 1)
    a.turn(4)
    committed = snapshot(a.stored_cache())
    real_run = engine.runner.run

    def huge_answers(caches, hidden, num_outputs):
        return [None if h is None else h * 0 + 1e5 for h in real_run(caches, hidden, num_outputs)]

    monkeypatch.setattr(engine.runner, "run", huge_answers)
    turn = a.open()
    out = engine.step(turn, torch.randn(2, HIDDEN), a.length)  # float32 on the wire: 1e5 fits
    assert out.hidden.dtype == torch.float32 and torch.isfinite(out.hidden).all()
    with pytest.raises(InvalidArgument, match=r"overflows to inf/NaN in float16, the dtype the step was sent in.*"
                                              "nothing was committed"):
        engine.step(turn, torch.randn(1, HIDDEN, dtype=torch.float16), a.length + 2)
    assert turn.status is TurnStatus.FAILED
    with pytest.raises(Aborted, match="this turn failed"):
        engine.commit(turn)
    engine.close_turn(turn)
    monkeypatch.setattr(engine.runner, "run", real_run)
    assert_same(snapshot(a.stored_cache()), committed, "the committed state")
    turn = a.open()
    out = engine.step(turn, torch.randn(1, HIDDEN, dtype=torch.float16), a.length)
    assert out.hidden.dtype == torch.float16 and torch.isfinite(out.hidden).all()  # answered in its own dtype
    engine.close_turn(turn)
    assert engine.pool.free_pages == engine.pool.num_pages


def test_keys_or_values_that_overflowed_fail_their_step_even_with_finite_outputs(engine):
    """The runner screens what a batch wrote through one float32 sum per layer, and only when the screen
    fails reads each step's new keys and values back: the step that holds an inf is refused, its neighbour
    in the batch is not."""
    a, b = Client(engine, 1), Client(engine, 2)
    ta, tb = a.open(), b.open()
    a.step(ta, 3)
    b.step(tb, 3)
    batch = SimpleNamespace(sequences=[ta.cache, tb.cache], new_tokens=[3, 3],
                            kv_sums=[torch.tensor(1.0), torch.tensor(2.0)])
    outputs, bounds = torch.zeros(6, HIDDEN), [0, 3, 6]
    assert engine.runner._finite_steps(batch, outputs, bounds) == [True, True]
    last = engine.kv.num_layers - 1
    page, offset = tb.cache.pages[0], 2
    engine.kv.k[last][page, offset, 0, 0] = float("-inf")  # attention may well ignore a key like this one
    assert engine.runner._finite_steps(batch, outputs, bounds) == [True, True]  # the screen passed: no read-back
    batch.kv_sums.append(torch.tensor(float("-inf")))
    assert engine.runner._finite_steps(batch, outputs, bounds) == [True, False]
    outputs[1, 5] = float("nan")
    assert engine.runner._finite_steps(batch, outputs, bounds) == [False, False]
    engine.close_turn(ta)
    engine.close_turn(tb)
    assert engine.pool.free_pages == engine.pool.num_pages
