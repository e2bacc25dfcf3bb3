"""Client-side token sampling: greedy, temperature, top-k, top-p, repetition penalty, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from infemeral.client.sampling import Sampler, SamplingParams

VOCAB = 50


def random_logits(seed: int, n: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def log_probs(*p: float) -> torch.Tensor:
    return torch.tensor([math.log(x) for x in p])


def draws(params: SamplingParams, logits: torch.Tensor, n: int, context: list[int] | None = None) -> list[int]:
    sampler = Sampler(params)
    return [sampler(logits, context or []) for _ in range(n)]


def test_temperature_zero_is_argmax():
    for seed in range(20):
        logits = random_logits(seed)
        assert Sampler(SamplingParams(temperature=0.0))(logits, []) == int(logits.argmax())


def test_greedy_ignores_top_k_top_p_and_seed():
    logits = random_logits(1)
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.3, seed=99)
    assert set(draws(params, logits, 20)) == {int(logits.argmax())}


def test_top_k_one_is_argmax_even_with_temperature():
    for seed in range(10):
        # Flat logits: without top_k, temperature 5 would pick all sorts of tokens.
        logits = random_logits(seed, scale=0.5)
        assert set(draws(SamplingParams(temperature=5.0, top_k=1, seed=seed), logits, 30)) == {int(logits.argmax())}
    # Control: the same logits without top_k are not always the argmax.
    assert len(set(draws(SamplingParams(temperature=5.0, seed=0), random_logits(0, scale=0.5), 30))) > 1


def test_top_k_keeps_only_the_k_best():
    logits = random_logits(3, scale=0.5)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    got = set(draws(SamplingParams(temperature=2.0, top_k=3, seed=1), logits, 300))
    assert got == top3


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = random_logits(7, scale=1.0)
    params = dict(temperature=1.0, top_k=0, top_p=1.0)
    a = draws(SamplingParams(seed=123, **params), logits, 200)
    b = draws(SamplingParams(seed=123, **params), logits, 200)
    c = draws(SamplingParams(seed=124, **params), logits, 200)
    assert a == b
    assert a != c
    assert len(set(a)) > 5  # really sampling, not collapsing to one token


def test_unseeded_samplers_differ():
    logits = random_logits(7, scale=1.0)
    assert draws(SamplingParams(temperature=1.0), logits, 200) != draws(SamplingParams(temperature=1.0), logits, 200)


def test_sampling_follows_the_softmax():
    probs = [0.7, 0.2, 0.1]
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0, seed=5), log_probs(*probs), 4000)),
                            minlength=3)
    freq = (counts.float() / counts.sum()).tolist()
    for f, p in zip(freq, probs):
        assert abs(f - p) < 0.03


def test_top_p_keeps_only_the_nucleus():
    # One token holds 0.9 of the mass: a nucleus of 0.5 is that token alone.
    logits = log_probs(0.02, 0.9, 0.05, 0.03)
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5, seed=0), logits, 500)) == {1}
    # Control: without top_p the others do get drawn.
    assert len(set(draws(SamplingParams(temperature=1.0, seed=0), logits, 500))) > 1


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    # Cumulative mass 0.6, 0.9, 0.96, 1.0: top_p=0.85 needs tokens 0 and 1, never 2 or 3.
    logits = log_probs(0.6, 0.3, 0.06, 0.04)
    got = draws(SamplingParams(temperature=1.0, top_p=0.85, seed=2), logits, 1000)
    assert set(got) == {0, 1}
    # Renormalised within the nucleus: 0.6 / 0.9 ≈ 0.67.
    assert abs(got.count(0) / len(got) - 2 / 3) < 0.05


def test_repetition_penalty_changes_argmax():
    logits = torch.tensor([2.0, 1.9, -1.0, 0.5])
    assert Sampler(SamplingParams())(logits, [0]) == 0  # no penalty: token 0 wins
    # 2.0 / 1.2 ≈ 1.67 < 1.9: the seen token loses its lead.
    assert Sampler(SamplingParams(repetition_penalty=1.2))(logits, [0, 0, 3]) == 1
    assert Sampler(SamplingParams(repetition_penalty=1.2))(logits, [2, 3]) == 0  # unseen winner stays
    assert torch.equal(logits, torch.tensor([2.0, 1.9, -1.0, 0.5]))  # input not modified


def test_repetition_penalty_pushes_negative_logits_down():
    # A seen negative logit is multiplied (made more negative), never divided towards zero.
    logits = torch.tensor([-1.0, -1.1, -5.0])
    assert Sampler(SamplingParams(repetition_penalty=1.5))(logits, [0]) == 1
    assert Sampler(SamplingParams(repetition_penalty=1.5))(logits, [1]) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_greedy_and_valid():
    p = SamplingParams(top_p=1.0, top_k=0, temperature=0.0, max_new_tokens=1)
    assert p.temperature == 0.0 and p.repetition_penalty == 1.0 and p.stop == []


def test_a_tiny_temperature_samples_the_top_token_instead_of_overflowing():
    """logits / 1e-300 overflows float32 to inf, and softmax of inf - inf is NaN; the top token must win."""
    logits = torch.tensor([1.0, 3.0, 2.0, -5.0])
    probs = Sampler(SamplingParams(temperature=1e-300)).probabilities(logits, [])
    assert torch.isfinite(probs).all() and probs.tolist() == [0.0, 1.0, 0.0, 0.0]
    assert Sampler(SamplingParams(temperature=1e-300, seed=3))(logits, []) == 1


def test_extreme_seeds_that_torch_accepts_are_valid():
    for seed in (2**64 - 1, -2**63, 0):
        Sampler(SamplingParams(temperature=1.0, seed=seed))(torch.zeros(4), [])


def test_chat_defaults_follow_the_models_generation_config_and_fill_in_where_it_does_not_sample():
    from transformers import GenerationConfig

    from infemeral.client.sampling import CHAT_SAMPLING, chat_defaults

    # A config that samples is taken as its authors wrote it: no penalty of ours added.
    assert chat_defaults(GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95)) == {
        "temperature": 0.6, "top_p": 0.95}
    # One that does not (a model whose config sets nothing) gets the chat defaults, under what it does set.
    assert chat_defaults(GenerationConfig()) == CHAT_SAMPLING
    assert chat_defaults(GenerationConfig(repetition_penalty=1.05)) == {**CHAT_SAMPLING, "repetition_penalty": 1.05}
    # Greedy asked for: what greedy decoding reads from the config (its penalty) alone, nothing of ours.
    assert chat_defaults(GenerationConfig(), is_greedy=True) == {}
    assert chat_defaults(GenerationConfig(do_sample=True, temperature=0.2, top_p=0.9, repetition_penalty=1.05),
                         is_greedy=True) == {"repetition_penalty": 1.05}
