"""A loopback TCP proxy that delays every byte by half a round trip in each direction, at a set rate.

It emulates a WAN between the laptop and the pod on one machine: bytes read
from one side are written to the other `rtt/2` seconds later, in order — so a
request/response exchange costs one extra RTT, as over a real link. Without a
rate a stream of pipelined messages is not slowed further; with one
(`--up-mbit` from the listening side to the target, `--down-mbit` back) each
direction is a link of that bandwidth: bytes leave a token bucket at the rate
(a burst of `BURST_BYTES` at most) and arrive `rtt/2` after they left, and
what waits for the link is delayed, never dropped. A sender that runs ahead
of the link is held back once `BACKLOG_SECONDS` of bytes wait, as a real
sender's socket buffer fills. gRPC (HTTP/2) passes through it unchanged. It
listens on loopback only.

    python scripts/delay_proxy.py --target 127.0.0.1:50051 --rtt-ms 80 --up-mbit 20 --down-mbit 100 \
        --listen 127.0.0.1:50052

or, from Python (the benchmark does this):

    with DelayProxy("127.0.0.1:50051", rtt_ms=80, up_mbit=20, down_mbit=100) as proxy:
        client = Client(proxy.address, ...)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import socket
import sys
import threading
import time

CHUNK = 1 << 16
PIECE = 1 << 14          # a rate-limited read is paced in pieces this large, so delivery is smooth
BURST_BYTES = 1 << 14    # the token bucket's depth: what an idle link sends at once
BACKLOG_SECONDS = 0.05   # a sender this far ahead of its link waits before more is read from it


class Link:
    """One direction's bandwidth: when each piece has left the sender's end (a token bucket of `BURST_BYTES`).

    `rate` is in bytes per second (None: unlimited, so every piece leaves as it arrives)."""

    def __init__(self, rate: float | None):
        if rate is not None and rate <= 0:
            raise ValueError(f"a link rate must be positive, not {rate * 8 / 1e6:g} Mbit/s")
        self.rate = rate
        self.free_at = 0.0  # when the bytes already scheduled have all left

    def send(self, size: int, now: float) -> float:
        """Schedule `size` bytes that arrived at `now`; when the last of them has left."""
        if self.rate is None:
            return now
        self.free_at = max(self.free_at, now - BURST_BYTES / self.rate) + size / self.rate
        return max(self.free_at, now)

    def backlog(self, now: float) -> float:
        """Seconds of bytes still waiting to leave."""
        return max(0.0, self.free_at - now) if self.rate is not None else 0.0


def mbit_to_bytes(mbit: float | None) -> float | None:
    return None if mbit is None else mbit * 1e6 / 8


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def _require_loopback(host: str) -> None:
    try:
        is_loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = host == "localhost"
    if not is_loopback:
        raise ValueError(f"the delay proxy listens on loopback only, not {host!r}")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float,
                rate: float | None = None) -> None:
    """Copy bytes from reader to writer in order, each piece `delay` seconds after it left a link of `rate`
    bytes per second (None: as it arrived)."""
    queue: asyncio.Queue = asyncio.Queue()
    link = Link(rate)

    async def deliver():
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.ensure_future(deliver())
    try:
        while True:
            if (ahead := link.backlog(time.monotonic()) - BACKLOG_SECONDS) > 0:
                await asyncio.sleep(ahead)
            data = await reader.read(CHUNK)
            arrived = time.monotonic()
            if not data or rate is None:
                queue.put_nowait((arrived + delay, data))
            else:
                for start in range(0, len(data), PIECE):
                    piece = data[start:start + PIECE]
                    queue.put_nowait((link.send(len(piece), arrived) + delay, piece))
            if not data:
                break
        await sender
    except (ConnectionError, OSError):
        pass
    finally:
        sender.cancel()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class DelayProxy:
    """Forward `listen` -> `target`, delaying each direction by rtt_ms / 2; runs in its own thread.

    `up_mbit` limits the bytes towards the target, `down_mbit` those coming back (None: no limit)."""

    def __init__(self, target: str, rtt_ms: float, listen: str = "127.0.0.1:0", *, up_mbit: float | None = None,
                 down_mbit: float | None = None):
        self.target = _split(target)
        self.listen = _split(listen)
        _require_loopback(self.listen[0])
        self.delay = max(rtt_ms, 0.0) / 2000.0
        self.up_rate, self.down_rate = mbit_to_bytes(up_mbit), mbit_to_bytes(down_mbit)
        Link(self.up_rate), Link(self.down_rate)  # a rate that is not positive is refused here, not per connection
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.listen[0]}:{self.port}"

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.target)
        except (OSError, asyncio.CancelledError):
            client_writer.close()
            return
        _nodelay(client_writer)
        _nodelay(server_writer)
        try:
            await asyncio.gather(_pipe(client_reader, server_writer, self.delay, self.up_rate),
                                 _pipe(server_reader, client_writer, self.delay, self.down_rate))
        except asyncio.CancelledError:  # the proxy is stopping: end quietly
            pass
        finally:
            for w in (client_writer, server_writer):
                w.close()

    def start(self) -> "DelayProxy":
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, *self.listen), self._loop)
        self._server = future.result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        async def shutdown():
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Loopback TCP proxy that adds a round-trip delay and, if asked, "
                                                 "a bandwidth per direction (WAN emulation).")
    parser.add_argument("--target", required=True, help="host:port to forward to, e.g. 127.0.0.1:50051")
    parser.add_argument("--rtt-ms", type=float, default=80.0, help="round trip to add, in ms (default: 80)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="loopback host:port to listen on (default: any port)")
    parser.add_argument("--up-mbit", type=float, default=None,
                        help="bandwidth towards the target, in Mbit/s (default: no limit)")
    parser.add_argument("--down-mbit", type=float, default=None,
                        help="bandwidth from the target back, in Mbit/s (default: no limit)")
    args = parser.parse_args(argv)
    try:
        proxy = DelayProxy(args.target, args.rtt_ms, args.listen, up_mbit=args.up_mbit,
                           down_mbit=args.down_mbit).start()
    except ValueError as e:
        print(f"delay_proxy: {e}", file=sys.stderr)
        return 2
    rates = "".join(f", {name} {mbit:g} Mbit/s" for name, mbit in (("up", args.up_mbit), ("down", args.down_mbit))
                    if mbit is not None)
    print(f"forwarding {proxy.address} -> {args.target} with {args.rtt_ms:g} ms RTT{rates}; Ctrl-C stops", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
