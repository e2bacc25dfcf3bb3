"""The optional local draft model: greedy drafts, a cache kept in step with the conversation, one fork per
conversation over shared weights, and the refusal of a model whose tokenizer differs from the target's."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from infemeral.errors import FailedPrecondition
from infemeral.speculation.draft_model import DraftModel, check_same_tokenizer, tokenizer_mismatch

WORDS = [f"w{i}" for i in range(29)]


def tiny_tokenizer(words=WORDS, eos="</s>"):
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + list(words))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token=eos)


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32, max_position_embeddings=128, initializer_range=0.2)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def greedy(model, context, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([context]), attention_mask=torch.ones(1, len(context), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(context):].tolist()


def test_same_tokenizer_is_accepted():
    assert tokenizer_mismatch(tiny_tokenizer(), tiny_tokenizer()) is None
    check_same_tokenizer(tiny_tokenizer(), tiny_tokenizer())


@pytest.mark.parametrize("other, match", [
    (lambda: tiny_tokenizer(WORDS[:-1] + ["other"]), "vocabularies differ"),
    (lambda: tiny_tokenizer(list(reversed(WORDS))), "different ids"),
    (lambda: tiny_tokenizer(eos="<s>"), "special tokens differ"),
])
def test_a_different_tokenizer_is_refused_with_a_clear_message(other, match):
    assert match in tokenizer_mismatch(tiny_tokenizer(), other())
    with pytest.raises(FailedPrecondition, match="does not use this model's tokenizer") as info:
        check_same_tokenizer(tiny_tokenizer(), other())
    assert match in str(info.value) and "--speculate ngram" in str(info.value)


def test_drafts_are_the_draft_models_greedy_continuation():
    model = tiny_model()
    drafter = DraftModel(model)
    context = [5, 9, 3, 17, 4]
    assert drafter.propose(context, 6) == greedy(model, context, 6)
    assert drafter.propose(context, 0) == []


def test_the_cache_follows_accepted_and_rejected_drafts():
    """Proposals after the conversation moved on (some drafts kept, some rejected) equal those of a fresh
    draft model that sees the whole context at once."""
    model = tiny_model(1)
    drafter = DraftModel(model)
    context = [5, 9, 3, 17, 4]
    drafts = drafter.propose(context, 4)
    for step in range(6):
        kept = drafts[: step % 3]  # 0, 1 or 2 drafts accepted, then a token of the target's own
        context = context + kept + [(7 * step + 3) % 32]
        drafts = drafter.propose(context, 4)
        assert drafts == DraftModel(model).propose(context, 4) == greedy(model, context, 4)
    assert drafter.propose(context[:3], 2) == greedy(model, context[:3], 2)  # a rewind (edited transcript)


def test_load_checks_the_tokenizer(tmp_path):
    model, tokenizer = tiny_model(), tiny_tokenizer()
    model.save_pretrained(tmp_path / "draft")
    tokenizer.save_pretrained(tmp_path / "draft")
    drafter = DraftModel.load(tmp_path / "draft", target_tokenizer=tiny_tokenizer())
    assert drafter.propose([5, 6, 7], 3) == greedy(model, [5, 6, 7], 3)
    with pytest.raises(FailedPrecondition, match="vocabularies differ"):
        DraftModel.load(tmp_path / "draft", target_tokenizer=tiny_tokenizer(WORDS[:-1] + ["other"]))
    with pytest.raises(FileNotFoundError, match="draft model not found"):
        DraftModel.load(tmp_path / "missing", target_tokenizer=tokenizer)


def test_forks_share_the_weights_and_draft_apart_in_threads():
    """Each session drafts through its own fork: the weights are shared, the cache is not, so two
    conversations drafting at once in threads each get their own greedy continuation."""
    model = tiny_model(2)
    forks = [DraftModel(model).fork() for _ in range(2)]
    assert forks[0].model is forks[1].model is model and forks[0]._cache is None
    proposals, errors = {0: [], 1: []}, []
    start = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            context = [[5, 9, 3], [17, 4, 22, 8]][i]
            start.wait()
            for step in range(30):
                drafts = forks[i].propose(context, 3)
                proposals[i].append((context, drafts))
                context = context + drafts[:step % 3] + [(5 * step + i) % 32]  # some kept, then the target's own
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: proposals really interleave
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for i in range(2):
        for context, drafts in proposals[i]:
            assert drafts == greedy(model, context, 3)


def on_a_fake_clock(drafter, monkeypatch) -> list[int]:
    """The tokens each of `drafter`'s forward passes reads, as they happen, on a clock where a pass reading n
    tokens takes 1 + n seconds."""
    passes = []
    real = drafter._forward

    def counted_forward(ids):
        passes.append(len(ids))
        return real(ids)

    monkeypatch.setattr(drafter, "_forward", counted_forward)
    monkeypatch.setattr("infemeral.speculation.draft_model.time.perf_counter",
                        lambda: float(sum(1 + n for n in passes)))
    return passes


def test_a_draft_after_idling_is_charged_its_own_passes_not_the_catch_up(monkeypatch):
    """A draft model left idle has to catch up on every token verified since; charged to the one draft of a
    probe, that made it look many times dearer than it is (the speculator then never chose it again). The
    catch-up is read in a pass of its own, and a proposal is charged only its own passes."""
    from infemeral.speculation.draft_length import DraftLength
    from infemeral.speculation.speculator import Speculator
    from infemeral.speculation.step_cost import StepCost

    model = tiny_model(2)
    drafter = DraftModel(model)
    passes = on_a_fake_clock(drafter, monkeypatch)
    context = list(range(3, 11))
    assert drafter.propose(context, 1) == greedy(model, context, 1)
    assert passes == [7, 1] and drafter.last_seconds == 2.0  # the prompt, then its last token: 2 s charged
    passes.clear()
    context = context + [12, 13, 14, 15, 16, 17, 18]  # seven tokens verified while the drafter idled
    assert drafter.propose(context, 3) == greedy(model, context, 3)
    assert passes == [6, 1, 1, 1]  # the catch-up (7 s on the clock), then three one-token passes ...
    assert drafter.last_seconds == 6.0  # ... which alone are charged
    length = DraftLength(cost=StepCost())
    Speculator([drafter], {"draft": length}, max_draft=3)._draft(drafter, context + [19, 20], 1)
    assert length.draft_seconds == drafter.last_seconds == 2.0  # the speculator learns the charged cost


def test_drafting_every_step_is_charged_the_pass_over_its_own_accepted_drafts(monkeypatch):
    """Drafting step after step, a proposal first reads the last draft of the step before (accepted, never
    run) and the model's token: one pass, part of what drafting costs and charged, or a source as dear as
    the served model looks cheaper than it is and is chosen where it slows the turn down."""
    model = tiny_model(2)
    drafter = DraftModel(model)
    passes = on_a_fake_clock(drafter, monkeypatch)
    context = list(range(3, 11))
    drafts = drafter.propose(context, 3)
    passes.clear()
    context = context + drafts + [5]  # all three accepted, then the model's own token
    assert drafter.propose(context, 3) == greedy(model, context, 3)
    assert passes == [2, 1, 1]  # the last draft with the model's token, then two more drafts
    assert drafter.last_seconds == 7.0  # all charged
    passes.clear()
    context = context[:-3] + [6]  # the last two drafts rejected: nothing to read first
    assert drafter.propose(context, 2) == greedy(model, context, 2)
    assert passes == [1, 1] and drafter.last_seconds == 4.0
