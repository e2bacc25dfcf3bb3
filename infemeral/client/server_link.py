"""The one channel to the server, beside the client bundle's manifest, without the model.

A `Client` (the full SDK) makes every call through the `ServerLink` it holds.
`infemeral-client info` and `delete` use one alone: they ask the server
something about a bundle or a session and load neither torch nor the laptop's
half, so they answer in well under a second.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from infemeral.client.stream import retry_at_limits, status_error
from infemeral.cloak.manifest import client_manifest
from infemeral.errors import StatusError, from_rpc_error
from infemeral.protocol import pb, pb_grpc
from infemeral.transport import client_channel

log = logging.getLogger(__name__)

RPC_TIMEOUT = 30.0  # most seconds for one small call (server info, delete); a turn takes the Client's timeout


def warn_if_unverified(info: pb.ServerInfo, address: str) -> None:
    """Say so when the server did not check its bundle's files (--no-verify-bundle): the fingerprint it reports
    comes from the manifest, and altered layers behind it would answer every turn unnoticed."""
    if info.bundle_unverified:
        log.warning("the server at %s did not check its bundle's files against their hashes (it was started with "
                    "--no-verify-bundle): it may serve altered layers under the fingerprint it reports; restart it "
                    "without that flag", address)


class ServerLink:
    """The server's stub over one channel (TLS, API key, then `interceptors`), and the client bundle's manifest.

    `options` are gRPC channel options; `timeout` bounds each small call, at most `RPC_TIMEOUT`."""

    def __init__(self, server: str, client_bundle: str | Path, *, timeout: float = RPC_TIMEOUT,
                 tls_ca: str | Path | None = None, tls_client_cert: str | Path | None = None,
                 tls_client_key: str | Path | None = None, tls_server_name: str | None = None,
                 api_key: str | None = None, options: list | None = None, interceptors: list | None = None):
        self.manifest = client_manifest(client_bundle)
        self.address = server
        self.tls = tls_ca is not None  # what the channel is, for those who show it
        self.mutual_tls = self.tls and tls_client_cert is not None
        self.timeout = min(timeout, RPC_TIMEOUT)
        self.channel = client_channel(server, tls_ca=tls_ca, client_cert=tls_client_cert, client_key=tls_client_key,
                                      server_name=tls_server_name, api_key=api_key, options=options)
        if interceptors:
            self.channel = grpc.intercept_channel(self.channel, *interceptors)
        self.stub = pb_grpc.InfemeralStub(self.channel)

    @classmethod
    def from_settings(cls, settings) -> "ServerLink":
        """From a `ClientSettings`."""
        return cls(settings.server, settings.client_bundle, **settings.connection())

    @property
    def server_fingerprint(self) -> str:
        """The fingerprint of the server bundle this client bundle was prepared with."""
        return self.manifest["server_fingerprint"]

    def server_info(self) -> pb.ServerInfo:
        """The server's info, fetched now (warning once if the server did not check its bundle)."""
        try:
            info = self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        warn_if_unverified(info, self.address)
        return info

    def delete_session(self, session_id: bytes, key: bytes) -> None:
        """Remove a session's stored state from the server (`Session.delete`, and `infemeral-client delete`)."""
        try:
            self.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id, session_key=key),
                                    timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def fork_session(self, request: pb.ForkSessionRequest, timeout: float) -> pb.ForkSessionResponse:
        """Make a new session on the server from a committed one (`Session.fork`); `timeout`: the server
        re-encrypts the whole cache, so this is no small call. A fork takes a turn slot, so while the server is at
        a limit it is asked again as a turn's open is (`retry_at_limits`), all within `timeout`."""

        def attempt(seconds_left: float) -> pb.ForkSessionResponse:
            try:
                return self.stub.ForkSession(request, timeout=seconds_left)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise StatusError(f"the server at {self.address} is older than this client and cannot fork "
                                      "sessions; upgrade it, or start a new session", e.code()) from None
                raise status_error(e) from None

        return retry_at_limits(attempt, timeout, "forking the session")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "ServerLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
