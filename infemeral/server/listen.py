"""Binding the server's addresses: whole or not at all, and before anything slow happens.

gRPC binds a host name to whichever of its addresses it can and calls that
success: `localhost:P` next to a server already on 127.0.0.1:P would bind only
[::1]:P and quietly take every client that dials localhost. So the listen host
is resolved here and every address it names is bound explicitly; if any one
cannot be, the server refuses to start, with one line naming the address and
the reason. Each address is first tried with a plain socket, which yields the
operating system's reason (and keeps gRPC from logging its own error lines).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from dataclasses import dataclass

from infemeral.errors import InfemeralError


class CannotListen(InfemeralError):
    """An address the server should listen on is taken or does not exist on this host."""


@dataclass(frozen=True)
class ListenAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> "ListenAddress":
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"listen address must be host:port (e.g. 127.0.0.1:50051 or [::]:50051), not {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return join(self.host, self.port)

    def resolve(self) -> list[str]:
        """Every IP address the host names, in the resolver's order, each once."""
        try:
            infos = socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as e:
            raise CannotListen(f"cannot listen on {self}: cannot resolve {self.host!r} ({e.strerror})") from None
        return list(dict.fromkeys(info[4][0] for info in infos))


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reason(error: OSError) -> str:
    return (error.strerror or errno.errorcode.get(error.errno or 0, "unknown error")).lower()


def try_bind(ip: str, port: int) -> None:
    """Bind (and let go of) a socket as gRPC would — SO_REUSEADDR, IPv6 dual-stack — to learn whether
    the address is free. Raises OSError with the system's reason."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((ip, port))


def check_free(spec: ListenAddress, what: str = "") -> None:
    """Refuse, in one line, an address of `spec` that cannot be bound now (`what` names it: "the metrics port ")
    — a check before the slow part of start-up; `bind_all` binds for real afterwards."""
    for ip in spec.resolve() if spec.port else []:
        address = join(ip, spec.port)
        where = f"{spec}" if address == str(spec) else f"{spec} ({address})"
        try:
            try_bind(ip, spec.port)
        except OSError as e:
            raise CannotListen(f"cannot listen on {what}{where}: {reason(e)}") from None


def bind_all(spec: ListenAddress, add_port: Callable[[str], int]) -> int:
    """Bind every address of `spec` with `add_port` (a gRPC server's add_*_port); the bound port.

    With port 0 the first address picks the port and the others must take the same one."""
    port = spec.port
    for ip in spec.resolve():
        address = join(ip, port)
        where = f"{spec}" if address == str(spec) else f"{spec} ({address})"
        if port:
            try:
                try_bind(ip, port)
            except OSError as e:
                raise CannotListen(f"cannot listen on {where}: {reason(e)}") from None
        try:
            bound = add_port(address)
        except RuntimeError:  # gRPC's "Failed to bind to address"
            bound = 0
        if bound == 0 or (port and bound != port):
            raise CannotListen(f"cannot listen on {where}: the address is in use or not available")
        port = bound
    return port
