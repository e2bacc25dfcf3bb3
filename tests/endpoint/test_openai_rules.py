"""The endpoint's rules, without a model: which host names it answers, how large a body it reads, which
values it refuses, and which failures of a pooled session start the request over on a new one."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.support.http_endpoint import Uvicorn
from infemeral.endpoint.answer import Answer, session_is_gone
from infemeral.endpoint.app import create_app
from infemeral.endpoint.errors import to_request_error
from infemeral.endpoint.guard import RequestGuard
from infemeral.endpoint.serve import allowed_hosts, check_hosts, is_wildcard
from infemeral.endpoint.settings import ServeSettings
from infemeral.errors import Aborted, DataLoss, NotFound, Unavailable
from infemeral.transport import host_of, is_loopback

MODEL = "rules-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
BODY_CAP = 1000  # the test app's cap on request bodies, in bytes


class NoClient:
    """What the app needs of a pool before a request reaches the SDK: nothing here gets that far."""

    client = None

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def app_url():
    http = Uvicorn(create_app(NoClient(), MODEL, max_body_bytes=BODY_CAP))
    yield http
    http.stop()


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            chunks: list[bytes] | None = None) -> tuple[int, dict]:
    """One HTTP request with exactly the given headers (http.client adds only Host unless told otherwise)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = dict(headers or {})
        connection.putrequest(method, path, skip_host="Host" in headers, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        if chunks is not None:
            connection.putheader("Transfer-Encoding", "chunked")
            connection.endheaders()
            for chunk in chunks:
                connection.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            connection.send(b"0\r\n\r\n")
        else:
            if body is not None and "Content-Length" not in headers:
                connection.putheader("Content-Length", str(len(body)))
            connection.endheaders(body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def error_of(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# -- host names (DNS rebinding) ---------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LocalHost", "127.3.4.5:{port}",
                                  "[::1]:{port}", "[::1]", "localhost."])
def test_loopback_host_names_are_answered(app_url, host):
    status, body = request(app_url.port, "GET", "/v1/models", headers={"Host": host.format(port=app_url.port)})
    assert status == 200 and body["data"][0]["id"] == MODEL


@pytest.mark.parametrize("host", ["attacker.example", "attacker.example:{port}", "127.0.0.1.nip.io:{port}",
                                  "localhost.attacker.example", "10.0.0.2:{port}", "localhost:80x", ""])
def test_other_host_names_are_refused_with_an_openai_error(app_url, host):
    for method, path, body in (("GET", "/v1/models", None),
                               ("POST", "/v1/chat/completions", json.dumps(CHAT).encode())):
        status, reply = request(app_url.port, method, path, body,
                                headers={"Host": host.format(port=app_url.port), "Content-Type": "application/json"})
        error = error_of(reply)
        assert status == 403 and error["code"] == "host_not_allowed"
        assert "--allowed-hosts" in error["message"] and "DNS rebinding" in error["message"]


def test_allowed_hosts_add_names_and_a_wildcard_answers_any():
    guard = RequestGuard(None, ["box.lan", "*.example.com", "[fe80::1]:8080", "10.0.0.2"])
    assert all(guard.allows(h) for h in ("box.lan", "BOX.lan:8080", "a.example.com", "a.b.example.com:1",
                                         "[fe80::1]", "10.0.0.2:80", "localhost:1"))
    assert not any(guard.allows(h) for h in ("example.com", "lan", "box.lan.evil", "10.0.0.3", "fe80::2", ""))
    assert RequestGuard(None, ["*"]).allows("anything.example:1")
    assert not RequestGuard(None, []).allows("anything.example")


def test_allowed_hosts_setting_and_the_listen_address():
    assert ServeSettings().allowed_hosts == []
    assert ServeSettings(allowed_hosts="box.lan, 10.0.0.2,").allowed_hosts == ["box.lan", "10.0.0.2"]
    assert ServeSettings(allowed_hosts=["box.lan"]).allowed_hosts == ["box.lan"]
    assert allowed_hosts("127.0.0.1", []) == [] and allowed_hosts("::1", ["a"]) == ["a"]
    assert allowed_hosts("192.168.1.5", ["a"]) == ["a", "192.168.1.5"]  # clients reach it by that address
    assert allowed_hosts("0.0.0.0", []) == [] and is_wildcard("::") and is_wildcard("0.0.0.0")


def test_listening_on_every_interface_says_what_to_set(capsys):
    check_hosts("0.0.0.0", [])
    assert "--allowed-hosts" in capsys.readouterr().err
    for host, allowed in (("0.0.0.0", ["box.lan"]), ("192.168.1.5", ["192.168.1.5"]), ("127.0.0.1", [])):
        check_hosts(host, allowed)
        assert capsys.readouterr().err == ""


def test_the_serve_command_reads_allowed_hosts_from_the_environment(monkeypatch):
    monkeypatch.setenv("INFEMERAL_SERVE_ALLOWED_HOSTS", "box.lan,*.example.com")
    monkeypatch.setenv("INFEMERAL_SERVE_MAX_BODY_BYTES", "2048")
    settings = ServeSettings()
    assert settings.allowed_hosts == ["box.lan", "*.example.com"] and settings.max_body_bytes == 2048


def test_one_loopback_rule_for_hosts_and_addresses():
    for host in ("localhost", "127.0.0.1", "127.255.0.1", "::1", "[::1]", "LOCALHOST", "localhost."):
        assert is_loopback(host), host
    for host in ("", "0.0.0.0", "::", "10.0.0.1", "example.com", "localhost.example.com", "127.0.0.1.nip.io"):
        assert not is_loopback(host), host
    assert [host_of(a) for a in ("127.0.0.1:50051", "[::1]:50051", "localhost", "::1", "[fe80::1]", ":50051")] == \
        ["127.0.0.1", "::1", "localhost", "::1", "fe80::1", ""]


# -- body size --------------------------------------------------------------------------------------------
def test_a_declared_body_over_the_cap_is_a_413_before_it_is_read(app_url):
    # only the headers are sent: the answer comes without the body ever being read
    status, body = request(app_url.port, "POST", "/v1/chat/completions",
                           headers={"Content-Type": "application/json", "Content-Length": str(200 * 2**20)})
    error = error_of(body)
    assert status == 413 and error["code"] == "request_too_large" and "--max-body-bytes" in error["message"]


def test_a_chunked_body_over_the_cap_is_a_413(app_url):
    status, body = request(app_url.port, "POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                           chunks=[b"x" * 600, b"y" * 600])
    assert status == 413 and error_of(body)["code"] == "request_too_large"


def test_a_body_within_the_cap_reaches_the_route(app_url):
    # chunked and within the cap: the route sees the whole body (and refuses this one for its model)
    payload = json.dumps({**CHAT, "model": "other"}).encode()
    status, body = request(app_url.port, "POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                           chunks=[payload[:20], payload[20:]])
    assert status == 404 and error_of(body)["code"] == "model_not_found"


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_body_of_exactly_the_cap_reaches_the_route_and_one_byte_more_does_not(app_url, chunked):
    payload = json.dumps({**CHAT, "model": "other"}).encode()
    payload += b" " * (BODY_CAP - len(payload))  # trailing whitespace is still valid JSON

    def send(body: bytes) -> tuple[int, dict]:
        if chunked:
            return request(app_url.port, "POST", "/v1/chat/completions",
                           headers={"Content-Type": "application/json"}, chunks=[body[:500], body[500:]])
        return request(app_url.port, "POST", "/v1/chat/completions", body, headers={"Content-Type": "application/json"})

    status, body = send(payload)
    assert len(payload) == BODY_CAP and status == 404 and error_of(body)["code"] == "model_not_found"
    status, body = send(payload + b" ")
    assert status == 413 and error_of(body)["code"] == "request_too_large"


# -- values -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**64, -2**63 - 1, 10**30])
def test_a_seed_a_64_bit_generator_cannot_take_is_a_400(app_url, seed):
    payload = json.dumps({**CHAT, "seed": seed}).encode()
    status, body = request(app_url.port, "POST", "/v1/chat/completions", payload,
                           headers={"Content-Type": "application/json"})
    assert status == 400 and error_of(body)["param"] == "seed"


TEXT_PARTS = [{"type": "text", "text": "ok"}, {"type": "text", "text": "\ud800"}]


@pytest.mark.parametrize("extra, param", [({"max_tokens": 2**64}, "max_tokens"),
                                          ({"max_completion_tokens": 2**70}, "max_completion_tokens"),
                                          ({"messages": [{"role": "user", "content": "\udcff"}]}, "messages.0.content"),
                                          ({"messages": [{"role": "user", "content": TEXT_PARTS}]},
                                           "messages.0.content.1.text"),
                                          ({"stop": ["fine", "\udfff"]}, "stop.1")])
def test_values_that_would_fail_later_are_a_400(app_url, extra, param):
    """Too large for the wire (an answer length above a uint64), or no text at all (a lone surrogate that
    JSON can escape but nothing can encode): refused at once rather than failing with a 500."""
    status, body = request(app_url.port, "POST", "/v1/chat/completions", json.dumps({**CHAT, **extra}).encode(),
                           headers={"Content-Type": "application/json"})
    assert status == 400 and error_of(body)["param"] == param


def test_a_prompt_that_is_no_text_is_a_400(app_url):
    payload = json.dumps({"model": MODEL, "prompt": "a \udcff b"}).encode()
    status, body = request(app_url.port, "POST", "/v1/completions", payload,
                           headers={"Content-Type": "application/json"})
    assert status == 400 and error_of(body)["param"] == "prompt"


# -- which failures start a request over on a new session -------------------------------------------------
class FakeSession:
    def __init__(self, version: int):
        self.version = version


class FakePool:
    def __init__(self, *versions: int):
        self.sessions = [FakeSession(v) for v in versions]
        self.handed, self.discarded, self.released, self.fresh = [], [], [], []

    def acquire(self, prompt_ids, *, fresh=False):
        session = self.sessions[len(self.handed)]
        self.handed.append(session)
        self.fresh.append(fresh)
        return session

    def discard(self, session):
        self.discarded.append(session)

    def release(self, session):
        self.released.append(session)


def answer_failing_with(pool: FakePool, *errors) -> Answer:
    """An answer whose turns fail at once with `errors`, one per attempt, and then answer 'hello'."""
    failures = list(errors)

    def start(session):
        if failures:
            raise failures.pop(0)
        yield "hello"

    return Answer(pool, [1, 2, 3], start)


VERSION_REFUSED = Aborted("stored session is at version 2 but the client expects version 5; another client moved it "
                          "on or an old copy was restored [ABORTED]")


@pytest.mark.parametrize("gone", [NotFound("no stored state for this session [NOT_FOUND]"),
                                  DataLoss("stored session manifest is damaged [DATA_LOSS]"), VERSION_REFUSED])
def test_a_pooled_session_whose_state_is_gone_is_dropped_and_retried_once(gone):
    assert session_is_gone(gone)
    pool = FakePool(3, 0)
    answer = answer_failing_with(pool, gone)
    assert answer.first() == "hello"
    assert pool.discarded == [pool.sessions[0]] and answer.session is pool.sessions[1]
    assert pool.fresh == [False, True]  # the retry takes a new session, not another pooled one
    answer.close()
    assert pool.released == [pool.sessions[1]]


@pytest.mark.parametrize("transient", [
    Aborted("this session is in a turn; delete it when the turn has ended [ABORTED]"),
    Aborted("server holds 40 tokens for this session but the client holds 96; the session file is out of date"),
    Aborted("the window evicted 16 tokens, not the 0 agreed with the client [ABORTED]"),
    Unavailable("server unreachable [UNAVAILABLE]")])
def test_any_other_failure_keeps_the_committed_session(transient):
    assert not session_is_gone(transient)
    pool = FakePool(3, 0)
    answer = answer_failing_with(pool, transient)
    with pytest.raises(type(transient)):
        answer.first()
    answer.close()
    assert pool.discarded == [] and pool.released == [pool.sessions[0]] and pool.handed == [pool.sessions[0]]


def test_a_new_session_is_not_retried_and_a_retry_happens_once():
    pool = FakePool(0)
    with pytest.raises(NotFound):
        answer_failing_with(pool, NotFound("gone [NOT_FOUND]")).first()
    assert pool.handed == pool.discarded == pool.sessions  # nothing to retry: it had no state
    pool = FakePool(3, 1)
    with pytest.raises(NotFound):
        answer_failing_with(pool, NotFound("gone [NOT_FOUND]"), NotFound("gone again [NOT_FOUND]")).first()
    assert pool.discarded == pool.sessions


def test_aborted_is_a_409_that_says_the_request_can_be_sent_again():
    failure = to_request_error(Aborted("this session is in a turn [ABORTED]"))
    assert failure.status == 409 and failure.code == "aborted" and failure.headers == {"Retry-After": "1"}
    assert "nothing was committed" in failure.message and "sent again" in failure.message
