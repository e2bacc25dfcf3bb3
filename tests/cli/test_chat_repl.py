"""The chat REPL in a real pseudo-terminal: line editing, /help, multi-line input, and Ctrl-C that stops an
answer but keeps the conversation, checked against the SDK's greedy answers from the same state."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import signal
import struct
import sys
import termios

import pexpect
import pexpect.fdpexpect
import pytest
import torch

from infemeral.cli.chat_repl import LineReader
from infemeral.client.sampling import SamplingParams
from infemeral.client.session import Session

FIRST = "What is the capital of France?"
LONG = "Write a very long story about a dragon and a knight, with many chapters."
THIRD = "Now the capital\nof Italy?"
MAX_TOKENS = 300
# How long each step may take. The chat's first line comes before anything heavy, within 2 s even on a busy
# machine; a chat silent for a minute is stuck. Its start-up (imports of torch and transformers, the local half of the
# model) is CPU-bound work that the machine's load stretches: 5 s on an idle 2-core machine, measured at 11 to 30 s
# at load 5 to 6, and CI runs at load 3 to 5 beside other jobs. An answer took at most 35 s under that load.
FIRST_LINE_TIMEOUT = 60
LOAD_TIMEOUT = 300
STEP_TIMEOUT = 120


class Terminal:
    """A program in a pseudo-terminal of its own, as a shell starts it: its controlling terminal, so ^C typed
    there interrupts it.

    Started with posix_spawn, not pexpect.spawn: pexpect forks this process, which runs the fixtures' gRPC server
    and clients; gRPC's fork handlers restart its poller thread in the forked child, the child closes every
    descriptor before exec, and the poller aborts it on the closed epoll descriptor (measured: 16 of 850
    pexpect.spawn children killed by SIGABRT before exec; none of 300 with posix_spawn, which runs no fork
    handlers)."""

    def __init__(self, argv: list[str], env: dict[str, str], *, rows: int = 40, cols: int = 200):
        master, slave = pty.openpty()
        try:
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            # A new session that opens the terminal by name takes it as its controlling terminal. Its signals
            # start as a shell starts a command's (default Ctrl-C, nothing blocked), not as this test process
            # holds them: a disposition or mask inherited from pytest would decide whether Ctrl-C is heard.
            self.pid = os.posix_spawn(argv[0], argv, env, setsid=True, setsigmask=(),
                                      setsigdef=(signal.SIGINT, signal.SIGQUIT), file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.ttyname(slave), os.O_RDWR, 0),
                (os.POSIX_SPAWN_DUP2, 0, 1), (os.POSIX_SPAWN_DUP2, 0, 2)])
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)  # the child holds the only copy: its exit is the end of the output
        self.io = pexpect.fdpexpect.fdspawn(master, encoding="utf-8", timeout=STEP_TIMEOUT)
        self.exit_code: int | None = None

    def interrupt(self) -> None:
        self.io.send("\x03")  # ^C, as typed

    def wait(self) -> int:
        if self.exit_code is None:
            self.exit_code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.exit_code

    def stacks(self) -> str:
        """Abort a stuck program and return what it printed meanwhile and while dying: with PYTHONFAULTHANDLER
        set, every thread's Python stack."""
        os.kill(self.pid, signal.SIGABRT)
        try:
            self.io.expect(pexpect.EOF, timeout=60)
        except pexpect.TIMEOUT:
            pass
        return self.io.before

    def close(self) -> None:
        """Kill the program if it is still there, and let it go."""
        if self.exit_code is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.wait()
        self.io.close()


def test_multi_line_messages_from_a_pipe():
    reader = LineReader(io.StringIO('one line\nfirst \\\nsecond\n"""\nblock one\n  block two\n"""\n"""inline"""\n'))
    assert not reader.is_interactive
    assert [reader.read_message() for _ in range(5)] == [
        "one line", "first \nsecond", "\nblock one\n  block two\n", "inline", None]


def test_the_chat_says_it_is_loading_before_it_loads(tmp_path):
    """The first line comes before the model is loaded: a bundle that is not there is reported after it."""
    env = dict(os.environ, INFEMERAL_SERVER="127.0.0.1:1", INFEMERAL_CLIENT_BUNDLE=str(tmp_path / "missing"),
               INFEMERAL_SESSIONS_DIR=str(tmp_path / "sessions"), TERM="dumb")
    term = Terminal([sys.executable, "-m", "infemeral.cli", "chat"], env)
    try:
        term.io.expect(pexpect.EOF, timeout=LOAD_TIMEOUT)
        assert term.wait() == 2
    finally:
        term.close()
    lines = term.io.before.splitlines()
    assert lines[0] == f"loading the model ({tmp_path / 'missing'})..."
    assert "is not an infemeral bundle" in lines[1]


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_and_keeps_the_session(server, client, bundles, tmp_path):
    env = dict(os.environ, INFEMERAL_SERVER=f"127.0.0.1:{server.port}", INFEMERAL_CLIENT_BUNDLE=str(bundles.client_dir),
               INFEMERAL_SESSIONS_DIR=str(tmp_path / "sessions"), INFEMERAL_CHAT_HISTORY=str(tmp_path / "history"),
               INFEMERAL_ANSWER_INDEX_DIR=str(tmp_path / "answers"), TERM="dumb", PYTHONFAULTHANDLER="1")
    term = Terminal([sys.executable, "-m", "infemeral.cli", "chat", "--session", "repl",
                     "--max-new-tokens", str(MAX_TOKENS), "--temperature", "0"], env)
    chat = term.io
    try:
        # A sign of life before the slow start-up; a chat that shows nothing for a minute is stuck, not slow.
        chat.expect_exact("loading the model", timeout=FIRST_LINE_TIMEOUT)
        chat.expect_exact("you> ", timeout=LOAD_TIMEOUT)
        chat.sendline("/help")
        chat.expect_exact('"""')  # the help explains multi-line input
        chat.expect_exact("you> ")
        chat.sendline(FIRST)
        chat.expect_exact("assistant> ")
        chat.expect_exact("you> ")
        # A long answer, stopped after its first words: back at the prompt, that exchange dropped.
        chat.sendline(LONG)
        chat.expect_exact("assistant> ")
        chat.expect(r"\w+\W+\w+\W+\w+")
        term.interrupt()
        chat.expect_exact("stopped")
        chat.expect_exact("you> ")
        # Ctrl-C at the prompt only clears the line.
        chat.send("typed but never sent")
        # Wait for the echo: a Ctrl-C that lands while readline is still taking the keys is only seen at the next
        # key (CPython's readline loop); a person's Ctrl-C comes later, while it waits.
        chat.expect_exact("never sent")
        term.interrupt()
        chat.expect_exact("you> ")
        chat.sendline('"""')
        chat.sendline(THIRD.split("\n")[0])
        chat.sendline(THIRD.split("\n")[1] + '"""')
        chat.expect_exact("assistant> ")
        chat.expect_exact("you> ")
        chat.sendline("/exit")
        chat.expect_exact("session 'repl' kept: resume it with `infemeral-client chat --session repl`")
        chat.expect(pexpect.EOF)
        assert term.wait() == 0, chat.before
    except pexpect.TIMEOUT as e:
        pytest.fail(f"the chat stopped making progress:\n{e}\n\nwhat it printed since, then its stacks:\n"
                    f"{term.stacks()}")
    finally:
        term.close()
    saved = Session.load(client, tmp_path / "sessions" / "repl.session")
    # The same conversation without the stopped message, through the SDK: the same state, token for token.
    params = SamplingParams(max_new_tokens=MAX_TOKENS)
    reference = client.new_session()
    first, third = reference.chat(FIRST, params), reference.chat(THIRD, params)
    assert saved.version == 2 and saved.pending_commit is None
    assert saved.messages == reference.messages
    assert [m["content"] for m in saved.messages] == [FIRST, first.text, THIRD, third.text]
    assert saved.history_ids == reference.history_ids
    history = tmp_path / "history"
    assert (history.stat().st_mode & 0o777) == 0o600 and FIRST in history.read_text()
    assert "typed but never sent" not in history.read_text()
    for session in (saved, reference):
        session.delete()


@pytest.mark.slow
def test_an_answer_closed_early_leaves_both_caches_as_they_were(server, client):
    """What Ctrl-C (and a client leaving the OpenAI endpoint) does: close the answer's generator mid-way.
    Nothing is committed: the local cache's tensors, the stored ciphertext and the transcript are unchanged,
    and the next turn answers exactly as if the stopped message had never been sent."""
    from tests.conftest import StoredSession

    params = SamplingParams(max_new_tokens=40)
    session = client.new_session()
    session.chat(FIRST, params)
    stored = StoredSession(server.settings.store, session.id)
    before = (session.version, list(session.history_ids), list(session.messages), stored.read_bytes(),
              [tuple(t.clone() for t in session.cache.layer_tensors(i)) for i in range(session.cache.num_layers)])
    deltas = session.stream(LONG, params)
    for _ in range(3):
        next(deltas)
    deltas.close()
    assert session.cache.length == session.cache.committed_length == len(before[1])
    after = (session.version, session.history_ids, session.messages, stored.read_bytes())
    assert after == before[:4]
    for (k0, v0), i in zip(before[4], range(session.cache.num_layers)):
        k1, v1 = session.cache.layer_tensors(i)
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    answer = session.chat(THIRD, params)
    reference = client.new_session()
    reference.chat(FIRST, params)
    assert answer.token_ids == reference.chat(THIRD, params).token_ids
    for s in (session, reference):
        s.delete()


@pytest.mark.slow
def test_ctrl_d_ends_a_chat_and_says_its_conversation_was_deleted(server, bundles, tmp_path):
    """A chat without --session, ended with Ctrl-D in a real terminal: it says what became of the conversation,
    and the server no longer holds it."""
    from tests.conftest import StoredSession

    env = dict(os.environ, INFEMERAL_SERVER=f"127.0.0.1:{server.port}", INFEMERAL_CLIENT_BUNDLE=str(bundles.client_dir),
               INFEMERAL_CHAT_HISTORY="", INFEMERAL_ANSWER_INDEX_DIR=str(tmp_path / "answers"), TERM="dumb")
    before = set(os.listdir(server.settings.store))
    term = Terminal([sys.executable, "-m", "infemeral.cli", "chat", "--max-new-tokens", "8"], env)
    chat = term.io
    try:
        chat.expect_exact("you> ", timeout=LOAD_TIMEOUT)
        chat.sendline(FIRST)
        chat.expect_exact("assistant> ")
        chat.expect_exact("you> ")
        created = set(os.listdir(server.settings.store)) - before
        assert len(created) == 1 and StoredSession(server.settings.store, bytes.fromhex(created.pop())).exists()
        chat.send("\x04")  # Ctrl-D, as typed at an empty prompt
        chat.expect_exact("conversation deleted on the server (start with --session NAME to keep one)")
        chat.expect(pexpect.EOF)
        assert term.wait() == 0, chat.before
    finally:
        term.close()
    assert not any(StoredSession(server.settings.store, bytes.fromhex(name)).exists()
                   for name in set(os.listdir(server.settings.store)) - before)
