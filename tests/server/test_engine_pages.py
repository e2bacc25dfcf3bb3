"""The engine's pages: truncations and evictions give pages back, on the worker, between batches; turns hold
page quotas, so two turns decoding side by side never starve each other half-way; a turn that declares
nothing gets a modest quota, not a window; turns waiting for pages wait in line and hold at most half the
slots; one API key (or, without keys, one client address) holds at most its share of the slots and the
pool; the pacer keeps nothing about turns that closed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from infemeral.errors import ResourceExhausted
from infemeral.kvcache.paged import PagedSequence
from infemeral.kvcache.window import WindowPolicy
from infemeral.server.settings import ServerSettings
from infemeral.server.turn import TurnStatus
from infemeral.server.turn_call import peer_account
from infemeral.storage.open import open_store

from tests.server.tiny_engine import HIDDEN, Client, make_engine, wait_for


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

    def slow_run(caches, hidden, num_outputs, trees=None):
        running.set()
        go_on.wait(10)
        return real_run(caches, hidden, num_outputs, trees)

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
