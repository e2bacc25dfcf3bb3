"""A loopback TCP proxy that delays every byte by half a round trip in each direction.

It emulates a WAN between the laptop and the pod on one machine: bytes read
from one side are written to the other `rtt/2` seconds later, in order, with no
bandwidth limit — so a request/response exchange costs one extra RTT, as over
a real link, and a stream of pipelined messages is not slowed further. gRPC
(HTTP/2) passes through it unchanged. It listens on loopback only.

    python scripts/delay_proxy.py --target 127.0.0.1:50051 --rtt-ms 80 --listen 127.0.0.1:50052

or, from Python (the benchmark does this):

    with DelayProxy("127.0.0.1:50051", rtt_ms=80) as proxy:
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


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy bytes from reader to writer, each chunk `delay` seconds after it arrived, in order."""
    queue: asyncio.Queue = asyncio.Queue()

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
            data = await reader.read(CHUNK)
            queue.put_nowait((time.monotonic() + delay, data))
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
    """Forward `listen` -> `target`, delaying each direction by rtt_ms / 2; runs in its own thread."""

    def __init__(self, target: str, rtt_ms: float, listen: str = "127.0.0.1:0"):
        self.target = _split(target)
        self.listen = _split(listen)
        _require_loopback(self.listen[0])
        self.delay = max(rtt_ms, 0.0) / 2000.0
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
            await asyncio.gather(_pipe(client_reader, server_writer, self.delay),
                                 _pipe(server_reader, client_writer, self.delay))
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
    parser = argparse.ArgumentParser(description="Loopback TCP proxy that adds a round-trip delay (WAN emulation).")
    parser.add_argument("--target", required=True, help="host:port to forward to, e.g. 127.0.0.1:50051")
    parser.add_argument("--rtt-ms", type=float, default=80.0, help="round trip to add, in ms (default: 80)")
    parser.add_argument("--listen", default="127.0.0.1:0", help="loopback host:port to listen on (default: any port)")
    args = parser.parse_args(argv)
    try:
        proxy = DelayProxy(args.target, args.rtt_ms, args.listen).start()
    except ValueError as e:
        print(f"delay_proxy: {e}", file=sys.stderr)
        return 2
    print(f"forwarding {proxy.address} -> {args.target} with {args.rtt_ms:g} ms RTT; Ctrl-C stops", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
