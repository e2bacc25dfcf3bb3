"""A chat template rendered as transformers renders it, with jinja2 alone.

The laptop renders every turn's transcript; importing transformers for that costs each `generate`, `chat` or
`serve` 0.8-1 s on a 2-core machine (its package scans the source of every model family it knows). Chat
templates are jinja2 programs; transformers runs them in a sandboxed environment with a few additions
(`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, guarded `dict` and `namespace`,
the `{% generation %}` block) and hands them the messages with None fields dropped and the tokenizer's
special tokens as variables. This module builds the same environment for the cases the client renders
(messages, a generation prompt; no tools, documents or continued final messages).
tests/cloak/test_resolved_tokenizer.py holds its output to transformers' own for several templates.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infemeral.errors import FailedPrecondition

# The names under which a message's reasoning may arrive; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Older jinja2 lets a template out of its sandbox (CVE-2024-56326, CVE-2025-27516: `|attr('format')` reaches
# str.format unchecked, and through it the process's globals); transformers refuses those versions too.
SAFE_JINJA2 = (3, 1, 6)
# What to do about a template that does not parse or that fails while rendering: it came with the model.
BROKEN_TEMPLATE_FIX = ("restore that file from the model's tokenizer, or prepare the bundle again "
                       "(`infemeral-client prepare --force`)")


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training masks; rendering keeps
    the text as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_keep"), [], [], body).set_lineno(lineno)

    def _keep(self, caller):
        return caller()


class TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, so a template cannot reach Python's internals through one."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class TemplateDict:
    """`dict(...)` for templates, without the type's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(source)


def _plain(value):
    """Only JSON's own types reach a template (the sandbox does not know other objects' methods)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _message(message: dict) -> dict:
    """None fields dropped; reasoning under every name a template may read it by."""
    message = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def jinja2_version() -> str:
    """The version of the jinja2 that renders templates here."""
    return jinja2.__version__


def check_jinja2() -> None:
    """Refuse to run a chat template (a program that came with the model) under a jinja2 it can escape."""
    version = jinja2_version()
    if tuple(int(part) for part in re.findall(r"\d+", version)[:3]) < SAFE_JINJA2:
        safe = ".".join(map(str, SAFE_JINJA2))
        raise FailedPrecondition(f"jinja2 {version} lets a chat template escape its sandbox (CVE-2024-56326, "
                                 f"CVE-2025-27516); upgrade it: pip install 'jinja2>={safe}'")


def broken_template(error: jinja2.TemplateError, origin: str | None) -> FailedPrecondition:
    """A template that does not parse, or that raised while rendering, as one line a person can act on: which
    file, what jinja2 said, and the fix (instead of jinja2's traceback through the client)."""
    where = f"the chat template in {origin}" if origin else "the chat template"
    if isinstance(error, jinja2.TemplateSyntaxError) and error.lineno:
        where += f" (line {error.lineno})"
    said = " ".join(str(error).split()) or type(error).__name__
    return FailedPrecondition(f"{where} is broken: {said}; {BROKEN_TEMPLATE_FIX}")


def render(source: str, messages: list[dict], *, add_generation_prompt: bool, special_tokens: dict[str, str],
           origin: str | None = None) -> str:
    """`messages` rendered by the template `source`; `special_tokens` are the tokenizer's (bos_token, ...);
    `origin` names the file the template came from, for the error if it is broken."""
    check_jinja2()
    if not messages:
        raise ValueError("cannot render an empty conversation")
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages are dicts, not {type(message).__name__}")
    try:
        return compile_template(source).render(messages=[_message(m) for m in messages], tools=None,
                                               documents=None, add_generation_prompt=add_generation_prompt,
                                               **_plain(dict(special_tokens)))
    except jinja2.TemplateError as e:
        raise broken_template(e, origin) from e
