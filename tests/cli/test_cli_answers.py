"""`generate` and `chat` against a real server, in-process (no new Python per command): a prompt longer than the
server's context, a server that is not there or goes away mid-chat, what becomes of a chat's session when it ends,
and the sampling defaults (greedy one flag away)."""

from __future__ import annotations

import io
import logging
import shutil
import signal

import pytest

from tests.conftest import StoredSession, free_port, start_server
from tests.support.faults import TurnFault
from infemeral.cli import main as cli
from infemeral.cli.chat_repl import ChatRepl
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.client.settings import ClientSettings

MAX_CONTEXT = 128
LONG = "Please summarise this text: " + "the quick brown fox jumps over the lazy dog " * 25  # ~260 tokens


@pytest.fixture(scope="module")
def small_servers(bundles, tmp_path_factory):
    """Two servers of 128 tokens' context: the window on, and off."""
    servers = {window: start_server(bundles, tmp_path_factory.mktemp("small"), max_context=MAX_CONTEXT,
                                    window=window) for window in (True, False)}
    yield servers
    for srv in servers.values():
        srv.stop(0)


def generate(capsys, server_port, bundles, tmp_path, *argv) -> tuple[int, str, str]:
    code = cli.main(["generate", *map(str, argv), "--server", f"127.0.0.1:{server_port}", "--client-bundle",
                     str(bundles.client_dir), "--answer-index-dir", str(tmp_path / "answers")])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_prompt_longer_than_the_context_is_refused_unless_truncate(capsys, small_servers, bundles, client,
                                                                     tmp_path):
    prompt_tokens = len(client.chat_ids([{"role": "user", "content": LONG}]))
    assert prompt_tokens > 2 * MAX_CONTEXT
    code, out, err = generate(capsys, small_servers[True].port, bundles, tmp_path, LONG, "--max-new-tokens", 3)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (
        f"infemeral-client: the prompt is {prompt_tokens} tokens, and the server at 127.0.0.1:"
        f"{small_servers[True].port} holds at most {MAX_CONTEXT} (its --max-context): shorten the prompt, "
        "or pass --truncate to let the server's window drop its start")
    # Asked for: answered, and said on stderr without --verbose.
    code, out, err = generate(capsys, small_servers[True].port, bundles, tmp_path, LONG, "--max-new-tokens", 3,
                              "--truncate", "--greedy")
    assert code == 0 and out.strip()
    assert "[context window full: the oldest" in err and "tokens were dropped" in err
    # Without a window there is nothing to allow: the fix is a shorter prompt, not a new session.
    for extra in ((), ("--truncate",)):
        code, _, err = generate(capsys, small_servers[False].port, bundles, tmp_path, LONG, *extra)
        assert code == 2 and err.endswith(f"holds at most {MAX_CONTEXT} (its --max-context): shorten the prompt\n")


def test_no_server_there_says_where_and_how_to_start_one(capsys, bundles, tmp_path):
    port = free_port()  # nothing listens on it
    code, out, err = generate(capsys, port, bundles, tmp_path, "hi")
    assert code == 1 and out == ""
    assert err.splitlines()[-1] == (
        f"infemeral-client: no infemeral-server at 127.0.0.1:{port}: start one with `infemeral-server` "
        "(add --bundle DIR for a server bundle outside the default place), or point --server "
        "(INFEMERAL_SERVER) at a running one")


def test_a_broken_chat_template_is_one_line_naming_its_file(capsys, caplog, bundles, tmp_path):
    """Before any connection: through the tokenizer transformers loads (the edit makes the resolved file stale),
    then through the resolved one that start wrote again."""
    caplog.set_level(logging.WARNING)  # as in a fresh process: a server started in this one may have left INFO
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for item in bundles.client_dir.iterdir():  # the weights linked, the tokenizer copied to be broken
        if item.name == "tokenizer":
            shutil.copytree(item, bundle / item.name)
        else:
            (bundle / item.name).symlink_to(item)
    template = bundle / "tokenizer" / "chat_template.jinja"
    template.write_text(template.read_text() + "{% if messages %}")
    for _ in range(2):
        code = cli.main(["generate", "hi", "--server", f"127.0.0.1:{free_port()}", "--client-bundle", str(bundle),
                         "--answer-index-dir", str(tmp_path / "answers")])
        out, err = capsys.readouterr()
        assert code == 2 and out == ""
        assert err.startswith(f"infemeral-client: the chat template in {template} (line ") and err.count("\n") == 1
        assert "Unexpected end of template" in err and "`infemeral-client prepare --force`" in err, err


class StopServerMidAnswer(TurnFault):
    """Stops the real server once the answer of turn `nth` has begun (the client has seen `after` replies)."""

    def __init__(self, server, nth: int, after: int = 3):
        self.server, self.nth, self.after = server, nth, after
        self.turns = self.replies = 0

    def on_stream(self):
        self.turns += 1
        self.replies = 0

    def on_response(self, response) -> bool:
        self.replies += 1
        if self.turns == self.nth and self.replies == self.after:
            self.server.stop(0)
        return False


def chat(client, lines, tmp_path, *, name: str | None = None, params=SamplingParams(max_new_tokens=6)):
    settings = ClientSettings(sessions_dir=tmp_path / "sessions", chat_history="")
    path = settings.sessions_dir / f"{name}.session" if name else None
    repl = ChatRepl(client, settings, session_name=name, session_path=path, stream=io.StringIO(
        "".join(line + "\n" for line in lines)), params=params)
    return repl, repl.run()


def test_a_server_that_goes_away_mid_chat_leaves_the_conversation_intact(capsys, bundles, tmp_path):
    store = tmp_path / "store"
    port = free_port()
    srv = start_server(bundles, store, listen=f"127.0.0.1:{port}")
    fault = StopServerMidAnswer(srv, nth=2)
    replacement = []

    class Lines(io.StringIO):
        """The third message is typed once the server is back (the same store, the same address)."""

        def readline(self, *args):
            line = super().readline(*args)
            if line.startswith("Name another") and not replacement:
                replacement.append(start_server(bundles, store, listen=f"127.0.0.1:{port}"))
            return line

    client = Client(f"127.0.0.1:{port}", bundles.client_dir, timeout=60, interceptors=[fault])
    try:
        settings = ClientSettings(sessions_dir=tmp_path / "sessions", chat_history="")
        repl = ChatRepl(client, settings, session_name="trip", session_path=tmp_path / "sessions" / "trip.session",
                        stream=Lines("Name a river.\nHow long is it?\nName another one.\n"),
                        params=SamplingParams(max_new_tokens=6))
        assert repl.run() == 0
        err = capsys.readouterr().err
        assert (f"this turn failed: lost the connection to the infemeral-server at 127.0.0.1:{port} (it stopped or "
                "the network failed).\nThe conversation is intact: send your message again once the server is back, "
                "or /exit and resume later with `infemeral-client chat --session trip`.") in err, err
        assert "Cancelling" not in err and "UNAVAILABLE" not in err
        # The turns before and after it committed, one after the other: nothing of the lost turn was kept.
        assert repl.session.version == 2 and [m["content"] for m in repl.session.messages][::2] == [
            "Name a river.", "Name another one."]
        assert "session 'trip' kept: resume it with `infemeral-client chat --session trip`, delete it with " \
               "`infemeral-client delete --session trip`" in err
    finally:
        client.close()
        for s in replacement:
            s.stop(0)


def test_a_chat_without_a_name_is_deleted_on_the_server_when_it_ends(capsys, server, client, tmp_path):
    repl, code = chat(client, ["Name a river."], tmp_path)
    assert code == 0 and len(repl.session.messages) == 2  # the turn committed
    assert repl.session.version == 0 and not StoredSession(server.settings.store, repl.session.id).exists()
    named, code = chat(client, ["Name a river."], tmp_path, name="kept")
    assert code == 0 and StoredSession(server.settings.store, named.session.id).exists()
    named.session.delete()


def test_ctrl_c_shows_no_token_after_it(capsys, monkeypatch):
    """The ^C lands while the third token is computed: that token is not printed, and none after it is computed."""

    class Session:
        version, pending_commit, messages = 0, None, []
        computed = 0

        def stream(self, message, params, on_progress=None):
            for word in ("one ", "two ", "three ", "four "):
                Session.computed += 1
                if word == "three ":
                    signal.raise_signal(signal.SIGINT)  # as the terminal sends it
                yield word

    class FakeClient:
        address = "nowhere"

        def new_session(self, system_prompt=None):
            return Session()

    repl = ChatRepl(FakeClient(), ClientSettings(chat_history=""), stream=io.StringIO(""), params=SamplingParams())
    assert repl.answer("count") is False
    out = capsys.readouterr()
    assert out.out == "one two \n" and "stopped" in out.err and Session.computed == 3


def test_answers_sample_by_default_and_greedy_is_one_flag_away(monkeypatch, server, bundles, client):
    from infemeral.cli import commands

    seen = []
    monkeypatch.setattr(commands, "open_client", lambda settings: client)
    monkeypatch.setattr(client, "close", lambda: None)
    monkeypatch.setattr(ChatRepl, "run", lambda self: seen.append(self.params) or 0)
    base = ["chat", "--server", f"127.0.0.1:{server.port}", "--client-bundle", str(bundles.client_dir)]
    for extra in ((), ("--greedy",), ("--temperature", "0"), ("--temperature", "0.3"), ("--repetition-penalty", "1.2")):
        assert cli.main(base + list(extra)) == 0
    default, greedy, zero, cooler, penalised = seen
    # The packaged model's bundle samples as its model card recommends (a config that does not sample gets
    # CHAT_SAMPLING: test_prepare).
    assert (default.temperature, default.top_p, default.repetition_penalty) == (0.2, 0.9, 1.0)
    plain = SamplingParams()
    for params in (greedy, zero):  # greedy decoding exactly as the SDK's default (the exactness reference)
        assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (
            plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty)
    assert (cooler.temperature, cooler.top_p, cooler.repetition_penalty) == (0.3, 0.9, 1.0)
    assert (penalised.temperature, penalised.repetition_penalty) == (0.2, 1.2)
    assert cli.main(base + ["--greedy", "--temperature", "0.5"]) == 2


def test_info_is_a_summary_for_people_and_json_for_scripts(capsys, server, bundles):
    import json

    base = ["info", "--server", f"127.0.0.1:{server.port}", "--client-bundle", str(bundles.client_dir)]
    assert cli.main(base) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"server 127.0.0.1:{server.port}: infemeral ") and "{" not in text
    assert f"context: {server.settings.max_context} tokens" in text
    assert text.endswith("client bundle matches server bundle: yes\n")
    assert cli.main(base + ["--json"]) == 0
    fields = json.loads(capsys.readouterr().out)  # the whole output: numbers as numbers
    assert fields["max_context"] == server.settings.max_context and isinstance(fields["max_message_bytes"], int)
    assert fields["client_bundle_matches"] is True


def test_a_chat_that_cannot_delete_its_conversation_says_so(capsys, bundles, tmp_path):
    srv = start_server(bundles, tmp_path / "store")
    client = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=60)
    try:
        settings = ClientSettings(chat_history="")

        class Lines(io.StringIO):
            def readline(self, *args):  # the server stops once the first answer is in, before Ctrl-D
                line = super().readline(*args)
                if not line:
                    srv.stop(0)
                return line

        repl = ChatRepl(client, settings, stream=Lines("Name a river.\n"), params=SamplingParams(max_new_tokens=4))
        assert repl.run() == 0
        assert (f"could not delete this conversation on the server (the server at 127.0.0.1:{srv.port} cannot be "
                "reached); the server deletes it by itself once it has been idle for its session TTL") in \
            capsys.readouterr().err
    finally:
        client.close()
        srv.stop(0)


def test_the_api_key_can_come_from_a_file(capsys, bundles, tmp_path):
    """Kept out of the command line, where `ps` shows it to everyone on the machine."""
    srv = start_server(bundles, tmp_path / "store", api_keys="s3cret-key")
    (tmp_path / "key").write_text("# the pod's key\ns3cret-key\n")
    base = ["info", "--server", f"127.0.0.1:{srv.port}", "--client-bundle", str(bundles.client_dir)]
    try:
        assert cli.main(base + ["--api-key-file", str(tmp_path / "key")]) == 0
        assert "client bundle matches server bundle: yes" in capsys.readouterr().out
        assert cli.main(base) == 2
        # the last line: the in-process server's own log of the refusal may come before it
        assert capsys.readouterr().err.splitlines()[-1] == (
            "infemeral-client: missing or wrong API key; give the client the key the server was started with "
            "(--api-key-file FILE or INFEMERAL_API_KEY) [UNAUTHENTICATED]")
    finally:
        srv.stop(0)
