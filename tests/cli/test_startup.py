"""Commands load only what they need: `--help` (the server's too), `info` and `delete` answer without torch, and a
server checks its bundle's hashes while the layers load (the bench's `startup` section times them)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import StoredSession, start_server
from infemeral.client.sampling import SamplingParams
from infemeral.errors import FailedPrecondition

HEAVY = ("torch", "transformers")


def modules_loaded_by(*argv: str, env: dict | None = None, command: str = "infemeral.cli.main") -> set[str]:
    """The heavy modules in sys.modules after `infemeral-client ARGV` (or another `command` module's `main`) ran,
    and succeeded, in a fresh interpreter."""
    code = ("import sys\nfrom %s import main\ntry:\n    rc = main(sys.argv[1:])\n"
            "except SystemExit as e:\n    rc = e.code\nprint('loaded:', *(m for m in %r if m in sys.modules))\n"
            "sys.exit(rc)" % (command, HEAVY))
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.splitlines()[-1]
    assert last.startswith("loaded:"), proc.stdout[-300:]
    return set(last.split()[1:])


def test_help_loads_neither_torch_nor_transformers():
    assert modules_loaded_by("--help") == set()
    assert modules_loaded_by("generate", "--help") == set()
    assert modules_loaded_by("serve", "--help") == set()
    assert modules_loaded_by("--help", command="infemeral.server.main") == set()


def test_info_and_delete_answer_without_the_model(server, bundles, client, tmp_path):
    session = client.new_session()
    session.chat("Hi", SamplingParams(max_new_tokens=3))
    session.save(tmp_path / "sessions" / "short.session")
    env = dict(os.environ, INFEMERAL_SERVER=f"127.0.0.1:{server.port}", INFEMERAL_CLIENT_BUNDLE=str(bundles.client_dir),
               INFEMERAL_SESSIONS_DIR=str(tmp_path / "sessions"))
    stored = StoredSession(server.settings.store, session.id)
    assert stored.exists()
    assert modules_loaded_by("info", env=env) == set()
    assert modules_loaded_by("delete", "--session", "short", env=env) == set()
    assert not stored.exists() and not (tmp_path / "sessions" / "short.session").exists()


def test_a_server_refuses_a_bundle_file_that_does_not_match_its_manifest(bundles, tmp_path):
    """The hashes are checked while the layers load; a damaged file is still named, whether or not it loads."""
    for damage in (b"not a safetensors file", None):
        bundle = tmp_path / f"server-{'garbage' if damage else 'flipped'}"
        bundle.mkdir()
        for path in bundles.server_dir.iterdir():
            (bundle / path.name).symlink_to(path)
        layer = bundle / "layer-00010.safetensors"
        data = bytearray(layer.read_bytes())
        layer.unlink()
        if damage is None:
            data[-1] ^= 1  # a weight changed, the file still loads
        layer.write_bytes(damage or bytes(data))
        with pytest.raises(FailedPrecondition, match="layer-00010.safetensors does not match its manifest"):
            start_server(SimpleNamespace(server_dir=bundle), tmp_path / "store")


def test_exit_now_finishes_what_the_interpreter_would_before_it_ends_the_process():
    code = ("import atexit, sys, threading, time\nfrom infemeral.cli.fast_exit import exit_now\n"
            "atexit.register(lambda: print('exit handler', flush=True))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n"
            "sys.stdout.write('buffered answer\\n')\nexit_now(3)\nprint('not reached')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["buffered answer", "thread done", "exit handler"]


def test_the_laptop_loads_a_generic_tokenizer_without_transformers_map_of_model_families(bundles):
    """The packaged model's tokenizer is saved as transformers' generic class: it is loaded through that class (no
    AutoTokenizer, which reads the source of every model family first), and it is the tokenizer AutoTokenizer gives."""
    code = ("import sys, json\nfrom infemeral.cloak.bundle import ClientBundle\n"
            "tok = ClientBundle.open(sys.argv[1]).tokenizer()\n"
            "text = 'Hi <|im_start|>system x</s> 123-45-6789 naïve'\n"
            "chat = tok.apply_chat_template([{'role': 'user', 'content': text}], tokenize=False,"
            " add_generation_prompt=True)\n"
            "print(json.dumps({'auto_loaded': 'transformers.models.auto' in sys.modules, 'class': type(tok).__name__,"
            " 'ids': tok(text)['input_ids'], 'chat': chat, 'eos': tok.eos_token_id}))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(bundles.client_dir)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    fast = __import__("json").loads(proc.stdout.splitlines()[-1])
    assert fast["auto_loaded"] is False

    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(bundles.client_dir / "tokenizer")
    text = "Hi <|im_start|>system x</s> 123-45-6789 naïve"
    assert fast["class"] == type(auto).__name__
    assert fast["ids"] == auto(text)["input_ids"]
    assert fast["chat"] == auto.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)
    assert fast["eos"] == auto.eos_token_id


def test_a_family_tokenizer_still_loads_through_autotokenizer(bundles, tmp_path, monkeypatch):
    """Any other saved class keeps the family's own rules: it goes through AutoTokenizer."""
    import json

    from infemeral.cloak import bundle as bundle_module

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for path in (bundles.client_dir / "tokenizer").iterdir():
        (tokenizer_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    calls = []

    import transformers

    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    tokenizer = bundle_module.load_tokenizer(tokenizer_dir)
    assert calls and tokenizer("Hello")["input_ids"]
