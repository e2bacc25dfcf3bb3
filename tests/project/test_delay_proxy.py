"""The benchmark's WAN emulation: a loopback proxy that adds a round trip and, if asked, a bandwidth each way."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from delay_proxy import DelayProxy  # noqa: E402

RTT_MS = 200


@pytest.fixture
def echo_server():
    """A loopback TCP echo server; yields its address."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed early"
        data += chunk
    return data


def test_each_exchange_costs_one_round_trip_and_bytes_arrive_intact(echo_server):
    with DelayProxy(echo_server, rtt_ms=RTT_MS) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            times = []
            for i in range(3):
                message = bytes([i]) * 1000
                started = time.perf_counter()
                sock.sendall(message)
                assert recv_exactly(sock, len(message)) == message
                times.append(time.perf_counter() - started)
    assert min(times) >= RTT_MS / 1000 * 0.95
    assert max(times) < RTT_MS / 1000 * 5  # one round trip each, not several


def test_pipelined_messages_share_one_round_trip(echo_server):
    """Delay, not bandwidth: ten messages sent back to back come back after about one RTT, and 4 MB
    pass through in order."""
    payload = bytes(range(256)) * 16384  # 4 MiB
    with DelayProxy(echo_server, rtt_ms=RTT_MS) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            started = time.perf_counter()
            reader = threading.Thread(target=lambda: received.append(recv_exactly(sock, len(payload))))
            received: list[bytes] = []
            reader.start()
            for i in range(10):
                sock.sendall(payload[i * len(payload) // 10:(i + 1) * len(payload) // 10])
            reader.join(timeout=30)
            elapsed = time.perf_counter() - started
    assert received and received[0] == payload
    assert elapsed < 10 * RTT_MS / 1000  # far less than a round trip per message


def test_zero_rtt_passes_through(echo_server):
    with DelayProxy(echo_server, rtt_ms=0) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            sock.sendall(b"hello")
            assert recv_exactly(sock, 5) == b"hello"


def test_listens_on_loopback_only(echo_server):
    with pytest.raises(ValueError, match="loopback only"):
        DelayProxy(echo_server, rtt_ms=20, listen="0.0.0.0:0")
    with pytest.raises(ValueError, match="loopback only"):
        DelayProxy(echo_server, rtt_ms=20, listen="192.168.1.5:0")
    assert DelayProxy(echo_server, rtt_ms=20, listen="localhost:0").listen == ("localhost", 0)


def time_to_echo(proxy: DelayProxy, payload: bytes) -> float:
    """Seconds from the first byte sent to the last echoed byte received (a reader thread drains meanwhile)."""
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.append(recv_exactly(sock, len(payload))))
        started = time.perf_counter()
        reader.start()
        sock.sendall(payload)
        reader.join(timeout=60)
        elapsed = time.perf_counter() - started
    assert received and received[0] == payload  # delayed, never dropped or reordered
    return elapsed


@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_rate_holds_each_direction_to_its_bandwidth(echo_server, direction):
    """1 MB at 40 Mbit/s takes 200 ms on the link: never less than 0.9x that (a lower bound a loaded machine
    cannot break), and not several times more (a loose upper bound); the other direction is unlimited."""
    payload = bytes(range(256)) * 3907  # ~1 MB
    floor = len(payload) * 8 / 40e6
    rates = {"up_mbit": 40} if direction == "up" else {"down_mbit": 40}
    with DelayProxy(echo_server, rtt_ms=0, **rates) as proxy:
        elapsed = time_to_echo(proxy, payload)
    assert elapsed >= 0.9 * floor
    assert elapsed < 10 * floor


def test_the_rate_adds_to_the_round_trip_and_without_one_bytes_are_not_slowed(echo_server):
    payload = bytes(range(256)) * 3907
    with DelayProxy(echo_server, rtt_ms=RTT_MS, up_mbit=40, down_mbit=40) as proxy:
        limited = time_to_echo(proxy, payload)
    with DelayProxy(echo_server, rtt_ms=RTT_MS) as proxy:
        unlimited = time_to_echo(proxy, payload)
    assert limited >= 0.9 * (RTT_MS / 1000 + len(payload) * 8 / 40e6)
    assert unlimited < limited


def test_a_token_bucket_sends_a_burst_at_once_and_the_rest_at_the_rate():
    from delay_proxy import BURST_BYTES, Link

    link = Link(rate=1000.0)  # bytes per second
    assert link.send(BURST_BYTES, now=100.0) == 100.0  # an idle link: a full bucket leaves at once
    assert link.send(500, now=100.0) == pytest.approx(100.5)  # then at the rate
    assert link.backlog(100.0) == pytest.approx(0.5)
    assert link.send(BURST_BYTES + 1000, now=200.0) == pytest.approx(201.0)  # idle: the bucket refilled, to its depth
    assert Link(None).send(10**9, now=5.0) == 5.0 and Link(None).backlog(5.0) == 0.0
    with pytest.raises(ValueError, match="must be positive"):
        DelayProxy("127.0.0.1:1", rtt_ms=0, up_mbit=0)
