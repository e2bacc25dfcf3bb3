"""The chat page's parts without a model or a browser: its files and headers, the key on its routes, how a
saved conversation's session is leased, the fork route, what the wire meter counts, the audit route's answer,
and `serve --open`. The page in a real browser is tests/endpoint/test_chat_browser.py."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from tests.support.http_endpoint import Uvicorn
from infemeral.audit.report import AuditReport, Row
from infemeral.endpoint import serve as serve_module
from infemeral.client.session import Session
from infemeral.client.session_store import SessionStore
from infemeral.endpoint.app import create_app
from infemeral.endpoint.conversations import Conversations
from infemeral.endpoint.page import MEDIA_TYPES, STATIC
from infemeral.endpoint.serving_pod import ServingPod
from infemeral.endpoint.session_pool import SessionPool
from infemeral.endpoint.settings import ServeSettings
from infemeral.endpoint.wire_meter import WireBytes, WireMeter, counting
from infemeral.errors import Aborted, StatusError, Unavailable
from infemeral.kvcache.cache import KVCache
from infemeral.protocol import pb

MODEL = "page-model"
KEY = "s3cret"


class NoClient:
    """What the app needs of a pool's client before a request reaches the SDK: a link to show, no server."""

    address = "pod.example:50051"
    link = SimpleNamespace(tls=True, mutual_tls=False)
    draft_model = draft_head = None

    def server_info(self):
        raise Unavailable("not reachable in this test [UNAVAILABLE]")


class NoPool:
    client = NoClient()

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def app_url():
    http = Uvicorn(create_app(NoPool(), MODEL, api_key=KEY))
    yield http
    http.stop()


def get(port: int, path: str, headers: dict | None = None) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", path, headers=headers or {})
    response = connection.getresponse()
    response.body = response.read()
    connection.close()
    return response


# -- the page's files and headers -------------------------------------------------------------------------
def test_the_page_is_served_without_the_key_and_with_headers_that_keep_it_to_this_origin(app_url):
    for path, name in (("/", "index.html"), ("/static/chat.js", "chat.js"), ("/static/chat.css", "chat.css")):
        response = get(app_url.port, path)
        assert response.status == 200 and response.body == (STATIC / name).read_bytes()
        assert response.getheader("Content-Type") == MEDIA_TYPES[name]
        policy = dict(part.strip().split(" ", 1) for part in response.getheader("Content-Security-Policy").split(";"))
        assert policy["default-src"] == "'self'" and policy["script-src"] == "'self'"  # no inline script
        assert policy["connect-src"] == "'self'" and policy["object-src"] == "'none'"
        assert policy["frame-ancestors"] == "'none'"
        assert response.getheader("X-Content-Type-Options") == "nosniff"
        assert response.getheader("Referrer-Policy") == "no-referrer"
    assert get(app_url.port, "/static/../app.py").status == 404
    assert get(app_url.port, "/static/page.py").status == 404


def test_the_pages_json_routes_ask_for_the_key(app_url):
    for path in ("/v1/pod", "/v1/conversations", "/v1/conversations/x"):
        assert get(app_url.port, path).status == 401
    response = get(app_url.port, "/v1/pod", {"Authorization": f"Bearer {KEY}"})
    pod = json.loads(response.body)
    assert response.status == 200 and pod["address"] == NoClient.address and pod["tls"] is True
    assert pod["reachable"] is False and pod["never_sent"] == ["text", "token ids", "logits"]
    assert pod["fork"] is False and "draft" not in pod["speculate"] and "head" not in pod["speculate"]
    response = get(app_url.port, "/v1/conversations", {"Authorization": f"Bearer {KEY}"})
    assert response.status == 404  # this app was given no store


def post(port: int, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                        **({"Authorization": f"Bearer {key}"} if key else {})})
    response = connection.getresponse()
    answer = response.status, json.loads(response.read())
    connection.close()
    return answer


@pytest.mark.parametrize("extra, param", [({"speculate": "draft"}, "speculate"), ({"speculate": "head"}, "speculate"),
                                          ({"speculate": "fast"}, "speculate"),
                                          ({"conversation": "../etc/passwd"}, "conversation"),
                                          ({"conversation": "chat"}, "conversation")])
def test_a_speculation_without_its_source_and_a_conversation_the_endpoint_cannot_keep_are_a_400(app_url, extra,
                                                                                               param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **extra}
    status, answer = post(app_url.port, "/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param  # "chat": a good name, but this app keeps none


def test_a_host_name_not_allowed_is_refused_for_the_page_too(app_url):
    assert get(app_url.port, "/", {"Host": "evil.example"}).status == 403


def test_the_page_loads_nothing_from_elsewhere_and_runs_no_inline_script():
    html = (STATIC / "index.html").read_text()
    everything = html + (STATIC / "chat.js").read_text() + (STATIC / "chat.css").read_text()
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", everything, re.I), "a load from another origin"
    assert re.findall(r"<script[^>]*>", html) == ['<script src="/static/chat.js" defer>']
    assert "</script>" in html and re.search(r"<script[^>]*>\s*</script>", html)  # an empty element: no inline code
    assert not re.search(r"\son[a-z]+\s*=", html, re.I) and "javascript:" not in everything  # no inline handlers
    assert "@import" not in everything and "url(" not in everything


# -- a saved conversation's session in the pool -----------------------------------------------------------
class FakeSession:
    def __init__(self, history: list[int], version: int = 1):
        self.history_ids, self.version, self.pending_commit = history, version, None
        self.deleted = False

    def delete(self):
        self.deleted = True


class FakeClient:
    def __init__(self):
        self.opened = []

    def new_session(self):
        self.opened.append(FakeSession([]))
        return self.opened[-1]


def test_a_saved_conversations_session_serves_that_conversation_alone():
    pool = SessionPool(FakeClient(), max_sessions=1)
    saved = FakeSession([1, 2, 3, 4])
    assert pool.acquire([1, 2, 3, 4, 5], conversation="trip", resume=lambda: saved) is saved  # loaded from its file
    pool.release(saved)
    other = pool.acquire([1, 2, 3, 4, 5])  # the same prefix, but no conversation: not that session
    assert other is not saved and not saved.deleted  # and the bound evicts it without deleting it on the server
    pool.release(other)
    assert pool.acquire([1, 9], conversation="trip", resume=lambda: None) is not saved  # it left the pool
    pool = SessionPool(FakeClient(), max_sessions=4)
    session = pool.acquire([1], conversation="trip", resume=lambda: saved)
    with pytest.raises(Aborted):  # one session per conversation: a second request waits for the first
        pool.acquire([1], conversation="trip")
    with pytest.raises(Aborted):
        pool.forget("trip")
    pool.release(session)
    assert pool.acquire([7, 7], conversation="trip") is saved  # reused whatever it drops (a regenerated answer)
    pool.release(saved)
    pool.rename("trip", "voyage")
    assert pool.acquire([1], conversation="voyage") is saved
    pool.release(saved)
    pool.forget("voyage")
    assert pool.num_sessions == 0
    pool.close()
    assert not saved.deleted  # its file keeps it: deleting it is the user's call


# -- forking a saved conversation on the pod ------------------------------------------------------------------
class ForkingPod:
    """A client whose pod forks sessions (or, told so, is too old to): real sessions and session files, a
    one-layer cache of two numbers per token, no model."""

    address = "pod.example:50051"
    tls = mutual_tls = True
    draft_model = draft_head = None
    timeout = 5
    bundle = SimpleNamespace(server_fingerprint="ab" * 32)
    model = SimpleNamespace(new_cache=lambda: KVCache(0, 1, 1, 2, torch.float32))

    def __init__(self):
        self.link, self.forks, self.lengths, self.old = self, [], {}, False

    def server_info(self):
        return SimpleNamespace(sink_tokens=0, first_layer=1, num_layers=1, total_layers=2, server_version="test",
                               model_type="llama", dtype="float32", device="cpu", max_context=256)

    def new_session(self):
        return Session(self)

    def load_session(self, path):
        return Session.load(self, path)

    def fork_session(self, request, timeout):
        if self.old:  # what ServerLink.fork_session raises for an older server's UNIMPLEMENTED
            raise StatusError(f"the server at {self.address} is older than this client and cannot fork sessions; "
                              "upgrade it, or start a new session", grpc.StatusCode.UNIMPLEMENTED)
        self.forks.append(request)
        self.lengths[request.session_id] = self.lengths[request.source_id] - request.drop
        return pb.ForkSessionResponse(version=1, cache_length=self.lengths[request.session_id])


def saved_conversation(pod: ForkingPod, store: SessionStore, name: str, turns: int) -> Session:
    """A conversation of `turns` exchanges of 10 tokens each, saved as `name`."""
    session = Session(pod)
    session.messages = [{"role": "system", "content": "Be brief."}]
    for turn in range(turns):
        session.messages += [{"role": "user", "content": f"question {turn}"},
                             {"role": "assistant", "content": f"answer {turn}"}]
        session.history_ids += [turn] * 10
        session.turn_ends.append((len(session.history_ids), len(session.messages)))
    session.version = turns
    session.cache.set_length(len(session.history_ids))
    session.save(store.path(name))
    pod.lengths[session.id] = len(session.history_ids)
    return session


def test_the_fork_route_saves_a_new_conversation_made_on_the_pod(tmp_path):
    pod = ForkingPod()
    pool = SessionPool(pod, max_sessions=4)
    store = SessionStore(tmp_path, pod.bundle.server_fingerprint)
    source = saved_conversation(pod, store, "trip", turns=3)
    kept = store.path("trip").read_bytes()
    http = Uvicorn(create_app(pool, MODEL, api_key=KEY, conversations=Conversations(store, pool)))
    try:
        def pod_view() -> dict:
            return json.loads(get(http.port, "/v1/pod", {"Authorization": f"Bearer {KEY}"}).body)

        view = pod_view()
        assert view["fork"] is True and view["reachable"] and view["served_layers"] == "1-1 of 2"  # until refused
        assert post(http.port, "/v1/conversations/trip/fork", {}, key=None)[0] == 401
        status, body = post(http.port, "/v1/conversations/trip/fork", {"at_turn": 2, "name": "trip-2"})
        assert status == 200 and body == {"name": "trip-2", "messages": source.messages[:5]}
        (request,) = pod.forks
        assert (request.source_id, request.source_key, request.source_version) == (source.id, source.key, 3)
        assert request.drop == 10 and request.session_id != source.id  # its own id: turn 3 left on the pod
        fork = pod.load_session(store.path("trip-2"))
        assert (fork.id, fork.key, fork.version) == (request.session_id, request.session_key, 1)
        assert fork.history_ids == source.history_ids[:20] and fork.messages == source.messages[:5]
        assert store.path("trip").read_bytes() == kept  # the source as it was
        status, body = post(http.port, "/v1/conversations/trip/fork", {})  # every turn, under a name made for it
        assert status == 200 and body["name"].startswith("trip-fork-") and body["messages"] == source.messages
        assert pod.forks[-1].drop == 0 and store.messages(body["name"]) == source.messages
        for refused, status in (({"name": "trip-2"}, 409), ({"at_turn": 4}, 400), ({"at_turn": 0}, 400),
                                ({"name": "../trip"}, 400)):
            assert post(http.port, "/v1/conversations/trip/fork", refused)[0] == status, refused
        assert post(http.port, "/v1/conversations/nowhere/fork", {})[0] == 404
        assert len(pod.forks) == 2 and len(list(tmp_path.iterdir())) == 3
        pod.old = True
        status, body = post(http.port, "/v1/conversations/trip/fork", {})
        assert status == 502 and "older than this client" in body["error"]["message"]
        assert pod_view()["fork"] is False and len(list(tmp_path.iterdir())) == 3  # the page's button goes
    finally:
        http.stop()


# -- bytes on the wire -------------------------------------------------------------------------------------
class FakeCall:
    def __init__(self, requests, responses):
        self.requests, self.responses = requests, iter(responses)
        self.cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        for _ in self.requests:  # gRPC sends the requests as the call goes
            pass
        return next(self.responses)

    def cancel(self):
        self.cancelled = True


def test_the_wire_meter_counts_the_turns_opened_while_an_answer_counts():
    request = pb.TurnRequest(open=pb.OpenTurn(session_id=b"s" * 16, session_key=b"k" * 32))
    reply = pb.TurnResponse(opened=pb.Opened(version=3))
    meter, wire = WireMeter(), WireBytes()

    def turn():
        return meter.intercept_stream_stream(lambda details, requests: FakeCall(requests, [reply, reply]),
                                             SimpleNamespace(method="/infemeral.Infemeral/Turn"), iter([request]))

    with counting(wire):
        call = turn()
    assert list(call) == [reply, reply]
    assert wire.sent == request.ByteSize() > 48 and wire.received == 2 * reply.ByteSize()
    call.cancel()
    assert call.cancelled  # the rest of the call is the call's
    uncounted = turn()  # opened outside an answer: nobody's
    list(uncounted)
    assert wire.sent == request.ByteSize() and isinstance(uncounted, FakeCall)


# -- the audit route ---------------------------------------------------------------------------------------
def test_the_audit_route_flags_each_token_of_the_first_message(monkeypatch):
    import infemeral.audit

    seen = {}

    def fake_audit(text, bundle, *, system=None):
        seen.update(text=text, bundle=bundle, system=system)
        rows = [Row("vocabulary", "vocabulary matching", "public weights", "100 %", "100 %", "1 s",
                    user_recovered=[True, True, False]),
                Row("gram", "Gram linking", "traffic", "AUC 1", "3/3", "0 s")]
        return AuditReport(5, 3, 1, "float32", "simulated", rows, user_token_text=["My", " PIN", " 1234"])

    monkeypatch.setattr(infemeral.audit, "audit", fake_audit)
    conversations = SimpleNamespace(first_message=lambda name: ("My PIN 1234", "Be brief."))
    client = SimpleNamespace(bundle=SimpleNamespace(directory=Path("/bundles/client")))
    answer = ServingPod(SimpleNamespace(client=client), conversations).audit("trip")
    assert seen == {"text": "My PIN 1234", "bundle": Path("/bundles/client"), "system": "Be brief."}
    assert answer["tokens"] == ["My", " PIN", " 1234"]
    assert answer["rows"] == [{"key": "vocabulary", "attack": "vocabulary matching", "observer": "public weights",
                               "user_text": "100 %", "recovered": [True, True, False]}]  # rows without flags left out
    assert answer["verdict"]


# -- serve --open ------------------------------------------------------------------------------------------
def test_serve_open_opens_the_page_once_the_endpoint_listens(monkeypatch, tmp_path):
    opened, listened = [], []

    def run(app, host, port, **options):  # uvicorn, listening a moment after it was called
        time.sleep(0.3)
        with socket.create_server((host, port)):
            listened.append(time.monotonic())
            deadline = time.monotonic() + 10
            while not opened and time.monotonic() < deadline:  # serve until the browser was opened
                time.sleep(0.01)

    class Client:
        bundle = SimpleNamespace(directory=tmp_path / "tiny" / "client", server_fingerprint="f")
        link, address, draft_model, draft_head = NoClient.link, "pod:1", None, None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def server_info(self):
            raise Unavailable("down [UNAVAILABLE]")

    import uvicorn
    import webbrowser

    from tests.conftest import free_port

    monkeypatch.setattr(uvicorn, "run", run)
    monkeypatch.setattr(webbrowser, "open", lambda url: opened.append((url, time.monotonic())) or True)
    port = free_port()
    assert serve_module.serve(ServeSettings(port=port, open=True), Client, lambda client: None, "pod:1",
                              tmp_path / "sessions") == 0
    assert [url for url, _ in opened] == [f"http://127.0.0.1:{port}/"] and opened[0][1] >= listened[0]
    assert serve_module.page_url("0.0.0.0", 8080) == "http://127.0.0.1:8080/"
    assert serve_module.page_url("::1", 8080) == "http://[::1]:8080/"


def test_serve_takes_open_as_a_flag():
    from infemeral.cli.main import build_parser
    from infemeral.settings_flags import settings_from_args

    args = build_parser().parse_args(["serve", "--open", "--sessions-dir", "/tmp/chats"])
    assert settings_from_args(ServeSettings, args).open is True and args.sessions_dir == "/tmp/chats"
    assert settings_from_args(ServeSettings, build_parser().parse_args(["serve"])).open is False
