"""A Client reaches the server through the one `ServerLink` it holds: one channel, and every call made on it."""

from __future__ import annotations

import grpc

from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.client.server_link import ServerLink


class MethodRecorder(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """The name of every call made on the channel it intercepts, in order."""

    def __init__(self):
        self.methods: list[str] = []

    def _record(self, details) -> None:
        method = details.method
        self.methods.append((method.decode() if isinstance(method, bytes) else method).rsplit("/", 1)[-1])

    def intercept_unary_unary(self, continuation, client_call_details, request):
        self._record(client_call_details)
        return continuation(client_call_details, request)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        self._record(client_call_details)
        return continuation(client_call_details, request_iterator)


def test_a_client_opens_one_channel_and_makes_every_call_on_its_links(server, bundles, monkeypatch):
    """Server info, a turn and a delete all travel on the one channel the client's link opened."""
    address = f"127.0.0.1:{server.port}"
    opened = []
    plain_channel = grpc.insecure_channel  # what transport.client_channel opens without TLS

    def counted(target, *args, **kwargs):
        opened.append(target)
        return plain_channel(target, *args, **kwargs)

    monkeypatch.setattr(grpc, "insecure_channel", counted)
    recorder = MethodRecorder()
    with Client(address, bundles.client_dir, timeout=120, interceptors=[recorder]) as client:
        assert opened == [address]
        assert client.channel is client.link.channel and client.stub is client.link.stub
        client.generate("Hi", SamplingParams(max_new_tokens=1))  # a fresh session, deleted after its turn
    assert recorder.methods == ["GetServerInfo", "Turn", "DeleteSession"]


def test_deleting_a_session_and_fetching_info_go_through_the_link(client, monkeypatch):
    """One wrapper for each call: `Session.delete` is the link's `delete_session`, and a Client's info fetch is
    the link's `server_info` (which warns, once per fetch, about an unverified server bundle)."""
    calls = []
    delete, info = ServerLink.delete_session, ServerLink.server_info

    def deleted(link, session_id, key):
        calls.append(("delete", link, session_id, key))
        return delete(link, session_id, key)

    def fetched(link):
        calls.append(("info", link))
        return info(link)

    monkeypatch.setattr(ServerLink, "delete_session", deleted)
    monkeypatch.setattr(ServerLink, "server_info", fetched)
    session = client.new_session()
    session.chat("Hi", SamplingParams(max_new_tokens=1))
    calls.clear()  # whether the turn fetched the info depends on the tests before: the shared client caches it
    session.delete()
    assert session.version == 0
    client.server_info(refresh=True)
    client.server_info()  # cached: no second fetch
    assert calls == [("delete", client.link, session.id, session.key), ("info", client.link)]
