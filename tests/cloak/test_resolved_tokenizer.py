"""The laptop's tokenizer without transformers gives what transformers' tokenizer gives.

`prepare` writes the tokenizer as transformers resolved it (resolved_tokenizer.py); the client reads it with
`tokenizers` and renders chats with jinja2 (chat_render.py). Here both are held to transformers' own object
loaded from the same saved tokenizer: ids (with and without special tokens, special tokens split or not),
offsets, decoded text, token spellings, special ids, and rendered chats for the packaged model's template and
for templates that use what transformers adds to jinja2. A tokenizer with rules of its own gets no file.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from infemeral import files
from infemeral.cloak import resolved_tokenizer
from infemeral.cloak.bundle import ClientBundle, load_tokenizer
from infemeral.errors import FailedPrecondition

TEXTS = ["What is the capital of France?", "Hi <|im_start|>system\nobey</s><|im_end|> x", "  leading and trailing  ",
         "naïve café — 東京 😀 123-45-6789", "\n\n\ttabs\r\nand lines", "", "<|endoftext|><|endoftext|>"]

MESSAGES = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_start|> there"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  What now?  "}],
    [{"role": "user", "content": "naïve 東京", "name": None}, {"role": "assistant", "content": "ok",
                                                               "reasoning": "because"}],
]

# Templates that use what transformers gives a template beyond jinja2: the special tokens as variables,
# raise_exception, strftime_now, tojson, namespace, loop controls, the generation block.
TEMPLATES = {
    "llama3-like": (
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
        "<|start|>{{ m['role'] }}\n\n{{ m['content'] | trim }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n\n{% endif %}"),
    "json-and-loops": (
        "{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}"
        "{{ m | tojson }}\n{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}]{% endif %}"
        "{% endfor %}{{ dict(a=1) | tojson(indent=2) }}{{ eos_token }}"),
    "generation-block": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
        "{{ eos_token }}{% endgeneration %}{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"),
    "date": "{{ strftime_now('%Y') }} {% for m in messages %}{{ m['content'] }}{% endfor %}",
}


def read_only(*args):
    """os.replace in a bundle the user cannot write."""
    raise PermissionError(13, "Permission denied")


def copy_tokenizer(bundles, tmp_path, edit=None):
    directory = tmp_path / "tokenizer"
    shutil.copytree(bundles.client_dir / "tokenizer", directory)
    (directory / resolved_tokenizer.FILE).unlink()
    if edit:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        edit(config)
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def resolved_pair(directory):
    reference = load_tokenizer(directory)
    assert resolved_tokenizer.write(reference, directory)
    return reference, resolved_tokenizer.load(directory)


def assert_same_tokenizer(reference, resolved):
    assert len(resolved) == len(reference) and resolved.get_vocab() == reference.get_vocab()
    assert resolved.all_special_ids == reference.all_special_ids
    assert resolved.all_special_tokens == reference.all_special_tokens
    assert resolved.special_tokens_map == reference.special_tokens_map
    for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
        assert getattr(resolved, name) == getattr(reference, name), name
    assert {i: (t.content, t.special) for i, t in resolved.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in reference.added_tokens_decoder.items()}
    for text in TEXTS:
        for kwargs in ({}, {"add_special_tokens": False}, {"split_special_tokens": True},
                       {"add_special_tokens": False, "split_special_tokens": True}):
            want = reference(text, return_offsets_mapping=True, **kwargs)
            got = resolved(text, return_offsets_mapping=True, **kwargs)
            assert got["input_ids"] == want["input_ids"], (text, kwargs)
            assert [tuple(o) for o in got["offset_mapping"]] == [tuple(o) for o in want["offset_mapping"]]
        ids = reference(text)["input_ids"]
        for skip in (False, True):
            assert resolved.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
            assert resolved.convert_ids_to_tokens(ids, skip_special_tokens=skip) == \
                reference.convert_ids_to_tokens(ids, skip_special_tokens=skip)
        for k in range(len(ids)):  # pieces, as the streamed answer decodes them (half characters included)
            assert resolved.decode(ids[k:k + 2]) == reference.decode(ids[k:k + 2])
    assert resolved.convert_ids_to_tokens(5) == reference.convert_ids_to_tokens(5)
    assert resolved.decode(1) == reference.decode(1)


def assert_same_chats(reference, resolved):
    for messages in MESSAGES:
        for prompt in (False, True):
            want = reference.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
            assert resolved.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False) == want
            ids = reference.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
            assert resolved.apply_chat_template(messages, add_generation_prompt=prompt)["input_ids"] == \
                list(ids if isinstance(ids, list) else ids["input_ids"])


def test_the_bundles_tokenizer_reads_as_transformers_reads_it(bundles):
    reference = ClientBundle.open(bundles.client_dir).tokenizer()
    resolved = ClientBundle.open(bundles.client_dir).laptop_tokenizer()
    assert isinstance(resolved, resolved_tokenizer.ResolvedTokenizer)  # prepare wrote the file
    assert resolved.chat_template == reference.chat_template
    assert_same_tokenizer(reference, resolved)
    assert_same_chats(reference, resolved)


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_render_as_transformers_renders_them(name, bundles, tmp_path):
    directory = copy_tokenizer(bundles, tmp_path)
    (directory / "chat_template.jinja").write_text(TEMPLATES[name])
    reference, resolved = resolved_pair(directory)
    assert resolved.chat_template == TEMPLATES[name]
    assert_same_chats(reference, resolved)


def test_a_template_that_raises_raises_the_same_error(bundles, tmp_path):
    """The same error, which the resolved tokenizer says in one line naming the template's file."""
    import jinja2

    from infemeral.errors import FailedPrecondition

    directory = copy_tokenizer(bundles, tmp_path)
    (directory / "chat_template.jinja").write_text(TEMPLATES["llama3-like"])
    reference, resolved = resolved_pair(directory)
    messages = [{"role": "tool", "content": "x"}]
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        reference.apply_chat_template(messages, tokenize=False)
    with pytest.raises(FailedPrecondition, match=f"the chat template in {directory / 'chat_template.jinja'} is "
                                                 "broken: bad role") as broken:
        resolved.apply_chat_template(messages, tokenize=False)
    assert isinstance(broken.value.__cause__, jinja2.TemplateError)


def test_a_tokenizer_that_adds_bos_and_eos_keeps_them(bundles, tmp_path):
    """A post-processor that wraps the text in special tokens is part of the backend the file holds."""
    import tokenizers
    from tokenizers.processors import TemplateProcessing

    directory = copy_tokenizer(bundles, tmp_path)
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A <|im_end|>",
                                                special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)])
    backend.save(str(directory / "tokenizer.json"))
    reference, resolved = resolved_pair(directory)
    ids = reference("Hello")["input_ids"]
    assert ids[0] == reference.bos_token_id and ids[-1] == reference.eos_token_id  # the edit took
    assert_same_tokenizer(reference, resolved)


def test_a_bpe_tokenizer_that_asks_for_space_clean_up_decodes_as_transformers_does(bundles, tmp_path):
    directory = copy_tokenizer(bundles, tmp_path, lambda c: c.update(clean_up_tokenization_spaces=True))
    reference, resolved = resolved_pair(directory)
    assert_same_tokenizer(reference, resolved)


@pytest.mark.parametrize("edit, why", [
    (lambda c: c.update(split_special_tokens=True), "splits special tokens"),
    (lambda c: c.update(clean_up_tokenization_spaces=True,
                        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True),
     "cleans up spaces"),
])
def test_a_tokenizer_with_rules_of_its_own_gets_no_file(edit, why, bundles, tmp_path):
    directory = copy_tokenizer(bundles, tmp_path, edit)
    reference = load_tokenizer(directory)
    assert why in resolved_tokenizer.why_not_resolvable(reference)
    assert not resolved_tokenizer.write(reference, directory)
    assert resolved_tokenizer.load(directory) is None
    bundle = tmp_path / "bundle"  # the client then loads it through transformers
    shutil.copytree(bundles.client_dir, bundle)
    shutil.rmtree(bundle / "tokenizer")
    shutil.copytree(directory, bundle / "tokenizer")
    assert not isinstance(ClientBundle.open(bundle).laptop_tokenizer(), resolved_tokenizer.ResolvedTokenizer)


def tiny_tokenizer(model: str, clean_up_tokenization_spaces: bool):
    """A tokenizer of a few words, built in memory: a WordPiece or Unigram model (not BPE) whose own decoder
    keeps the spaces before punctuation, so that transformers' clean-up is what removes them."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    words = ["[UNK]", "hello", "world", ",", "!"]
    if model == "WordPiece":
        backend = tokenizers.Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
        backend.decoder = decoders.WordPiece(cleanup=False)
    else:
        backend = tokenizers.Tokenizer(models.Unigram([(w, -1.0) for w in words], unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return TokenizersBackend(tokenizer_object=backend, unk_token="[UNK]",
                             clean_up_tokenization_spaces=clean_up_tokenization_spaces)


@pytest.mark.parametrize("model", ["WordPiece", "Unigram"])
def test_a_tokenizer_that_is_not_bpe_and_cleans_up_spaces_gets_no_file(model, tmp_path):
    """transformers cleans up a non-BPE model's spaces when it decodes, which `tokenizers` alone does not."""
    cleaning, plain = tiny_tokenizer(model, True), tiny_tokenizer(model, False)
    ids = plain("hello , world !")["input_ids"]
    assert cleaning.decode(ids) != plain.decode(ids)  # the clean-up changes the text
    assert "cleans up spaces" in resolved_tokenizer.why_not_resolvable(cleaning)
    assert not resolved_tokenizer.write(cleaning, tmp_path) and not list(tmp_path.iterdir())
    assert resolved_tokenizer.why_not_resolvable(plain) is None  # without the clean-up, the file reads the same
    assert resolved_tokenizer.write(plain, tmp_path)
    assert resolved_tokenizer.load(tmp_path).decode(ids) == plain.decode(ids)


def test_a_family_class_that_overrides_decoding_gets_no_file(bundles):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    class Shouting(TokenizersBackend):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    tokenizer = Shouting.from_pretrained(bundles.client_dir / "tokenizer")
    assert "overrides _decode" in resolved_tokenizer.why_not_resolvable(tokenizer)


def test_a_file_of_another_format_is_not_read(bundles, tmp_path):
    directory = copy_tokenizer(bundles, tmp_path)
    resolved_pair(directory)
    data = json.loads((directory / resolved_tokenizer.FILE).read_text())
    (directory / resolved_tokenizer.FILE).write_text(json.dumps({**data, "format_version": 99}))
    assert resolved_tokenizer.load(directory) is None


CHAT = [{"role": "user", "content": "hello"}]


def tiny_bundle(tmp_path, template):
    """A client bundle of the tiny tokenizer alone, saved as `prepare` saves one (its resolved file not yet
    written): all that `laptop_tokenizer` reads."""
    tokenizer = tiny_tokenizer("WordPiece", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return ClientBundle(tmp_path, manifest={}, config=None), tmp_path / "tokenizer"


@pytest.mark.parametrize("writable", [True, False])
def test_an_edited_chat_template_is_the_one_used(writable, tmp_path, monkeypatch):
    bundle, directory = tiny_bundle(tmp_path, "old: {{ messages[0]['content'] }}")
    bundle.laptop_tokenizer()  # the client's first start writes the file
    assert bundle.laptop_tokenizer().apply_chat_template(CHAT, tokenize=False) == "old: hello"
    (directory / "chat_template.jinja").write_text("new: {{ messages[0]['content'] }}")
    assert resolved_tokenizer.load(directory) is None  # out of date
    if not writable:
        monkeypatch.setattr(files.os, "replace", read_only)
    for _ in range(2):  # the start that builds the file again, and the next one that reads it
        assert bundle.laptop_tokenizer().apply_chat_template(CHAT, tokenize=False) == "new: hello"
    assert isinstance(bundle.laptop_tokenizer(), resolved_tokenizer.ResolvedTokenizer) == writable


def test_a_file_written_by_another_transformers_is_built_again(tmp_path, monkeypatch):
    bundle, directory = tiny_bundle(tmp_path, "{{ messages[0]['content'] }}")
    bundle.laptop_tokenizer()
    assert isinstance(resolved_tokenizer.load(directory), resolved_tokenizer.ResolvedTokenizer)
    monkeypatch.setattr(resolved_tokenizer, "transformers_version", lambda: "99.0")
    assert resolved_tokenizer.load(directory) is None
    assert not isinstance(bundle.laptop_tokenizer(), resolved_tokenizer.ResolvedTokenizer)  # built again
    assert json.loads((directory / resolved_tokenizer.FILE).read_text())["transformers_version"] == "99.0"
    assert isinstance(bundle.laptop_tokenizer(), resolved_tokenizer.ResolvedTokenizer)


def test_a_file_whose_sources_are_gone_is_refused(tmp_path):
    bundle, directory = tiny_bundle(tmp_path, "{{ messages[0]['content'] }}")
    bundle.laptop_tokenizer()
    (directory / "chat_template.jinja").unlink()
    with pytest.raises(FailedPrecondition, match="lacks chat_template.jinja, from which its resolved.json"):
        resolved_tokenizer.load(directory)


def test_the_laptop_generates_without_importing_transformers(server, bundles, tmp_path):
    """`generate` end to end in a fresh process: the answer comes, and transformers was never imported."""
    code = ("import sys\nfrom infemeral.cli.main import main\nrc = main(sys.argv[1:])\n"
            "print('transformers loaded:', any(m.split('.')[0] == 'transformers' for m in sys.modules))\n"
            "sys.exit(rc)")
    env = {"INFEMERAL_SERVER": f"127.0.0.1:{server.port}", "INFEMERAL_CLIENT_BUNDLE": str(bundles.client_dir),
           "INFEMERAL_SESSIONS_DIR": str(tmp_path / "sessions"), "INFEMERAL_ANSWER_INDEX_DIR": str(tmp_path / "a"),
           "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code, "generate", "What is the capital of France?", "--greedy",
                           "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "transformers loaded: False"


def test_a_bundle_prepared_before_the_file_existed_gets_it_on_first_load(bundles, tmp_path):
    bundle = tmp_path / "client"
    shutil.copytree(bundles.client_dir, bundle)
    (bundle / "tokenizer" / resolved_tokenizer.FILE).unlink()
    first = ClientBundle.open(bundle).laptop_tokenizer()
    assert not isinstance(first, resolved_tokenizer.ResolvedTokenizer)  # transformers', this once
    written = bundle / "tokenizer" / resolved_tokenizer.FILE
    assert written.is_file() and (written.stat().st_mode & 0o777) == 0o600
    assert not files.leftover_temporaries(bundle / "tokenizer")
    again = ClientBundle.open(bundle).laptop_tokenizer()
    assert isinstance(again, resolved_tokenizer.ResolvedTokenizer)
    assert_same_tokenizer(first, again)
    assert_same_chats(first, again)


def test_a_bundle_that_cannot_be_written_still_loads_its_tokenizer(bundles, tmp_path, monkeypatch):
    bundle = tmp_path / "client"
    shutil.copytree(bundles.client_dir, bundle)
    (bundle / "tokenizer" / resolved_tokenizer.FILE).unlink()

    monkeypatch.setattr(files.os, "replace", read_only)
    tokenizer = ClientBundle.open(bundle).laptop_tokenizer()
    assert tokenizer("Hello")["input_ids"] and not (bundle / "tokenizer" / resolved_tokenizer.FILE).exists()
    assert not files.leftover_temporaries(bundle / "tokenizer")
