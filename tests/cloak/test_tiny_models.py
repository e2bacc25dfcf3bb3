"""The split is exact on tiny random models of every supported family (docs/design.md §1).

Each model is built in memory from a small config, with every RMSNorm gain and
every bias randomised (default init has gains of 1 and zero biases, which would
let a broken fold pass). The bundles are prepared, then the split path runs
in-process: ClientModel (embedding, local layers, Q) -> server LayerStack
(folded, rotated layers) -> ClientModel (un-rotate, final norm, LM head), over
a prompt and a few decode steps, and is compared with the unsplit model.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from infemeral.client_half.half import ClientModel
from infemeral.cloak.bundle import ClientBundle, ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.errors import UnsupportedModel
from infemeral.layers.architecture import check_supported
from infemeral.layers.stack import LayerStack

TOL = 1e-4
VOCAB = 128
LAYERS = 4
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
              initializer_range=0.1, tie_word_embeddings=False)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "llama-bias": lambda: LlamaConfig(attention_bias=True, mlp_bias=True, **COMMON),
    "llama-tied": lambda: LlamaConfig(**{**COMMON, "tie_word_embeddings": True}),
    "qwen2": lambda: Qwen2Config(**COMMON),
    "qwen3": lambda: Qwen3Config(head_dim=16, **COMMON),
    "mistral": lambda: MistralConfig(**COMMON),
    # Native sliding windows shorter than the test sequence, so the window mask really matters.
    "mistral-window": lambda: MistralConfig(**{**COMMON, "sliding_window": 4}),
    "qwen2-window": lambda: Qwen2Config(**{**COMMON, "sliding_window": 4, "use_sliding_window": True,
                                           "max_window_layers": 2}),
    "qwen3-window": lambda: Qwen3Config(head_dim=16, **{**COMMON, "sliding_window": 5, "use_sliding_window": True,
                                                        "max_window_layers": 1}),
}

PROMPT_LEN = 10
DECODE_STEPS = 4


def build(config, seed: int = 0):
    """A tiny fp32 model with randomised norm gains and biases."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return model


def token_ids(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def server_stack(bundle: ServerBundle) -> LayerStack:
    """The server's layers, built as infemeral/server/engine.py builds them."""
    first = bundle.first_layer
    layers = [bundle.layer_weights(i) for i in range(first, first + bundle.num_layers)]
    return LayerStack(bundle.config, first, layers, dtype=torch.float32)


def plain_stack(model, first_layer: int) -> LayerStack:
    """The model's own (unfolded, unrotated) layers [first_layer, L) as a LayerStack."""
    state = model.state_dict()
    layers = []
    for i in range(first_layer, model.config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        layers.append({k[len(prefix):]: v.clone() for k, v in state.items() if k.startswith(prefix)})
    return LayerStack(model.config, first_layer, layers, dtype=torch.float32)


def split_logits(client: ClientModel, server: LayerStack, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Run ids through the split path in chunks (prompt, then decode steps); logits of every position."""
    client_cache, server_cache = client.new_cache(), server.new_cache()
    out, start = [], 0
    for n in chunks:
        hidden = client.cloak(ids[start:start + n], client_cache)
        residual = server(hidden, server_cache)
        out.append(client.logits(residual))
        start += n
    assert start == len(ids)
    return torch.cat(out)


def plain_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def prepared(model, tmp_path, **kwargs):
    b = prepare(output=tmp_path, source=ModelSource(model), progress=False, **kwargs)
    return ClientModel(ClientBundle.open(b.client_dir)), server_stack(ServerBundle.open(b.server_dir))


def test_tiny_models_have_nontrivial_gains_and_biases():
    """Guard: the randomisation really gives folding and bias rotation something to do."""
    model = build(CONFIGS["llama-bias"]())
    state = model.state_dict()
    for name in ("model.layers.2.input_layernorm.weight", "model.layers.2.post_attention_layernorm.weight",
                 "model.norm.weight"):
        assert (state[name] - 1).abs().max() > 0.1, name
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert state[f"model.layers.2.self_attn.{name}.bias"].abs().max() > 0.1, name
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert state[f"model.layers.2.mlp.{name}.bias"].abs().max() > 0.1, name
    logits = plain_logits(model, token_ids(PROMPT_LEN))
    assert logits.abs().max() > 1.0  # large enough that TOL is a strict bound


@pytest.mark.parametrize("client_layers", [1, 2])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_split_matches_plain_model(family, client_layers, tmp_path):
    model = build(CONFIGS[family]())
    client, server = prepared(model, tmp_path, client_layers=client_layers)
    assert server.first_layer == client_layers
    assert len(server.layers) == LAYERS - client_layers
    ids = token_ids(PROMPT_LEN + DECODE_STEPS)
    split = split_logits(client, server, ids, [PROMPT_LEN] + [1] * DECODE_STEPS)
    plain = plain_logits(model, ids)
    assert split.shape == plain.shape == (len(ids), VOCAB)
    err = (split - plain).abs().max().item()
    assert err < TOL, f"{family}: split logits differ from the plain model by {err}"
    assert torch.equal(split.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("family", ["llama-bias", "qwen2-window"])
def test_split_multi_token_steps_match(family, tmp_path):
    """Steps of several tokens (speculative drafts) are exact too, also across a sliding window."""
    model = build(CONFIGS[family](), seed=3)
    client, server = prepared(model, tmp_path)
    ids = token_ids(17, seed=4)
    split = split_logits(client, server, ids, [7, 3, 1, 4, 2])
    assert (split - plain_logits(model, ids)).abs().max().item() < TOL


def test_split_greedy_generation_is_token_identical(tmp_path):
    model = build(CONFIGS["qwen2"](), seed=5)
    client, server = prepared(model, tmp_path)
    prompt = token_ids(PROMPT_LEN, seed=6)
    new_tokens = 12
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    client_cache, server_cache = client.new_cache(), server.new_cache()
    step, got = prompt, []
    for _ in range(new_tokens):
        logits = client.logits(server(client.cloak(step, client_cache), server_cache))
        step = [int(logits[-1].argmax())]
        got.append(step[0])
    assert len(expected) == new_tokens
    assert got == expected


# -- the test can fail: wrong schemes give wrong logits ----------------------------------------

def test_rotating_activations_only_is_not_exact(tmp_path):
    """docs/design.md §1: the naive scheme (xQ through the unmodified layers) changes logits a lot."""
    model = build(CONFIGS["llama-bias"]())
    client, _ = prepared(model, tmp_path)
    naive_server = plain_stack(model, first_layer=1)
    ids = token_ids(PROMPT_LEN + DECODE_STEPS)
    chunks = [PROMPT_LEN] + [1] * DECODE_STEPS
    plain = plain_logits(model, ids)

    # Control: the same harness with Q = I is exact, so any error below comes from Q alone.
    basis = client.basis
    client.basis = torch.eye(basis.shape[0], dtype=basis.dtype)
    assert (split_logits(client, naive_server, ids, chunks) - plain).abs().max().item() < TOL

    client.basis = basis
    naive = split_logits(client, naive_server, ids, chunks)
    err = (naive - plain).abs().max().item()
    assert err > 1000 * TOL, f"naive scheme unexpectedly close: {err}"
    assert not torch.equal(naive.argmax(-1), plain.argmax(-1))


def test_client_and_server_from_different_bases_give_wrong_logits(tmp_path):
    model = build(CONFIGS["llama-bias"]())
    client_a, server_a = prepared(model, tmp_path / "a", basis_seed=b"\x01" * 32)
    _, server_b = prepared(model, tmp_path / "b", basis_seed=b"\x02" * 32)
    ids = token_ids(PROMPT_LEN + DECODE_STEPS)
    chunks = [PROMPT_LEN] + [1] * DECODE_STEPS
    plain = plain_logits(model, ids)
    assert (split_logits(client_a, server_a, ids, chunks) - plain).abs().max().item() < TOL
    mismatched = split_logits(client_a, server_b, ids, chunks)
    err = (mismatched - plain).abs().max().item()
    assert err > 1000 * TOL, f"mismatched bases unexpectedly close: {err}"
    assert not torch.equal(mismatched.argmax(-1), plain.argmax(-1))


# -- refused architectures -----------------------------------------------------------------------

TINY_GEMMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128)


@pytest.mark.parametrize("config_cls", [Gemma2Config, Gemma3TextConfig], ids=["gemma2", "gemma3_text"])
def test_sandwich_norm_models_are_refused(config_cls, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**TINY_GEMMA), dtype=torch.float32).eval()
    with pytest.raises(UnsupportedModel, match="sandwich norms"):
        prepare(output=tmp_path, source=ModelSource(model), progress=False)
    assert not (tmp_path / "client").exists() and not (tmp_path / "server").exists()


def test_sandwich_norm_checkpoint_directory_is_refused(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Gemma2Config(**TINY_GEMMA), dtype=torch.float32)
    model.save_pretrained(tmp_path / "gemma2")
    with pytest.raises(UnsupportedModel, match="sandwich norms"):
        prepare(tmp_path / "gemma2", output=tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "server").exists()


def test_multimodal_gemma3_config_is_refused():
    from transformers import Gemma3Config

    with pytest.raises(UnsupportedModel, match="sandwich norms"):
        check_supported(Gemma3Config())


def test_unknown_model_type_is_refused(tmp_path):
    model = build(CONFIGS["llama"]())
    model.config.model_type = "frobnicator_lm"
    with pytest.raises(UnsupportedModel, match="frobnicator_lm") as info:
        prepare(output=tmp_path, source=ModelSource(model), progress=False)
    assert "pre-norm Llama-style" in str(info.value)
    assert not (tmp_path / "server").exists()


def test_non_llama_architecture_is_refused(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB))
    with pytest.raises(UnsupportedModel, match="gpt2"):
        prepare(output=tmp_path, source=ModelSource(model), progress=False)


def test_non_silu_activation_is_refused(tmp_path):
    model = build(LlamaConfig(**{**COMMON, "hidden_act": "gelu"}))
    with pytest.raises(UnsupportedModel, match="gelu"):
        prepare(output=tmp_path, source=ModelSource(model), progress=False)
