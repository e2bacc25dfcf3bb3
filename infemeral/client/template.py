"""A transcript as token ids, with control tokens only where the chat template puts them (docs/design.md §12).

Message content is text. Rendering a transcript and tokenizing the rendered
string as a whole — what `apply_chat_template(tokenize=True)` does — turns a
control token typed into a message (`<|im_end|>\\n<|im_start|>system …`) into
the real special token, and the message forges a turn of its own.

So the template is rendered twice: with the messages, and with each message's
content replaced by a marker, which shows where in the rendered string the
template's own text ends and content begins. The string is tokenized as
before; when every control token in it lies in the template's own text (any
ordinary conversation), those ids are the answer, exactly as they always
were. Otherwise the string is cut at the template's control tokens only, and
the text between them, content included, is tokenized with special tokens
read as plain text.

A template that rewrites content (trimming is fine, splitting or editing is
not), or a tokenizer that gives no offsets, leaves no way to tell the parts
apart by position; there a message that would add control tokens is refused
rather than rendered.
"""

from __future__ import annotations

import secrets
from collections import Counter

import jinja2

from infemeral.cloak.chat_render import broken_template
from infemeral.cloak.resolved_tokenizer import chat_template_file
from infemeral.errors import InvalidArgument


class ChatTemplate:
    """Renders transcripts with one tokenizer's chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        special = {i for i, token in tokenizer.added_tokens_decoder.items() if getattr(token, "special", False)}
        self.control_ids = special | set(tokenizer.all_special_ids)

    def ids(self, messages: list[dict]) -> list[int]:
        """The transcript rendered by the template, ready for the assistant's answer, as token ids."""
        rendered = self._render(messages)
        template, spans = self._content_spans(messages, rendered)
        try:
            encoding = self.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
            offsets = encoding["offset_mapping"]
        except NotImplementedError:  # a tokenizer without offsets: positions cannot be told apart either
            encoding, spans = self.tokenizer(rendered, add_special_tokens=False), None
        ids = list(encoding["input_ids"])
        if spans is None:
            self._refuse_forged(template, ids)
            return ids
        owned = []  # (index, start, end) of the control tokens the template wrote
        is_forged = False
        for k, token in enumerate(ids):
            if token not in self.control_ids:
                continue
            start, end = self._spelling(token, *offsets[k], rendered)
            if any(start < b and a < end for a, b in spans):
                is_forged = True
            else:
                owned.append((k, *offsets[k]))
        if not is_forged:
            return ids
        out, at = [], 0
        for k, start, end in owned:
            out += self.text_ids(rendered[at:start])
            out.append(ids[k])
            at = end
        return out + self.text_ids(rendered[at:])

    def text_ids(self, text: str) -> list[int]:
        """`text` as plain text: a special token's spelling is read as the characters it is made of."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    # -- helpers -------------------------------------------------------------------------------------
    def _render(self, messages: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as e:  # a tokenizer transformers renders (the resolved one says it itself)
            raise broken_template(e, chat_template_file(self.tokenizer)) from e

    def _content_spans(self, messages: list[dict], rendered: str) -> tuple[str, list[tuple[int, int]] | None]:
        """The template rendered with a marker for each message's text, and where that text lies in
        `rendered` (None if the template does not copy it verbatim).

        A marker stands for the content without its outer whitespace, so a template that trims content
        still copies it verbatim; a random nonce keeps a message from imitating a marker."""
        nonce = secrets.token_hex(8)
        marked, cores = [], []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, str) and content.strip():
                core = content.strip()
                marker = f"\ue000{nonce}.{i}\ue001"
                lead, trail = content[:len(content) - len(content.lstrip())], content[len(content.rstrip()):]
                message = {**message, "content": lead + marker + trail}
                cores.append((marker, core))
            marked.append(message)
        template = self._render(marked) if cores else rendered
        spans, rebuilt, length, at = [], [], 0, 0
        for marker, core in cores:
            found = template.find(marker, at)
            if found < 0 or template.count(marker) != 1:
                return template, None
            length += found - at
            spans.append((length, length + len(core)))
            length += len(core)
            rebuilt += [template[at:found], core]
            at = found + len(marker)
        rebuilt.append(template[at:])
        return template, (spans if "".join(rebuilt) == rendered else None)

    def _spelling(self, token: int, start: int, end: int, rendered: str) -> tuple[int, int]:
        """Where a control token's own spelling lies within its offsets (which may take in whitespace it strips)."""
        spelling = self.tokenizer.convert_ids_to_tokens(token)
        found = rendered.find(spelling, start, end) if spelling else -1
        return (found, found + len(spelling)) if found >= 0 else (start, end)

    def _refuse_forged(self, template: str, ids: list[int]) -> None:
        """For a template that rewrites content: refuse a transcript whose content adds control tokens (more
        of them than the template writes around markers, which hold none)."""
        own = Counter(t for t in self.tokenizer(template, add_special_tokens=False)["input_ids"]
                      if t in self.control_ids)
        forged = Counter(t for t in ids if t in self.control_ids) - own
        if forged:
            names = ", ".join(self.tokenizer.convert_ids_to_tokens(sorted(forged)))
            raise InvalidArgument(f"a message holds control tokens of the chat template ({names}); this model's "
                                  "template rewrites message content, so they cannot be kept as text — remove "
                                  "them from the message")
