"""The client bundle's tokenizer as transformers resolved it at prepare time, read back without transformers.

A laptop command pays 0.8-1 s to import transformers (its package scans the source of every model family),
on top of torch, before it can tokenize a prompt. A tokenizer whose encoding and decoding are those of the
`tokenizers` library (transformers' `TokenizersBackend` and the family classes that only set it up) needs
none of that once set up: `prepare`, which has transformers loaded anyway, writes `resolved.json` beside the
saved tokenizer: the backend exactly as transformers left it (post-processor, added and special tokens), the
special tokens and the chat template. `ResolvedTokenizer` reads it with `tokenizers` and renders the template
with `chat_render` (jinja2): the same ids, offsets, decoded text and rendered transcripts as transformers'
object (tests/cloak/test_resolved_tokenizer.py compares them). A tokenizer with Python-side rules of its own (its
class overrides encoding, decoding or the template; decoding that cleans up spaces; several named templates)
gets no file, and the client loads it through transformers as before; a bundle prepared before these files
existed gets its file from the client's first start (`ClientBundle.laptop_tokenizer`).

The file records the hash of every file of the saved tokenizer it was built from and the transformers that
built it: when either differs (an edited chat template, an upgraded transformers) it is not read, and the
client's next start builds it again from the saved tokenizer, as `audit` and `eval` read it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from pathlib import Path

from infemeral.cloak import chat_render
from infemeral.errors import FailedPrecondition
from infemeral.files import write_private

log = logging.getLogger(__name__)

FILE = "resolved.json"
FORMAT = "infemeral-resolved-tokenizer"
FORMAT_VERSION = 3  # 3: keyed to its sources (the saved tokenizer's files, transformers' version)
# The methods of transformers' TokenizersBackend through which the client encodes, decodes and renders; a class
# that overrides one of them does something `tokenizers` alone does not.
BACKEND_METHODS = ("__call__", "_encode_plus", "_decode", "decode", "convert_ids_to_tokens", "apply_chat_template",
                   "_convert_token_to_id_with_added_voc", "get_vocab")


def why_not_resolvable(tokenizer) -> str | None:
    """Why `tokenizer` (a transformers tokenizer) cannot be written as a resolved file, or None if it can."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return "transformers has no TokenizersBackend"
    if not isinstance(tokenizer, TokenizersBackend):
        return f"{type(tokenizer).__name__} is not backed by the tokenizers library alone"
    overridden = [m for m in BACKEND_METHODS if getattr(type(tokenizer), m) is not getattr(TokenizersBackend, m)]
    if overridden:
        return f"{type(tokenizer).__name__} overrides {', '.join(overridden)}"
    if tokenizer.split_special_tokens:
        return "it splits special tokens by default"
    if _cleans_up_spaces(tokenizer):
        return "its decoding cleans up spaces"
    if tokenizer.chat_template is not None and not isinstance(tokenizer.chat_template, str):
        return "it has several named chat templates"
    return None


def _cleans_up_spaces(tokenizer) -> bool:
    """Whether transformers' decode post-processes the text (it skips the clean-up for BPE models unless forced)."""
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return type(tokenizer.backend_tokenizer.model).__name__ != "BPE" or bool(forced)


def source_digests(directory: Path) -> dict[str, str]:
    """The sha256 of each file of the tokenizer saved in `directory`: what its resolved file is built from."""
    digests = {}
    for path in sorted(directory.iterdir()):
        if path.name != FILE and not path.name.startswith(".") and path.is_file():
            with open(path, "rb") as f:
                digests[path.name] = hashlib.file_digest(f, "sha256").hexdigest()
    return digests


def chat_template_file(tokenizer) -> str | None:
    """The file `tokenizer`'s chat template came from, named when the template is broken: transformers saves it
    apart (chat_template.jinja, or .json from older versions), else inside tokenizer_config.json. None for a
    tokenizer not loaded from a directory."""
    if not getattr(tokenizer, "name_or_path", ""):
        return None
    directory = Path(tokenizer.name_or_path)
    for name in ("chat_template.jinja", "chat_template.json"):
        if (directory / name).is_file():
            return str(directory / name)
    return str(directory / "tokenizer_config.json")


def transformers_version() -> str | None:
    """The installed transformers' version, read without importing it (the import is what the file saves)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def write(tokenizer, directory: Path) -> bool:
    """Write `directory`/resolved.json for `tokenizer` (loaded from `directory`) if it can be resolved;
    whether it was written."""
    problem = why_not_resolvable(tokenizer)
    if problem is not None:
        log.info("the client will load its tokenizer through transformers: %s", problem)
        return False
    data = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "transformers_version": transformers_version(),
        "sources": source_digests(directory),
        "backend": tokenizer.backend_tokenizer.to_str(),  # a string: read back whole, not parsed twice
        "special_tokens_map": dict(tokenizer.special_tokens_map),
        "all_special_tokens": [str(t) for t in tokenizer.all_special_tokens],
        "token_ids": {name: getattr(tokenizer, f"{name}_id") for name in ("bos_token", "eos_token", "unk_token",
                                                                          "pad_token")},
        "chat_template": tokenizer.chat_template,
    }
    # a temporary file of its own per writer (two clients may start at once); owner-only: it lies beside the
    # client bundle's secrets
    write_private(directory / FILE, json.dumps(data, ensure_ascii=False).encode())
    return True


def load(directory: Path) -> ResolvedTokenizer | None:
    """The resolved tokenizer in `directory`, or None if there is none, one of another format, or one built
    from other sources than those there now (the caller loads the tokenizer through transformers and writes
    the file again). Refused if files it was built from are gone: nothing could tell whether it still holds."""
    path = directory / FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        return None
    sources = source_digests(directory)
    missing = sorted(set(data["sources"]) - set(sources))
    if missing:
        raise FailedPrecondition(f"the tokenizer in {directory} lacks {', '.join(missing)}, from which its {FILE} "
                                 "was built; copy the whole client bundle again, or prepare it again")
    changed = sorted(name for name in sources if data["sources"].get(name) != sources[name])
    if changed:
        log.info("%s is out of date: %s changed since it was written", path, ", ".join(changed))
        return None
    installed = transformers_version()
    if installed is not None and installed != data["transformers_version"]:
        log.info("%s is out of date: it was written by transformers %s, and %s is installed", path,
                 data["transformers_version"], installed)
        return None
    return ResolvedTokenizer(data, directory)


class ResolvedTokenizer:
    """The part of a transformers tokenizer's interface that infemeral uses, over a `tokenizers.Tokenizer`."""

    def __init__(self, data: dict, directory: Path | None = None):
        import tokenizers

        self.backend = tokenizers.Tokenizer.from_str(data["backend"])
        self.backend.no_truncation()
        self.backend.no_padding()
        self.special_tokens_map: dict[str, str] = data["special_tokens_map"]
        self.all_special_tokens: list[str] = data["all_special_tokens"]
        ids = data["token_ids"]
        self.bos_token_id, self.eos_token_id = ids["bos_token"], ids["eos_token"]
        self.unk_token_id, self.pad_token_id = ids["unk_token"], ids["pad_token"]
        self.chat_template: str | None = data["chat_template"]
        self.name_or_path = str(directory) if directory is not None else ""  # as transformers names its source
        self.clean_up_tokenization_spaces = False

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        return [self._token_id(t) for t in self.all_special_tokens]

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend.get_added_tokens_decoder()

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def _token_id(self, token: str) -> int | None:
        found = self.backend.token_to_id(token)
        return self.unk_token_id if found is None else found

    def __call__(self, text: str, *, add_special_tokens: bool = True, split_special_tokens: bool = False,
                 return_offsets_mapping: bool = False) -> dict:
        self.backend.encode_special_tokens = split_special_tokens
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        out = {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask}
        if return_offsets_mapping:
            out["offset_mapping"] = encoding.offsets
        return out

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True):
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        rendered = chat_render.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                      special_tokens=self.special_tokens_map, origin=chat_template_file(self))
        if not tokenize:
            return rendered
        return {"input_ids": self(rendered, add_special_tokens=False)["input_ids"]}
