"""The CLI's upload line: drawn on a terminal once a prompt's upload passes a second, cleared as it ends, never
drawn for piped output; and Ctrl-C while the prompt goes up stops the upload. Reports are made up here (no
model, no server): 0.1 s in all."""

from __future__ import annotations

import io

import pytest

from infemeral.cli.upload_line import SHOW_AFTER_SECONDS, UploadLine, UploadStopped, is_shown
from infemeral.client.upload import UploadProgress

TOKENS, PER_TOKEN = 4096, 8192


def at(seconds: float, tokens: int) -> UploadProgress:
    return UploadProgress(tokens, TOKENS, tokens * PER_TOKEN, TOKENS * PER_TOKEN, seconds)


def test_the_line_is_for_terminals_past_a_second_until_the_upload_is_done():
    assert not is_shown(at(SHOW_AFTER_SECONDS / 2, 100), is_terminal=True)   # too soon to bother
    assert is_shown(at(SHOW_AFTER_SECONDS, 100), is_terminal=True)
    assert is_shown(at(30, TOKENS - 1), is_terminal=True)
    assert not is_shown(at(30, TOKENS), is_terminal=True)                    # done: the answer comes next
    assert not is_shown(at(30, 100), is_terminal=False)                      # piped: never


def test_a_long_upload_draws_the_line_and_clears_it_before_the_answer():
    out = io.StringIO()
    line = UploadLine(out, is_terminal=True)
    line(at(0.3, 64))
    assert out.getvalue() == "" and not line.is_drawn
    line(at(1.2, 512))
    drawn = out.getvalue()
    assert line.is_drawn and "uploading the prompt" in drawn and f"512/{TOKENS} tokens" in drawn
    line(at(2.4, 2048))
    assert f"2048/{TOKENS} tokens" in out.getvalue()[len(drawn):]
    line(at(3.5, TOKENS))
    assert not line.is_drawn
    cleared = out.getvalue()
    line.close()  # the turn's end closes it again: nothing more is written
    assert out.getvalue() == cleared and cleared.endswith("\r")


def test_piped_output_never_gets_the_line():
    out = io.StringIO()
    line = UploadLine(out, is_terminal=False)
    for seconds, tokens in ((0.5, 64), (2, 1024), (10, 3000), (12, TOKENS)):
        line(at(seconds, tokens))
    assert out.getvalue() == "" and not line.is_drawn


def test_stopping_during_the_upload_clears_the_line_and_ends_the_turn():
    out = io.StringIO()
    stop = {"asked": False}
    line = UploadLine(out, is_terminal=True, should_stop=lambda: stop["asked"])
    line(at(1.5, 512))
    assert line.is_drawn
    stop["asked"] = True
    with pytest.raises(UploadStopped):
        line(at(2.0, 1024))
    assert not line.is_drawn
