"""The chat template's sandbox: an escapable jinja2 is refused, and a template cannot reach Python's internals
through a namespace. (What the templates render to is held to transformers in test_resolved_tokenizer.py.)"""

from __future__ import annotations

import jinja2
import pytest

from infemeral.cloak import chat_render
from infemeral.errors import FailedPrecondition

MESSAGES = [{"role": "user", "content": "Hello"}]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def render(source):
    return chat_render.render(source, MESSAGES, add_generation_prompt=False, special_tokens={})


@pytest.mark.parametrize("version", ["3.1.5", "3.0.3", "2.11.3"])
def test_a_jinja2_with_known_sandbox_escapes_is_refused(version, monkeypatch):
    monkeypatch.setattr(chat_render, "jinja2_version", lambda: version)
    with pytest.raises(FailedPrecondition, match=rf"jinja2 {version} lets a chat template escape .*jinja2>=3\.1\.6"):
        render(TEMPLATE)


@pytest.mark.parametrize("version", ["3.1.6", "3.1.10", "3.2.0.dev0", "4.0"])
def test_a_jinja2_without_them_renders(version, monkeypatch):
    monkeypatch.setattr(chat_render, "jinja2_version", lambda: version)
    assert render(TEMPLATE) == "user: Hello\n"


def test_the_installed_jinja2_renders():
    assert render(TEMPLATE) == "user: Hello\n"


@pytest.mark.parametrize("source", [
    "{% set ns = namespace(_x=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns }}",
    "{% set ns = namespace({'__class__': 1}) %}{{ ns }}",
])
def test_a_template_cannot_set_an_underscore_name_on_a_namespace(source):
    with pytest.raises(jinja2.exceptions.SecurityError, match="cannot set '_"):
        render(source)


def test_a_template_can_set_other_names_on_a_namespace():
    assert render("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}") == "2"
