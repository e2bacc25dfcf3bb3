#!/usr/bin/env python3
"""Ask an infemeral server's standard gRPC health service whether it is SERVING.

Exit status: 0 SERVING, 1 anything else (not serving, unreachable, TLS failure),
2 a configuration error (an unreadable certificate, a bad address).

The Docker image runs this as its HEALTHCHECK (`entrypoint.sh healthcheck`). It reads
the server's own settings from the environment:

  INFEMERAL_LISTEN           where the server listens; a wildcard host (0.0.0.0, [::])
                             is checked through localhost (default 0.0.0.0:50051)
  INFEMERAL_TLS_CERT         when set, connect with TLS and trust this certificate
                             (the server's own, self-signed or pinned) ...
  INFEMERAL_TLS_CA           ... or this CA instead, when the certificate is CA-issued
  INFEMERAL_TLS_SERVER_NAME  the name to check in the certificate (default: localhost)
  INFEMERAL_TLS_CLIENT_CERT, INFEMERAL_TLS_CLIENT_KEY
                             a client certificate, when the server wants mutual TLS
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

WILDCARDS = {"", "0.0.0.0", "::", "*"}


def local_target(listen: str) -> str:
    """The address to check a server at that listens on `listen` (host:port)."""
    if listen.startswith("unix:"):
        return listen
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"cannot tell the port from listen address {listen!r} (want host:port)")
    host = host.strip("[]")
    if host in WILDCARDS:
        host = "localhost"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def open_channel(target: str, env: dict[str, str], plaintext: bool) -> grpc.Channel:
    cert = env.get("INFEMERAL_TLS_CERT")
    if plaintext or not cert:
        return grpc.insecure_channel(target)
    root = read(env.get("INFEMERAL_TLS_CA") or cert)
    key = chain = None
    if env.get("INFEMERAL_TLS_CLIENT_CERT") and env.get("INFEMERAL_TLS_CLIENT_KEY"):
        chain = read(env["INFEMERAL_TLS_CLIENT_CERT"])
        key = read(env["INFEMERAL_TLS_CLIENT_KEY"])
    name = env.get("INFEMERAL_TLS_SERVER_NAME") or "localhost"
    credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
    return grpc.secure_channel(target, credentials, options=[("grpc.ssl_target_name_override", name),
                                                             ("grpc.default_authority", name)])


def check(target: str, service: str, timeout: float, env: dict[str, str], plaintext: bool = False) -> tuple[bool, str]:
    """(serving?, what was seen)."""
    with open_channel(target, env, plaintext) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="healthcheck", description=__doc__.split("\n\n", 1)[0],
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="host:port to check (default: derived from INFEMERAL_LISTEN)")
    parser.add_argument("--service", default="", help="health service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default: 5)")
    parser.add_argument("--plaintext", action="store_true", help="no TLS, even when INFEMERAL_TLS_CERT is set")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing when healthy")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = dict(os.environ)
    try:
        target = args.address or local_target(env.get("INFEMERAL_LISTEN") or "0.0.0.0:50051")
        ok, seen = check(target, args.service, args.timeout, env, args.plaintext)
    except (OSError, ValueError) as e:
        print(f"healthcheck: {e}", file=sys.stderr)
        return 2
    if not ok:
        print(f"healthcheck: {target} is not serving ({seen})", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"{target}: {seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
