"""The server bundle names no model: its config holds only what the layers need, and old bundles still serve."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

from tests.conftest import start_server
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.cloak import prepare as prepare_module
from infemeral.cloak import server_config
from infemeral.cloak.bundle import ClientBundle, ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.server_config import SERVER_CONFIG_KEYS, write_server_config
from infemeral.cloak.sources import DEFAULT_GGUF_FILE, ModelSource

VOCAB = 64
SECRET_NAME = "acme-labs/secret-model-7b"


def server_bundle_text(server_dir: Path) -> str:
    """Everything in a server bundle that is not tensor data: JSON files whole, safetensors headers."""
    parts = []
    for path in sorted(server_dir.iterdir()):
        data = path.read_bytes()
        if path.suffix == ".safetensors":
            (size,) = struct.unpack("<Q", data[:8])
            data = data[8:8 + size]
        parts.append(path.name + "\n" + data.decode("utf-8"))
    return "\n".join(parts)


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tiny_chat_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with a minimal chat template, so the SDK can run turns on a tiny model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")


@pytest.fixture(scope="module")
def named_checkpoint(tmp_path_factory):
    """A local Hugging Face checkpoint directory whose config and path name the model."""
    directory = tmp_path_factory.mktemp("ckpt") / "secret-model-7b-instruct"
    model = tiny_llama()
    model.config._name_or_path = SECRET_NAME
    model.save_pretrained(directory)
    tiny_chat_tokenizer().save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.update({"_name_or_path": SECRET_NAME, "_model_name_or_path": SECRET_NAME})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_config_from_a_named_checkpoint_directory_names_nothing(named_checkpoint, tmp_path):
    bundles = prepare(named_checkpoint, tmp_path, progress=False)
    text = server_bundle_text(bundles.server_dir)
    for leak in ("acme", "secret-model", str(named_checkpoint), "model.safetensors", "transformers_version",
                 "vocab_size", "architectures", "LlamaForCausalLM"):
        assert leak.lower() not in text.lower(), f"the server bundle mentions {leak!r}"
    config = json.loads((bundles.server_dir / "config.json").read_text())
    assert set(config) <= set(SERVER_CONFIG_KEYS)
    assert not any("name_or_path" in key for key in config)
    manifest = json.loads((bundles.server_dir / "manifest.json").read_text())
    assert "source" not in manifest
    # The private client bundle may still say where it came from.
    assert str(named_checkpoint) in ClientBundle.open(bundles.client_dir).manifest["source"]


@pytest.mark.slow
def test_config_from_the_packaged_gguf_names_nothing(bundles, reference):
    model, _ = reference
    name = model.config.to_dict().get("_model_name_or_path")
    assert name, "the GGUF config is expected to carry its general.name (else this test checks nothing)"
    text = server_bundle_text(bundles.server_dir)
    for leak in (name, "smollm", DEFAULT_GGUF_FILE, "gguf", "name_or_path", "vocab_size"):
        assert leak.lower() not in text.lower(), f"the server bundle mentions {leak!r}"
    # ... and still carries what the layers need.
    config = ServerBundle.open(bundles.server_dir).config
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(config, key) == getattr(model.config, key), key
    assert config.rope_parameters == model.config.rope_parameters


def test_scrub_refuses_a_config_it_would_change(tmp_path, monkeypatch):
    """The round-trip check can fail: without use_sliding_window a Qwen2 window would silently vanish."""
    config = Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, sliding_window=4, use_sliding_window=True, max_window_layers=2)
    write_server_config(config, tmp_path)  # the real key list keeps it
    monkeypatch.setattr(server_config, "SERVER_CONFIG_KEYS",
                        tuple(k for k in SERVER_CONFIG_KEYS if k != "use_sliding_window"))
    with pytest.raises(RuntimeError, match="sliding_window"):
        write_server_config(config, tmp_path)


def _old_prepare(out, model, tokenizer, monkeypatch):
    """prepare() as it was before the scrub: the server config is the source config, saved whole."""
    with monkeypatch.context() as m:
        m.setattr(prepare_module, "write_server_config", lambda config, directory: config.save_pretrained(directory))
        return prepare(output=out, source=ModelSource(model, tokenizer, "old"), progress=False, basis_seed=b"\1" * 32)


@pytest.mark.slow
def test_a_bundle_prepared_before_the_scrub_still_serves(tmp_path, monkeypatch):
    model, tokenizer = tiny_llama(seed=1), tiny_chat_tokenizer()
    model.config._model_name_or_path = SECRET_NAME  # as a GGUF file's general.name arrives
    old = _old_prepare(tmp_path / "old", model, tokenizer, monkeypatch)
    assert SECRET_NAME in (old.server_dir / "config.json").read_text()  # it really is an old-style bundle
    new = prepare(output=tmp_path / "new", source=ModelSource(model, tokenizer), progress=False,
                  basis_seed=b"\1" * 32)
    assert SECRET_NAME not in (new.server_dir / "config.json").read_text()

    prompt = "w5 w9 w11 w3"
    answers = []
    for bundles in (old, new):
        server = start_server(bundles, tmp_path / f"store-{len(answers)}")
        try:
            with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=60) as client:
                session = client.new_session()
                result = session.chat(prompt, SamplingParams(max_new_tokens=6))
                answers.append(result.token_ids)
                assert session.version == 1  # the turn committed
        finally:
            server.stop(0)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=6, do_sample=False, pad_token_id=0,
                                  eos_token_id=2)[0, len(ids):].tolist()
    if expected[-1] == 2:  # the SDK stops at end-of-sequence without returning it
        expected = expected[:-1]
    assert answers[0] == answers[1] == expected
    assert answers[0], "the old bundle produced no tokens"
