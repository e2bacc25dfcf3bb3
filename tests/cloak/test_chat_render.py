"""The chat template's sandbox: an escapable jinja2 is refused, and a template cannot reach Python's internals
through a namespace; a broken template is one line naming its file. (What the templates render to is held to
transformers in test_resolved_tokenizer.py.)"""

from __future__ import annotations

import re

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
    with pytest.raises(FailedPrecondition, match="cannot set '_") as refused:
        render(source)
    assert isinstance(refused.value.__cause__, jinja2.exceptions.SecurityError)


def test_a_template_can_set_other_names_on_a_namespace():
    assert render("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}") == "2"


@pytest.mark.parametrize("source, said", [
    ("{% for m in messages %}{{ m['content'] }}", r"\(line 1\) is broken: Unexpected end of template"),
    ("{{ raise_exception('Conversation roles must alternate') }}", "is broken: Conversation roles must alternate"),
    ("{{ messages[0]['content'] | no_such_filter }}", "is broken: No filter named 'no_such_filter'"),
])
def test_a_broken_template_is_one_line_naming_its_file_and_the_fix(source, said):
    with pytest.raises(FailedPrecondition) as broken:
        chat_render.render(source, MESSAGES, add_generation_prompt=True, special_tokens={},
                           origin="/bundle/tokenizer/chat_template.jinja")
    message = str(broken.value)
    assert message.startswith("the chat template in /bundle/tokenizer/chat_template.jinja ")
    assert re.search(said, message) and "\n" not in message
    assert message.endswith("restore that file from the model's tokenizer, or prepare the bundle again "
                            "(`infemeral-client prepare --force`)")
