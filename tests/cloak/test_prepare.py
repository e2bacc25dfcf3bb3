"""prepare(): what goes where, who may read it, and how tampering is caught."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig

from infemeral.cloak import bundle as B
from infemeral.cloak.basis import random_orthogonal
from infemeral.cloak.bundle import ClientBundle, ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.errors import FailedPrecondition

LAYERS = 4
HIDDEN = 64
VOCAB = 160


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                         attention_bias=True, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
    return model


def tiny_tokenizer():
    """A word-level tokenizer built in memory, so the client bundle gets its tokenizer/ subdirectory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def do_prepare(out, model=None, **kwargs):
    model = model if model is not None else tiny_model()
    return prepare(output=out, source=ModelSource(model, kwargs.pop("tokenizer", None)), progress=False, **kwargs)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared")
    return do_prepare(out, tokenizer=tiny_tokenizer(), client_layers=2)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# -- client bundle privacy -----------------------------------------------------------------------

def test_client_bundle_is_owner_only(bundles):
    root = bundles.client_dir
    assert mode(root) == 0o700
    dirs, files = [], []
    for here, subdirs, names in os.walk(root):
        dirs += [os.path.join(here, d) for d in subdirs]
        files += [os.path.join(here, f) for f in names]
    assert dirs, "expected the tokenizer/ subdirectory"
    assert {"client.safetensors", "basis.safetensors", "manifest.json", "config.json"} <= {os.path.basename(f) for f in files}
    for d in dirs:
        assert mode(d) == 0o700, d
    for f in files:
        assert mode(f) == 0o600, f
    # The tokenizer round-trips through the private bundle.
    assert ClientBundle.open(root).tokenizer()("w5 w7")["input_ids"] == [5, 7]


def test_client_bundle_holds_what_the_client_needs(bundles):
    client = ClientBundle.open(bundles.client_dir)
    assert client.client_layers == 2
    assert client.server_fingerprint == bundles.fingerprint
    keys = set(client.tensors())
    assert {"embed_tokens.weight", "norm.weight", "lm_head.weight"} <= keys
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {"0", "1"}


# -- fingerprint and tamper detection --------------------------------------------------------------

def test_server_fingerprint_recomputes(bundles):
    manifest = json.loads((bundles.server_dir / "manifest.json").read_text())
    assert manifest["fingerprint"] == B.fingerprint(manifest) == bundles.fingerprint
    assert manifest["fingerprint"].startswith("sha256:")
    assert ServerBundle.open(bundles.server_dir, verify=True).fingerprint == bundles.fingerprint
    # Every file the server loads is covered by the manifest, with its real hash.
    expected = {"config.json"} | {B.layer_file(i) for i in range(2, LAYERS)}
    assert set(manifest["files"]) == expected
    for name, digest in manifest["files"].items():
        assert B.sha256_file(bundles.server_dir / name) == digest


def test_flipped_byte_in_layer_file_is_detected(bundles, tmp_path):
    import shutil

    copy = tmp_path / "server"
    shutil.copytree(bundles.server_dir, copy)
    ServerBundle.open(copy, verify=True)  # intact copy opens
    target = copy / B.layer_file(3)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01  # inside the tensor data, so the file still parses
    target.write_bytes(bytes(data))

    with pytest.raises(FailedPrecondition, match="layer-00003"):
        ServerBundle.open(copy, verify=True)
    ServerBundle.open(copy, verify=False)  # only verification catches it

    # A manifest updated to the new hash has a different fingerprint, so the client's pin no longer matches.
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"][target.name] = B.sha256_file(target)
    assert B.fingerprint(manifest) != bundles.fingerprint


def test_edited_manifest_is_detected(bundles, tmp_path):
    import shutil

    copy = tmp_path / "server"
    shutil.copytree(bundles.server_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["first_layer"] = 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FailedPrecondition, match="manifest"):
        ServerBundle.open(copy, verify=True)


def test_same_seed_gives_same_fingerprint_other_seed_differs(tmp_path):
    seed = b"\x07" * 32
    a = do_prepare(tmp_path / "a", basis_seed=seed)
    b = do_prepare(tmp_path / "b", basis_seed=seed)
    c = do_prepare(tmp_path / "c", basis_seed=b"\x08" * 32)
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != c.fingerprint


# -- what the server bundle must not contain -------------------------------------------------------

def test_server_bundle_has_no_client_side_tensors(bundles):
    server = ServerBundle.open(bundles.server_dir)
    assert server.first_layer == 2 and server.num_layers == LAYERS - 2
    files = sorted(p.name for p in bundles.server_dir.iterdir())
    assert files == sorted(["config.json", "manifest.json"] + [B.layer_file(i) for i in range(2, LAYERS)])

    model = tiny_model()
    layer_names = {k.split(".", 3)[3] for k in model.state_dict() if k.startswith("model.layers.0.")}
    for f in bundles.server_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keys = set(h.keys())
            assert keys == layer_names, f.name
            for key in keys:
                assert not any(bad in key for bad in ("embed", "lm_head", "basis")), key
                assert VOCAB not in h.get_slice(key).get_shape(), key  # nothing vocabulary-sized


def test_server_layers_are_folded_and_rotated(bundles):
    model = tiny_model()
    original = model.state_dict()
    server = ServerBundle.open(bundles.server_dir)
    q = ClientBundle.open(bundles.client_dir).basis().double()
    w = server.layer_weights(3)
    # Norm gains are folded away ...
    assert torch.equal(w["input_layernorm.weight"], torch.ones(HIDDEN))
    assert torch.equal(w["post_attention_layernorm.weight"], torch.ones(HIDDEN))
    # ... into the readers, which are rotated on their input side ...
    plain_q = original["model.layers.3.self_attn.q_proj.weight"].double()
    gain = original["model.layers.3.input_layernorm.weight"].double()
    assert torch.allclose(w["self_attn.q_proj.weight"].double(), plain_q * gain @ q, atol=1e-6)
    assert not torch.allclose(w["self_attn.q_proj.weight"].double(), plain_q, atol=1e-2)
    # ... and the writers on their output side.
    plain_o = original["model.layers.3.self_attn.o_proj.weight"].double()
    assert torch.allclose(w["self_attn.o_proj.weight"].double(), q.T @ plain_o, atol=1e-6)


# -- the basis ---------------------------------------------------------------------------------------

def test_basis_is_orthogonal(bundles):
    q = ClientBundle.open(bundles.client_dir).basis()
    assert q.shape == (HIDDEN, HIDDEN)
    eye = torch.eye(HIDDEN)
    assert (q @ q.T - eye).abs().max() < 1e-5
    assert (q.T @ q - eye).abs().max() < 1e-5
    assert (q - eye).abs().max() > 0.1  # not the identity


def test_two_prepares_without_seed_use_different_bases(tmp_path):
    model = tiny_model()
    a = do_prepare(tmp_path / "a", model)
    b = do_prepare(tmp_path / "b", model)
    qa, qb = ClientBundle.open(a.client_dir).basis(), ClientBundle.open(b.client_dir).basis()
    assert (qa - qb).abs().max() > 0.1
    assert a.fingerprint != b.fingerprint


def test_random_orthogonal_is_deterministic_per_seed():
    seed = bytes(range(32))
    q1, q2 = random_orthogonal(32, seed), random_orthogonal(32, seed)
    assert q1.dtype == torch.float64
    assert torch.equal(q1, q2)
    assert (q1 @ q1.T - torch.eye(32, dtype=torch.float64)).abs().max() < 1e-12
    assert not torch.allclose(q1, random_orthogonal(32, bytes(range(1, 33))))
    assert not torch.allclose(random_orthogonal(32), random_orthogonal(32))


def test_random_orthogonal_rejects_short_seed():
    with pytest.raises(ValueError, match="32 bytes"):
        random_orthogonal(8, b"short")


# -- argument checks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("client_layers", [0, -1, LAYERS, LAYERS + 3])
def test_client_layers_out_of_range(client_layers, tmp_path):
    with pytest.raises(ValueError, match="client_layers"):
        do_prepare(tmp_path, client_layers=client_layers)
    assert not (tmp_path / "client").exists() and not (tmp_path / "server").exists()


def test_last_valid_client_layers(tmp_path):
    b = do_prepare(tmp_path, client_layers=LAYERS - 1)
    assert ServerBundle.open(b.server_dir).num_layers == 1


def test_unknown_dtype_rejected(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        do_prepare(tmp_path, dtype="float8")


def tree_bytes(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_prepare_refuses_to_overwrite_bundles_and_says_what_that_would_lose(tmp_path):
    first = do_prepare(tmp_path)
    before = tree_bytes(tmp_path)
    with pytest.raises(FileExistsError, match="already hold bundles") as refused:
        do_prepare(tmp_path)
    message = str(refused.value)
    assert "sessions stored under the old one become unreadable" in message and "--force" in message
    assert "will refuse the new client bundle" in message
    assert tree_bytes(tmp_path) == before  # untouched, byte for byte, and no temporary directory left
    assert ClientBundle.open(first.client_dir).server_fingerprint == first.fingerprint
    # either bundle alone is enough to refuse (a server bundle written elsewhere keeps the same basis)
    with pytest.raises(FileExistsError, match="holds a bundle"):
        do_prepare(tmp_path / "elsewhere", client_dir=tmp_path / "client")
    assert not (tmp_path / "elsewhere" / "server").exists()


def test_prepare_replaces_existing_bundles_with_force(tmp_path):
    first = do_prepare(tmp_path)
    second = do_prepare(tmp_path, force=True)
    assert first.fingerprint != second.fingerprint
    assert ServerBundle.open(second.server_dir).fingerprint == second.fingerprint
    assert ClientBundle.open(second.client_dir).server_fingerprint == second.fingerprint
    # No temporary directories are left behind next to the bundles.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client", "server"]


def test_prepare_says_what_it_is_doing_at_every_stage(tmp_path, capsys):
    """No stage passes in silence: the model being read, the basis, the layer bar, the writing, in that order."""
    prepare(output=tmp_path, source=ModelSource(tiny_model(), tiny_tokenizer(), "a tiny Llama"), progress=True)
    err = capsys.readouterr().err
    stages = ["reading a tiny Llama...", f"drawing the secret basis ({HIDDEN} x {HIDDEN})...", "preparing layers",
              f"writing the client bundle (embedding, LM head, tokenizer) to {tmp_path / 'client'}...",
              "moving both bundles into place..."]
    at = [err.find(stage) for stage in stages]
    assert -1 not in at and at == sorted(at), err
    prepare(output=tmp_path, source=ModelSource(tiny_model(), tiny_tokenizer(), "a tiny Llama"), progress=False,
            force=True)
    quiet = capsys.readouterr().err
    assert not any(stage in quiet for stage in stages), quiet


# -- the closing agreement check of quantised bundles ----------------------------------------------------------

def character_tokenizer():
    """One token per printable character, so the held English text becomes varied ids (not one <unk> after another)."""
    import string

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(string.printable)}}
    assert len(vocab) <= VOCAB
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab, [], unk_token="<unk>")),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@torch.inference_mode()
def test_quantized_prepare_records_the_agreement_a_bundle_split_measures(tmp_path):
    """What prepare records is what the written bundles give on the held text: the float model's top-1 against the
    client bundle and the quantised server bundle through their kernels, teacher-forced."""
    from infemeral.eval.systems import BundleSplit
    from infemeral.quant.calibration import held_ids

    model, tokenizer = tiny_model(), character_tokenizer()
    b = do_prepare(tmp_path, model, tokenizer=tokenizer, server_quant="int4", quant_method="rtn", group_size=32)
    recorded = ClientBundle.open(b.client_dir).manifest["server_quant_agreement"]
    assert recorded == b.agreement.to_manifest() and b.agreement.positions > 100
    split, matches, first = BundleSplit(b.client_dir, b.server_dir), 0, []
    for ids in held_ids(tokenizer, 256):
        want = model(torch.tensor([ids])).logits[0].argmax(-1)
        got = split.logits(ids, split.new_cache()).argmax(-1)
        matches += int((want == got).sum())
        first += [int((want != got).nonzero()[0])] if bool((want != got).any()) else []
    assert abs(b.agreement.top1_matches - matches) <= 1  # an argmax tie may fall either way in other rounding
    assert b.agreement.top1_matches < b.agreement.positions and b.agreement.first_divergence == min(first)


def test_agreement_check_is_skipped_unquantized_or_when_asked(tmp_path):
    plain = do_prepare(tmp_path / "plain", tokenizer=tiny_tokenizer())
    unchecked = do_prepare(tmp_path / "unchecked", tokenizer=tiny_tokenizer(), server_quant="int8", agreement_check=False)
    for b in (plain, unchecked):
        assert b.agreement is None and "server_quant_agreement" not in ClientBundle.open(b.client_dir).manifest


def test_poor_agreement_warns_with_the_fix(tmp_path, caplog, monkeypatch):
    from infemeral.quant import agreement

    poor, fine = agreement.Agreement(200, 160, 0), agreement.Agreement(200, 199, 57)
    assert agreement.advice(fine, "int8", None) is None
    advice = agreement.advice(poor, "int4", 64)
    assert "80%" in advice and "--server-quant int8" in advice and "--group-size (32)" in advice
    assert "--quant-method" in advice
    monkeypatch.setattr(agreement, "POOR_TOP1_RATE", 1.01)  # every bundle is poor: prepare must say so
    with caplog.at_level("WARNING", logger="infemeral.cloak.prepare"):
        do_prepare(tmp_path, tokenizer=tiny_tokenizer(), server_quant="int8")
    assert "--server-quant int8" in caplog.text and "held positions" in caplog.text


def test_int8_rounds_to_nearest_by_default_so_needs_no_calibration(tmp_path):
    """int8 by round-to-nearest unless asked: no tokenizer, no calibration text, and the manifest says rtn."""
    b = do_prepare(tmp_path, server_quant="int8")  # no tokenizer: gptq would refuse
    assert ServerBundle.open(b.server_dir).manifest["server_quant"]["method"] == "rtn"
    with pytest.raises(ValueError, match="tokenizer"):
        do_prepare(tmp_path / "gptq", server_quant="int8", quant_method="gptq")


def test_packaged_model_records_its_authors_sampling_and_the_client_samples_with_it(tmp_path, monkeypatch):
    """The packaged model's bundle says temperature 0.2, top-p 0.9 (its model card), which chat and generate then
    use; a model given by the user keeps its own generation config."""
    from infemeral.cloak import sources
    from infemeral.client.sampling import chat_defaults

    # a tiny model stands in for the packaged GGUF that `prepare` with no model opens
    monkeypatch.setattr(sources, "GGUFSource", lambda path, packaged=False: ModelSource(tiny_model(), None, "packaged",
                                                                                        packaged=packaged))
    packaged = prepare(None, tmp_path / "packaged", progress=False)
    config = ClientBundle.open(packaged.client_dir).generation_config()
    assert (config.do_sample, config.temperature, config.top_p) == (True, 0.2, 0.9)
    assert chat_defaults(config) == {"temperature": 0.2, "top_p": 0.9}
    own = ClientBundle.open(do_prepare(tmp_path / "own").client_dir).generation_config()
    assert not own.do_sample and chat_defaults(own)["temperature"] == 0.7
    # the model handed in keeps its own generation config: the bundle's sampling is written on a copy
    model = tiny_model()
    before = model.generation_config.to_dict()
    prepare(output=tmp_path / "in-memory", source=ModelSource(model, None, "packaged", packaged=True), progress=False)
    assert model.generation_config.to_dict() == before
