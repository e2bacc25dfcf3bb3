"""A channel to the server beside the client bundle's manifest, without the model.

What `infemeral-client info` and `delete` need: they ask the server something
about a bundle or a session and load neither torch nor the laptop's half, so
they answer in well under a second. `Client` is the full SDK.
"""

from __future__ import annotations

import logging
from pathlib import Path

import grpc

from infemeral.cloak.manifest import client_manifest
from infemeral.errors import from_rpc_error
from infemeral.protocol import pb, pb_grpc
from infemeral.transport import client_channel

log = logging.getLogger(__name__)

RPC_TIMEOUT = 30.0  # seconds for one of these small calls (a Client's own calls use the same bound)


def warn_if_unverified(info: pb.ServerInfo, address: str) -> None:
    """Say so when the server did not check its bundle's files (--no-verify-bundle): the fingerprint it reports
    comes from the manifest, and altered layers behind it would answer every turn unnoticed."""
    if info.bundle_unverified:
        log.warning("the server at %s did not check its bundle's files against their hashes (it was started with "
                    "--no-verify-bundle): it may serve altered layers under the fingerprint it reports; restart it "
                    "without that flag", address)


class ServerLink:
    """The server's stub over a channel set up as a `Client`'s (TLS, API key), and the client bundle's manifest."""

    def __init__(self, server: str, client_bundle: str | Path, *, timeout: float = RPC_TIMEOUT,
                 tls_ca: Path | None = None, tls_client_cert: Path | None = None,
                 tls_client_key: Path | None = None, tls_server_name: str | None = None, api_key: str | None = None):
        self.manifest = client_manifest(client_bundle)
        self.address = server
        self.timeout = min(timeout, RPC_TIMEOUT)
        self.channel = client_channel(server, tls_ca=tls_ca, client_cert=tls_client_cert, client_key=tls_client_key,
                                      server_name=tls_server_name, api_key=api_key)
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
        try:
            info = self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        warn_if_unverified(info, self.address)
        return info

    def delete_session(self, session_id: bytes, key: bytes) -> None:
        """Remove a session's stored state from the server (what `Session.delete` does)."""
        try:
            self.stub.DeleteSession(pb.DeleteSessionRequest(session_id=session_id, session_key=key),
                                    timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "ServerLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
