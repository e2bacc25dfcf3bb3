"""Transport security shared by server and client: TLS credentials and API-key auth.

Plaintext is for loopback only unless explicitly allowed; with TLS the client
pins a CA (or the server's own certificate) and may present its own
certificate (mutual TLS). API keys travel in the `x-api-key` metadata and are
compared in constant time; the health service stays open so load balancers
and container health checks work without a key.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Iterable
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

API_KEY_HEADER = "x-api-key"
OPEN_METHODS_PREFIX = "/grpc.health.v1.Health/"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an IP address, IPv6 with or without brackets; no port) is this machine's
    loopback: `localhost`, an address in 127.0.0.0/8, or ::1. Use `host_of` on a `host:port` address."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host_port(address: str) -> tuple[str, str]:
    """(host, port) of `host:port`, `[v6]:port`, `host`, `[v6]` or a bare IPv6 address, brackets removed;
    the port is '' when there is none. Nothing is validated: a caller that needs a number checks it."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else rest
    host, sep, port = address.rpartition(":")
    if not sep or ":" in host:  # no port, or an IPv6 address without brackets
        return address, ""
    return host, port


def host_of(address: str) -> str:
    """The host of a `host:port` address (see `split_host_port`)."""
    return split_host_port(address)[0]


def read_api_keys(inline: str, file: Path | None) -> list[str]:
    keys = [k.strip() for k in inline.split(",") if k.strip()]
    if file is not None:
        keys += [line.strip() for line in Path(file).read_text().splitlines() if line.strip()
                 and not line.startswith("#")]
    return keys


def server_credentials(cert: Path | None, key: Path | None, client_ca: Path | None):
    """grpc server credentials, or None for plaintext."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("tls_client_ca needs tls_cert and tls_key")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both tls_cert and tls_key")
    root = Path(client_ca).read_bytes() if client_ca else None
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())],
                                       root_certificates=root, require_client_auth=root is not None)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls without a valid API key (UNAUTHENTICATED); health checks stay open."""

    def __init__(self, keys: Iterable[str]):
        self._keys = [k.encode() for k in keys]

    def _allowed(self, metadata) -> bool:
        sent = next((v for k, v in metadata or () if k == API_KEY_HEADER), None)
        if sent is None:
            return False
        sent = sent.encode() if isinstance(sent, str) else sent
        ok = False
        for key in self._keys:  # no early exit: timing does not depend on which key matched
            ok |= hmac.compare_digest(sent, key)
        return ok

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHODS_PREFIX) or \
                self._allowed(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        method = handler_call_details.method.rsplit("/", 1)[-1]
        log.warning("call refused method=%s status=UNAUTHENTICATED", method)  # never the key that was sent

        async def deny(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key; give the client the "
                                "key the server was started with (--api-key-file FILE or INFEMERAL_API_KEY)")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class _ApiKeyClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, key: str):
        self._key = key

    def _details(self, details):
        metadata = list(details.metadata or []) + [(API_KEY_HEADER, self._key)]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(details, metadata)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata):
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = base.wait_for_ready, getattr(base, "compression", None)
        self.metadata = metadata


def client_channel(address: str, *, tls_ca: Path | None = None, client_cert: Path | None = None,
                   client_key: Path | None = None, server_name: str | None = None, api_key: str | None = None,
                   options: list | None = None) -> grpc.Channel:
    """A channel to the server: TLS when a CA/certificate to trust is given, plaintext otherwise."""
    options = list(options or [])
    if tls_ca is not None:
        if (client_cert is None) != (client_key is None):
            raise ValueError("mutual TLS needs both tls_client_cert and tls_client_key")
        creds = grpc.ssl_channel_credentials(
            root_certificates=Path(tls_ca).read_bytes(),
            private_key=Path(client_key).read_bytes() if client_key else None,
            certificate_chain=Path(client_cert).read_bytes() if client_cert else None)
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        channel = grpc.secure_channel(address, creds, options=options)
    else:
        if not is_loopback(host_of(address)):
            log.warning("connecting to %s without TLS: hidden states and the session key travel in the clear; "
                        "set INFEMERAL_TLS_CA", address)
        channel = grpc.insecure_channel(address, options=options)
    if api_key:
        channel = grpc.intercept_channel(channel, _ApiKeyClientInterceptor(api_key))
    return channel
