"""The chat REPL in a real pseudo-terminal: line editing, /help, multi-line input, and Ctrl-C that stops an
answer but keeps the conversation, checked against the SDK's greedy answers from the same state."""

from __future__ import annotations

import io
import os
import sys

import pexpect
import pytest
import torch

from infemeral.client.chat_repl import LineReader
from infemeral.client.sampling import SamplingParams
from infemeral.client.sdk import Session

FIRST = "What is the capital of France?"
LONG = "Write a very long story about a dragon and a knight, with many chapters."
THIRD = "Now the capital\nof Italy?"
MAX_TOKENS = 300


def test_multi_line_messages_from_a_pipe():
    reader = LineReader(io.StringIO('one line\nfirst \\\nsecond\n"""\nblock one\n  block two\n"""\n"""inline"""\n'))
    assert not reader.is_interactive
    assert [reader.read_message() for _ in range(5)] == [
        "one line", "first \nsecond", "\nblock one\n  block two\n", "inline", None]


@pytest.mark.slow
def test_ctrl_c_stops_the_answer_and_keeps_the_session(server, client, bundles, tmp_path):
    env = dict(os.environ, INFEMERAL_SERVER=f"127.0.0.1:{server.port}", INFEMERAL_CLIENT_BUNDLE=str(bundles.client_dir),
               INFEMERAL_SESSIONS_DIR=str(tmp_path / "sessions"), INFEMERAL_CHAT_HISTORY=str(tmp_path / "history"),
               INFEMERAL_ANSWER_INDEX_DIR=str(tmp_path / "answers"), TERM="dumb")
    chat = pexpect.spawn(sys.executable, ["-m", "infemeral.client.cli", "chat", "--session", "repl",
                                          "--max-new-tokens", str(MAX_TOKENS), "--temperature", "0"],
                         env=env, encoding="utf-8", timeout=120, dimensions=(40, 200))
    try:
        chat.expect_exact("you> ")
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
        chat.sendintr()
        chat.expect_exact("stopped")
        chat.expect_exact("you> ")
        # Ctrl-C at the prompt only clears the line.
        chat.send("typed but never sent")
        # Wait for the echo: a Ctrl-C that lands while readline is still taking the keys is only seen at the next
        # key (CPython's readline loop); a person's Ctrl-C comes later, while it waits.
        chat.expect_exact("never sent")
        chat.sendintr()
        chat.expect_exact("you> ")
        chat.sendline('"""')
        chat.sendline(THIRD.split("\n")[0])
        chat.sendline(THIRD.split("\n")[1] + '"""')
        chat.expect_exact("assistant> ")
        chat.expect_exact("you> ")
        chat.sendline("/exit")
        chat.expect(pexpect.EOF)
    finally:
        chat.close(force=True)
    assert chat.exitstatus == 0, chat.before
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
    from conftest import StoredSession

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
