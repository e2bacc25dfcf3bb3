"""A channel to the server beside the client bundle's manifest, without the model.

What `infemeral-client info` and `delete` need: they ask the server something
about a bundle or a session and load neither torch nor the laptop's half, so
they answer in well under a second. `Client` is the full SDK.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from infemeral.cloak.manifest import client_manifest
from infemeral.errors import from_rpc_error
from infemeral.protocol import pb, pb_grpc
from infemeral.transport import client_channel

RPC_TIMEOUT = 30.0  # seconds for one of these small calls (a Client's own calls use the same bound)


class ServerLink:
    """The server's stub over a channel set up as a `Client`'s (TLS, API key), and the client bundle's manifest."""

    def __init__(self, server: str, client_bundle: str | Path, *, timeout: float = RPC_TIMEOUT,
                 tls_ca: Path | None = None, tls_client_cert: Path | None = None,
                 tls_client_key: Path | None = None, tls_server_name: str | None = None, api_key: str | None = None):
        self.manifest = client_manifest(client_bundle)
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
            return self.stub.GetServerInfo(pb.ServerInfoRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

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
