"""The draft head: the public EAGLE layout, refusals, one session's drafting state, and training.

Every model here is a tiny random Llama or Qwen2 built in memory. The head's forward is checked
against EAGLE's computation written out by hand (embedding first, then the feature; one decoder
layer without an input norm), so a layout read in the wrong order cannot pass.
"""

from __future__ import annotations

import dataclasses
import json
import stat

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from infemeral.cloak.bundle import ClientBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.client_half.half import ClientModel
from infemeral.errors import FailedPrecondition, InfemeralError
from infemeral.speculation.head.checkpoint import probe_of, save_head
from infemeral.speculation.head.drafter import DraftHead
from infemeral.speculation.head.model import HeadModel, layer_config

VOCAB = 96
D = 64


def tiny_config(family=LlamaConfig, **overrides):
    fields = dict(hidden_size=D, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=False)
    return family(**{**fields, **overrides})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama, its client half (float32) and its bundles' directory."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32).eval()
    out = prepare(output=tmp_path_factory.mktemp("tiny"), source=ModelSource(model), progress=False)
    return model, ClientModel(ClientBundle.open(out.client_dir)), out


def eagle_tensors(config, *, fc_bias: bool, qkv_bias: bool = False, embed: torch.Tensor | None = None,
                  seed: int = 1) -> dict[str, torch.Tensor]:
    """A head's weights as EAGLE / EAGLE-2 checkpoints name them (no input_layernorm in layers.0)."""
    g = torch.Generator().manual_seed(seed)
    d, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = d // heads
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
    t = {"fc.weight": w(d, 2 * d),
         "layers.0.self_attn.q_proj.weight": w(heads * hd, d), "layers.0.self_attn.k_proj.weight": w(kv * hd, d),
         "layers.0.self_attn.v_proj.weight": w(kv * hd, d), "layers.0.self_attn.o_proj.weight": w(d, heads * hd),
         "layers.0.mlp.gate_proj.weight": w(inter, d), "layers.0.mlp.up_proj.weight": w(inter, d),
         "layers.0.mlp.down_proj.weight": w(d, inter),
         "layers.0.post_attention_layernorm.weight": 1 + w(d)}
    if fc_bias:
        t["fc.bias"] = w(d)
    if qkv_bias:
        for name, rows in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            t[f"layers.0.self_attn.{name}_proj.bias"] = w(rows)
    if embed is not None:
        t["embed_tokens.weight"] = embed.clone()
    return t


def write_eagle(directory, config, tensors, *, as_bin: bool = False):
    directory.mkdir(parents=True, exist_ok=True)
    raw = config.to_dict()
    raw.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"])
    (directory / "config.json").write_text(json.dumps(raw, default=str))
    if as_bin:
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def eagle_reference(t: dict, config, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """EAGLE's head written out: x = fc(cat(embedding, feature)); attention of x (no norm before it), causal,
    RoPE, grouped KV heads; residual; RMSNorm; SwiGLU MLP; residual. [n, d] -> [n, d]."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    n, d = embeds.shape
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    hd = d // heads
    lin = lambda x, name: x @ t[f"{name}.weight"].T + (t[f"{name}.bias"] if f"{name}.bias" in t else 0)  # noqa: E731
    x = lin(torch.cat([embeds, features], -1), "fc")
    q = lin(x, "layers.0.self_attn.q_proj").view(n, heads, hd).transpose(0, 1)
    k = lin(x, "layers.0.self_attn.k_proj").view(n, kv, hd).transpose(0, 1)
    v = lin(x, "layers.0.self_attn.v_proj").view(n, kv, hd).transpose(0, 1)
    cos, sin = LlamaRotaryEmbedding(config)(x[None], torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    k, v = k[0].repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q[0] @ k.transpose(1, 2)) / hd ** 0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, d)
    h = x + lin(attn, "layers.0.self_attn.o_proj")
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    normed = normed * t["layers.0.post_attention_layernorm.weight"]
    mlp = lin(torch.nn.functional.silu(lin(normed, "layers.0.mlp.gate_proj")) * lin(normed, "layers.0.mlp.up_proj"),
              "layers.0.mlp.down_proj")
    return h + mlp


# -- the layout ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fc_bias", [False, True], ids=["eagle2-no-bias", "eagle1-bias"])
@pytest.mark.parametrize("as_bin", [False, True], ids=["safetensors", "bin"])
def test_a_public_eagle_llama_head_loads_and_computes_eagles_forward(tiny, tmp_path, fc_bias, as_bin):
    model, client, _ = tiny
    config = tiny_config()
    t = eagle_tensors(config, fc_bias=fc_bias, embed=model.model.embed_tokens.weight.detach())
    head = DraftHead.load(write_eagle(tmp_path / "head", config, t, as_bin=as_bin), client)
    assert not head.module.has_input_norm and (head.module.fc.bias is not None) == fc_bias
    embeds, features = torch.randn(7, D), torch.randn(7, D)
    with torch.inference_mode():
        ours = head.module(embeds[None], features[None])[0]
        step_by_step = head.new_cache()  # with its cache, one position at a time: the same numbers
        rows = [head.module(embeds[None, i:i + 1], features[None, i:i + 1], step_by_step)[0] for i in range(7)]
    torch.testing.assert_close(ours, eagle_reference(t, config, embeds, features), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(rows), ours, rtol=1e-4, atol=1e-4)


def test_a_public_eagle_qwen2_head_loads_with_its_qkv_biases(tmp_path_factory, tmp_path):
    torch.manual_seed(0)
    config = tiny_config(Qwen2Config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = prepare(output=tmp_path_factory.mktemp("qwen"), source=ModelSource(model), progress=False)
    client = ClientModel(ClientBundle.open(out.client_dir))
    t = eagle_tensors(config, fc_bias=False, qkv_bias=True)
    directory = write_eagle(tmp_path / "head", config, t)
    raw = json.loads((directory / "config.json").read_text())
    raw.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (directory / "config.json").write_text(json.dumps(raw))
    head = DraftHead.load(directory, client)
    assert type(head.module.layers[0]).__name__ == "Qwen2DecoderLayer"
    embeds, features = torch.randn(5, D), torch.randn(5, D)
    with torch.inference_mode():
        ours = head.module(embeds[None], features[None])[0]
    torch.testing.assert_close(ours, eagle_reference(t, config, embeds, features), rtol=1e-4, atol=1e-4)


def test_our_own_layout_round_trips_with_its_draft_vocabulary(tiny, tmp_path):
    model, client, _ = tiny
    module = HeadModel(layer_config(tiny_config()))
    ids, rows = probe_of(lambda i: model.model.embed_tokens.weight[i].detach(), VOCAB)
    draft_ids = torch.tensor([7, 3, 50, 2, 91])
    save_head(tmp_path / "head", module, draft_ids=draft_ids, vocab_size=VOCAB, probe_ids=ids, probe_rows=rows)
    saved = sorted((p.name, stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "head").iterdir())
    assert saved == [("config.json", 0o600), ("model.safetensors", 0o600)]  # owner-only, no temporary left
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["num_hidden_layers"] == 1 and raw["draft_vocab_size"] == 5 and raw["model_type"] == "llama"
    head = DraftHead.load(tmp_path / "head", client)
    assert head.vocab.target_ids.tolist() == draft_ids.tolist()
    for name, tensor in module.state_dict().items():
        torch.testing.assert_close(head.module.state_dict()[name], tensor)
    full = DraftHead.load(tmp_path / "head", client, full_vocab=True)
    assert full.vocab.target_ids is None and full.vocab.size == VOCAB


@pytest.mark.parametrize("outside", [VOCAB, -1], ids=["the-vocabulary-size", "minus-one"])
def test_a_draft_vocabulary_naming_a_token_outside_the_vocabulary_is_refused(tiny, tmp_path, outside):
    """d2t holds offsets (target = draft + d2t[draft]): the first and last target ids load, one past either end
    (the vocabulary size, or -1, which would read the LM head's last row from the end) is refused."""
    from safetensors.torch import load_file, save_file

    _, client, _ = tiny
    module = HeadModel(layer_config(tiny_config()))
    directory = save_head(tmp_path / "head", module, draft_ids=torch.tensor([0, 5, VOCAB - 1]), vocab_size=VOCAB)
    assert DraftHead.load(directory, client).vocab.target_ids.tolist() == [0, 5, VOCAB - 1]
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["d2t"][1] = outside - 1  # draft id 1 -> target `outside`
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(InfemeralError, match="draft vocabulary \\(d2t\\) names tokens outside the vocabulary"):
        DraftHead.load(directory, client)


# -- refusals ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change, says", [
    (dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1), "hidden size is 32"),
    (dict(vocab_size=128), "vocabulary has 128 tokens"),
], ids=["hidden-size", "vocabulary"])
def test_a_head_for_another_shape_is_refused(tiny, tmp_path, change, says):
    _, client, _ = tiny
    config = tiny_config(**change)
    directory = write_eagle(tmp_path / "head", config, eagle_tensors(config, fc_bias=False))
    with pytest.raises(FailedPrecondition, match=f"draft head for another model: its {says}.*train-drafter"):
        DraftHead.load(directory, client)


def test_a_head_for_another_model_of_the_same_shape_is_refused(tiny, tmp_path):
    _, client, _ = tiny
    config = tiny_config()
    other = torch.randn(VOCAB, D)  # another model's embedding table, same shape
    directory = write_eagle(tmp_path / "head", config, eagle_tensors(config, fc_bias=False, embed=other))
    with pytest.raises(FailedPrecondition, match="another model of the same shape"):
        DraftHead.load(directory, client)


def test_an_eagle3_head_is_refused_with_the_reason(tiny, tmp_path):
    _, client, _ = tiny
    config = tiny_config()
    t = {k.replace("layers.0.", "midlayer."): v for k, v in eagle_tensors(config, fc_bias=False).items()}
    t["fc.weight"] = torch.randn(D, 3 * D)
    with pytest.raises(FailedPrecondition, match="EAGLE-3 head.*three of the model's layers"):
        DraftHead.load(write_eagle(tmp_path / "head", config, t), client)


# -- one session's drafting state ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def head(tiny):
    model, client, _ = tiny
    torch.manual_seed(3)
    return DraftHead(HeadModel(layer_config(tiny_config())), client, keep_features=32, max_positions=48)


def features_of(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


@torch.no_grad()
def test_unrolled_training_passes_compute_what_drafting_computes():
    """Pass s at position j of the training-time test is the (s + 1)-th draft's feature of a chain started at
    j − s: the head fed the true features up to there over its cache, then its own predictions."""
    torch.manual_seed(4)
    module = HeadModel(layer_config(tiny_config())).eval()
    n = 11
    embeds, feats = torch.randn(2, n, D), torch.randn(2, n, D)
    passes = module.unrolled(embeds, feats, 3)
    assert len(passes) == 3 and all(p.shape == (2, n, D) for p in passes)
    for row in range(2):
        for m in range(n):
            cache = module.new_cache(torch.float32, torch.device("cpu"))
            h = module(embeds[row:row + 1, :m + 1], feats[row:row + 1, :m + 1], cache)[:, -1:]
            torch.testing.assert_close(passes[0][row, m], h[0, 0], rtol=1e-4, atol=1e-4)
            for s in (1, 2):
                if m + s >= n:
                    break
                h = module(embeds[row:row + 1, m + s:m + s + 1], h, cache)
                torch.testing.assert_close(passes[s][row, m + s], h[0, 0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(passes[1][:, 2:], passes[0][:, 2:], atol=1e-3)  # the passes differ: it can fail


def test_a_drafter_fed_step_by_step_drafts_as_one_fed_at_once(tiny, head):
    """Verified steps (with accepted and rejected drafts between them) leave the head's cache exactly as if
    the whole conversation had been fed at once."""
    model = tiny[0]
    ids = [int(x) for x in torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5))]
    feats = features_of(model, ids)
    stepped = head.fork()
    stepped.observe(ids[:10], feats[6:10])  # the prompt's last 4 positions
    m = 10
    while m < 30:
        stepped.propose(ids[:m + 1], 3)  # drafts, dropped again
        accepted = m % 3  # then some of them verified: features of the step's verified positions
        stepped.observe(ids[:m + 1 + accepted], feats[m:m + 1 + accepted])
        m += 1 + accepted
    whole = head.fork()
    whole.observe(ids[:m], feats[6:m])
    assert stepped.propose(ids[:m + 1], 4) == whole.propose(ids[:m + 1], 4)
    assert len(stepped.propose(ids[:m + 1], 4)) == 4


def rewound_and_fresh(model, head):
    """A drafter that drafted in one conversation and then saw it change from position 15 on, and a drafter
    that only ever saw the changed one; and the changed conversation."""
    ids = [int(x) for x in torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(6))]
    other = ids[:15] + [(t + 1) % VOCAB for t in ids[15:]]
    drafter = head.fork()
    drafter.observe(ids[:25], features_of(model, ids[:25]))
    drafter.propose(ids[:26], 3)
    feats = features_of(model, other)
    drafter.observe(other[:25], feats[15:25])  # the conversation changed from position 15 on
    fresh = head.fork()
    fresh.observe(other[:25], feats[:25])
    return drafter, fresh, other


def test_a_rewind_forgets_what_no_longer_holds(tiny, head):
    drafter, fresh, other = rewound_and_fresh(tiny[0], head)
    assert drafter.propose(other[:26], 3) == fresh.propose(other[:26], 3)
    assert head.fork().propose(other[:26], 3) == []  # no features: no drafts


def test_after_a_rewind_the_heads_cache_is_a_fresh_drafters(tiny, head):
    """Drafts agreeing is not enough (a tiny head's argmax hides a stale position): after the conversation
    changes from position 15 on and the drafter drafts again, its cache holds exactly the keys and values, and
    its window exactly the features, of a drafter that only ever saw the new conversation."""
    drafter, fresh, other = rewound_and_fresh(tiny[0], head)
    drafter.propose(other[:26], 3)
    fresh.propose(other[:26], 3)
    assert (drafter.start, drafter.cache.length) == (fresh.start, fresh.cache.length) and fresh.cache.length > 15
    for mine, theirs in zip(drafter.cache.layer_tensors(0), fresh.cache.layer_tensors(0)):  # keys, values
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert (drafter._feature_start, drafter._feature_end) == (fresh._feature_start, fresh._feature_end)
    held = slice(0, fresh._feature_end - fresh._feature_start)
    torch.testing.assert_close(drafter._features[held], fresh._features[held], rtol=0, atol=0)


def test_a_long_conversation_keeps_a_bounded_window(tiny, head):
    model = tiny[0]
    ids = [int(x) for x in torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(7))]
    feats = features_of(model, ids)
    drafter = head.fork()
    drafter.observe(ids[:20], feats[:20])
    for m in range(20, 199):
        assert len(drafter.propose(ids[:m + 1], 2)) == 2
        drafter.observe(ids[:m + 1], feats[m:m + 1])
    assert drafter.cache.length <= head.max_positions
    assert drafter._feature_end - drafter._feature_start <= 2 * head.keep_features


def test_sessions_draft_alone(tiny, head):
    model = tiny[0]
    a = [int(x) for x in torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(8))]
    b = [int(x) for x in torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(9))]
    fa, fb = features_of(model, a), features_of(model, b)
    one, two = head.fork(), head.fork()
    one.observe(a[:15], fa[:15])
    two.observe(b[:12], fb[:12])
    interleaved = [one.propose(a[:16], 3), two.propose(b[:13], 3)]
    alone_a, alone_b = head.fork(), head.fork()
    alone_a.observe(a[:15], fa[:15])
    alone_b.observe(b[:12], fb[:12])
    assert interleaved == [alone_a.propose(a[:16], 3), alone_b.propose(b[:13], 3)]


def test_drafts_over_a_reduced_vocabulary_are_its_tokens(tiny):
    model, client, _ = tiny
    torch.manual_seed(3)
    module = HeadModel(layer_config(tiny_config()))
    reduced = DraftHead(module, client, draft_ids=torch.tensor([4, 8, 15, 16, 23, 42]))
    ids = list(range(1, 21))
    drafter = reduced.fork()
    drafter.observe(ids, features_of(model, ids))
    drafts = drafter.propose(ids + [5], 6)
    assert len(drafts) == 6 and set(drafts) <= {4, 8, 15, 16, 23, 42}


@pytest.mark.parametrize("mode", [dict(dtype="bfloat16"), dict(quant="int8")], ids=["bfloat16", "int8"])
def test_a_head_drafts_in_the_client_halfs_reduced_modes(tiny, mode):
    model, _, out = tiny
    client = ClientModel(ClientBundle.open(out.client_dir), **mode)
    torch.manual_seed(3)
    head = DraftHead(HeadModel(layer_config(tiny_config())), client, draft_ids=torch.arange(0, VOCAB, 2))
    ids = list(range(1, 21))
    drafter = head.fork()
    drafter.observe(ids, features_of(model, ids).to(client.dtype))
    assert len(drafter.propose(ids + [5], 4)) == 4
    assert head.memory_bytes() > 0 and head.vocab.size == VOCAB // 2
    assert DraftHead(HeadModel(layer_config(tiny_config())), client).vocab.size == VOCAB  # over the half's own head


# -- training ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_tokenizer():
    """The packaged model's tokenizer (it has a chat template), without the model."""
    from transformers import AutoTokenizer

    from infemeral.cloak.sources import default_gguf_path

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_train_drafter_writes_a_head_this_model_loads_and_reuses_its_data(chat_tokenizer, tmp_path, monkeypatch):
    from infemeral.speculation.head import data, train
    from infemeral.speculation.head.settings import TrainSettings

    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(chat_tokenizer), eos_token_id=chat_tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    settings = TrainSettings(prompts=6, held_out=2, max_new_tokens=10, max_steps=4, batch_tokens=256,
                             draft_vocab=300, generate_batch=4, eval_positions=4, eval_drafts=3, threads=1)
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    report = train.train_drafter("tiny", tmp_path / "head", settings, cache_dir=tmp_path / "cache",
                                 progress=False, loaded=(model, chat_tokenizer))
    for name, t in model.state_dict().items():  # answered by it or a copy: the model itself untouched
        assert t.dtype == torch.float32 and torch.equal(t, weights[name]), name
    assert report.steps == 4 and report.prompts == 6 and report.answer_tokens > 0
    assert 0 < report.draft_vocab <= 300 and report.final_loss == report.final_loss  # finite
    assert 1.0 <= report.tokens_per_step <= 4.0
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["num_hidden_layers"] == 1 and raw["infemeral"]["training"]["steps"] == 4
    cached = sorted((tmp_path / "cache").iterdir())  # the answers, written whole and owner-only, no temporary left
    assert [p.suffix for p in cached] == [".features", ".safetensors"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in cached)
    out = prepare(output=tmp_path / "bundles", source=ModelSource(model, chat_tokenizer), progress=False)
    head = DraftHead.load(tmp_path / "head", ClientModel(ClientBundle.open(out.client_dir)))
    assert head.vocab.size == report.draft_vocab and chat_tokenizer.eos_token_id in head.vocab.target_ids.tolist()
    with pytest.raises(FailedPrecondition, match="same shape"):  # the probe tells this model from another
        other = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        out2 = prepare(output=tmp_path / "other", source=ModelSource(other, chat_tokenizer), progress=False)
        DraftHead.load(tmp_path / "head", ClientModel(ClientBundle.open(out2.client_dir)))

    def no_answers(*args, **kwargs):
        raise AssertionError("the cached answers should have been used")

    monkeypatch.setattr(data, "answer", no_answers)
    unrolled = dataclasses.replace(settings, unroll=3)  # other training settings: the same answers
    again = train.train_drafter("tiny", tmp_path / "head2", unrolled, cache_dir=tmp_path / "cache",
                                progress=False, loaded=(model, chat_tokenizer))
    assert again.answer_tokens == report.answer_tokens and again.steps == 4
    assert again.final_loss > report.final_loss  # three drafts' losses, where one draft's was


def test_the_held_out_measurement_steps_through_answers_as_a_session_does():
    """A step starts after the drafts the last one kept and the model's own token, where a head tends to be
    wrong; drafting at every position instead counts the easy ones again. This head is right exactly where the
    context has an even length: every position's first draft is right half the time, a session's every time
    after its first step (a kept draft and the model's token: two tokens, the parity kept)."""
    from types import SimpleNamespace

    from infemeral.speculation.head.data import TrainingData
    from infemeral.speculation.head.measure import measure

    observed = []

    class EvenDrafter:
        def observe(self, ids, features):
            observed.append((len(ids), features[:, 0].tolist()))

        def propose(self, ids, k):
            n = len(ids)
            return list(range(n, n + k)) if n % 2 == 0 else [-1] * k

    head = SimpleNamespace(vocab=SimpleNamespace(target_ids=None), fork=EvenDrafter)
    ids = torch.arange(41)  # the token at position i is i; the feature of position i is i too
    data = TrainingData([ids], [ids.float()[:, None]], [10])  # the answer: positions 10 to 40
    first, per_step, coverage = measure(head, data, 1, progress=False)
    # steps after contexts of 11 (wrong: one token), then 12, 14, ..., 40 (right: two tokens each)
    assert first == pytest.approx(15 / 16) and per_step == pytest.approx(31 / 16)  # at every position: 1/2, 3/2
    assert coverage == 1.0
    for length, features in observed:  # each step's verified positions, up to the last kept draft
        assert features == list(range(length - len(features), length))


def test_the_training_prompts_are_not_the_benchmarks():
    import ast
    from pathlib import Path

    from infemeral.speculation.head.prompts import chat_prompts, held_out_prompts

    source = (Path(__file__).resolve().parents[2] / "scripts" / "bench" / "workloads.py").read_text()
    benchmark = {node.value for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    prompts = chat_prompts()
    assert len(prompts) >= 500 and len(set(prompts)) == len(prompts)
    assert not set(prompts) & benchmark and not set(held_out_prompts()) & benchmark
