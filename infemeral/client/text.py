"""The answer's text as its tokens arrive: incremental detokenization with stop strings."""

from __future__ import annotations


class TextStream:
    """The answer's text as its tokens arrive: cut at the first stop string, and held back while it
    could still become one, or while it ends in half a character.

    Half a character (the U+FFFD a decoder shows until the rest of its bytes arrive) is not text yet: no
    stop string is matched in it, and the text before it is held back as if the character were there, since
    it may begin a stop string that the character ends. What was shown, put together, is the final text.

    Each token costs a bounded amount of work, however long the answer: only the newest tokens are
    decoded (with a few before them as context, as a detokenizer must: a piece's leading space, a
    character split over tokens), stop strings are looked for only where a new one can be, and text is
    kept in pieces. The output is the same as decoding the whole answer at every token. A tokenizer that
    cleans up spaces when it decodes (which can change text already decoded) is decoded whole each time."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.longest_stop = max((len(s) for s in self.stop), default=1)
        self.hold = self.longest_stop - 1
        self.token_ids: list[int] = []
        self.is_stopped = False
        self._is_whole = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        # token_ids[:_read] decode to whole characters: the settled text. Of it, `_pieces` hold what no stop
        # search or emission reads again, and `_recent` (from text index `_recent_at`) the rest.
        # token_ids[_context:_read] are decoded again with newer tokens as their context.
        self._pieces: list[str] = []
        self._recent, self._recent_at = "", 0
        self._context = self._read = 0
        self._view = ""  # the text from `_recent_at` as of the last token (cut at a stop string)
        self._emitted = 0  # characters shown so far

    @property
    def text(self) -> str:
        """The answer's text so far (cut at a stop string)."""
        return "".join(self._pieces) + self._view

    def push(self, token: int) -> str:
        """Add a token; return the text that is now safe to show (possibly nothing)."""
        self.token_ids.append(token)
        known = self._recent_at + len(self._recent)  # settled text: no stop string lies wholly in it
        tail = self._decode_tail()
        if tail is None:  # the decoder changed text it gave before (invalid bytes): begin again from the whole
            known, tail = 0, self._start_over()
        view = self._recent + tail
        whole = len(view.rstrip("\ufffd"))  # up to half a character: stop strings are looked for, text shown
        search_from = max(known - self.longest_stop + 1 - self._recent_at, 0)
        if self._cut_at_stop(view, search_from, whole):
            return self._emit(self._recent_at + len(self._view))
        self._view = view
        if not self._is_whole and tail and whole == len(view):  # whole characters
            self._recent += tail
            self._context, self._read = self._read, len(self.token_ids)
        delta = self._emit(self._recent_at + whole - self.hold)
        self._forget_read_text()
        return delta

    def flush(self) -> str:
        """Whatever was held back, at the end of the answer (a U+FFFD still at its end is the answer's now)."""
        if not self.is_stopped:
            whole = len(self._view.rstrip("\ufffd"))
            self._cut_at_stop(self._view, max(whole - self.longest_stop + 1, 0), len(self._view))
        return self._emit(self._recent_at + len(self._view))

    def _cut_at_stop(self, view: str, start: int, end: int) -> bool:
        """Whether a stop string lies in view[start:end]; if so the answer ends before the first one."""
        hits = [i for i in (view.find(s, start, end) for s in self.stop) if i >= 0]
        if hits:
            self._view, self.is_stopped = view[:min(hits)], True
        return bool(hits)

    def _decode_tail(self) -> str | None:
        """The text of token_ids[_read:] (it may end in half a character); None if decoding it with its
        context changed the context's own text (a byte-fallback decoder meeting an invalid byte sequence)."""
        decode = self.tokenizer.decode
        if self._is_whole:
            return decode(self.token_ids, skip_special_tokens=True)
        context = decode(self.token_ids[self._context:self._read], skip_special_tokens=True)
        text = decode(self.token_ids[self._context:], skip_special_tokens=True)
        return text[len(context):] if text.startswith(context) else None

    def _start_over(self) -> str:
        """Forget the settled text; the whole answer's text, as the new tail."""
        self._pieces, self._recent, self._recent_at = [], "", 0
        self._context = self._read = 0
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def _emit(self, end: int) -> str:
        """The text from what was shown up to index `end` (nothing if that is not further)."""
        if end <= self._emitted:
            return ""
        delta = self._view[self._emitted - self._recent_at:end - self._recent_at]
        self._emitted = end
        return delta

    def _forget_read_text(self) -> None:
        """Move settled text that neither a stop search nor an emission reads again out of `_recent`."""
        settled = self._recent_at + len(self._recent)
        keep_from = min(self._emitted, settled - self.longest_stop + 1)
        if keep_from - self._recent_at > 256:  # in chunks: each move copies what stays
            cut = keep_from - self._recent_at
            self._pieces.append(self._recent[:cut])
            self._recent, self._view, self._recent_at = self._recent[cut:], self._view[cut:], keep_from
