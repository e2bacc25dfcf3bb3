"""The turn's text stream: stop strings cut the answer, text that may still become one is held back,
and half a character is never shown."""

from __future__ import annotations

from infemeral.client.turn import TextStream


class Pieces:
    """A tokenizer whose tokens are fixed strings; token 9 is the first half of a character (shown as
    U+FFFD until token 10 completes it)."""

    PIECES = {1: "Hello", 2: ",", 3: " wor", 4: "ld", 5: "!", 6: " EN", 7: "D", 8: " more", 9: "", 10: "é"}

    def decode(self, ids, skip_special_tokens=True):
        text = ""
        for i, t in enumerate(ids):
            if t == 9:
                text += "é" if i + 1 < len(ids) and ids[i + 1] == 10 else "\ufffd"
            elif t != 10:
                text += self.PIECES[t]
        return text


def stream(tokens, stop):
    text = TextStream(Pieces(), stop)
    deltas = []
    for t in tokens:
        deltas.append(text.push(t))
        if text.is_stopped:
            break
    deltas.append(text.flush())
    return text, deltas


def test_text_streams_as_it_comes_without_stop_strings():
    text, deltas = stream([1, 2, 3, 4, 5], [])
    assert deltas == ["Hello", ",", " wor", "ld", "!", ""]
    assert text.text == "Hello, world!" and not text.is_stopped


def test_a_stop_string_cuts_the_answer_and_what_might_become_one_is_held_back():
    text, deltas = stream([1, 2, 3, 4, 6, 7, 8], [" END"])
    assert text.is_stopped and text.text == "Hello, world"
    assert "".join(deltas) == "Hello, world"
    assert not any("E" in d for d in deltas)  # " EN" was held back, never shown, then cut
    assert deltas[:2] == ["He", "l"]  # the last len(" END") - 1 characters wait for the next token


def test_text_held_back_is_flushed_at_the_end():
    text, deltas = stream([1, 2, 3, 4, 6], [" END"])
    assert not text.is_stopped and "".join(deltas) == "Hello, world EN"
    assert deltas[-1] == " EN"  # held back until the answer ended, then released by flush


def test_half_a_character_is_never_shown():
    text, deltas = stream([1, 9, 10, 5], [])
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "Helloé!"
