"""Speculative decoding on the client: the acceptance rule, its exactness, and the adaptive draft length.

The statistical test runs a tiny random Llama through the real split (client
layers, rotated server layers, both KV caches truncated after rejections) and
compares the joint distribution of the first three tokens with the exact
target distribution computed from the plain model. Deliberately wrong rules
fail it.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from infemeral.client.sampling import Sampler, SamplingParams
from infemeral.speculation.acceptance import accept_drafts, accept_tree
from infemeral.speculation.draft_length import DraftLength, SourceHistory, expected_tokens
from infemeral.speculation.step_cost import StepCost

# -- a toy "model": logits as a fixed function of the context, so any decoding order sees the same numbers --

TOY_VOCAB = 12


def toy_logits(context: list[int]) -> torch.Tensor:
    seed = hash((len(context) % 3, tuple(context[-2:]))) % (1 << 31)
    return torch.randn(TOY_VOCAB, generator=torch.Generator().manual_seed(seed)) * 2.0


def plain_decode(sampler: Sampler, prompt: list[int], n: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(n):
        token = sampler(toy_logits(context), context)
        out.append(token)
        context.append(token)
    return out


def speculative_decode(sampler: Sampler, prompt: list[int], n: int, drafter, rule=accept_drafts) -> tuple[list, int]:
    """The client's loop: a step carries the last sampled token plus drafts; returns tokens and round trips."""
    context = list(prompt)
    out = [sampler(toy_logits(context), context)]  # the first token comes from the prompt's step
    context.append(out[0])
    trips = 1
    while len(out) < n:
        drafts = drafter(context)
        rows = torch.stack([toy_logits(context + drafts[:i]) for i in range(len(drafts) + 1)])
        got = rule(sampler, rows, context, drafts)
        trips += 1
        out += got
        context += got
    return out[:n], trips


def noisy_drafter(seed: int, right: float = 0.6):
    """Drafts the greedy continuation, each token replaced by a random one with probability 1 - right."""
    rng = random.Random(seed)

    def drafter(context):
        drafts, ctx = [], list(context)
        for _ in range(rng.randint(0, 4)):
            token = int(toy_logits(ctx).argmax()) if rng.random() < right else rng.randrange(TOY_VOCAB)
            drafts.append(token)
            ctx.append(token)
        return drafts

    return drafter


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.5),
    dict(temperature=1.0, seed=7),
    dict(temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3, seed=11),
], ids=["greedy", "greedy-penalty", "sampled", "sampled-filtered"])
def test_speculation_yields_the_tokens_of_one_at_a_time_decoding(params):
    """Any drafts, right or wrong: the same tokens as decoding without speculation (same seed, same logits),
    because each position takes exactly one draw from the sampler, in order."""
    for trial in range(5):
        prompt = [trial, 3, 1]
        expected = plain_decode(Sampler(SamplingParams(**params)), prompt, 40)
        got, trips = speculative_decode(Sampler(SamplingParams(**params)), prompt, 40, noisy_drafter(trial))
        assert got == expected
        assert trips < 40  # drafts were really accepted


def test_accept_drafts_keeps_the_agreeing_prefix_and_one_token_of_its_own():
    greedy = Sampler(SamplingParams())
    rows = torch.full((4, 6), -5.0)
    for i, best in enumerate([2, 4, 1, 5]):
        rows[i, best] = 5.0
    assert accept_drafts(greedy, rows, [0], [2, 4, 1]) == [2, 4, 1, 5]  # all accepted, plus the bonus token
    assert accept_drafts(greedy, rows, [0], [2, 3, 1]) == [2, 4]        # second rejected: its correction
    assert accept_drafts(greedy, rows, [0], [0, 4, 1]) == [2]
    assert accept_drafts(greedy, rows[:1], [0], []) == [2]              # no drafts: a plain step
    with pytest.raises(ValueError, match="3 drafts need 4 rows"):
        accept_drafts(greedy, rows[:3], [0], [2, 4, 1])


def test_accepted_drafts_count_for_the_repetition_penalty():
    # Row 1 prefers token 3 (2.0) over 2 (1.9); once draft 3 is accepted it is "seen" and 2 wins.
    rows = torch.tensor([[0.0, 0.0, 0.0, 9.0], [0.0, 0.0, 1.9, 2.0]])
    sampler = Sampler(SamplingParams(repetition_penalty=1.2))
    assert accept_drafts(sampler, rows, [0], [3]) == [3, 2]
    assert accept_drafts(Sampler(SamplingParams()), rows, [0], [3]) == [3, 3]


# -- the statistical test on a tiny model through the split -------------------------------------------------

VOCAB = 32
PROMPT = [5, 17, 3, 28, 9, 14, 2, 21]
PARAMS = dict(temperature=1.0, top_k=3, repetition_penalty=1.8)  # 3 choices per position; repeats matter
RUNS = 1000


@pytest.fixture(scope="module")
def one_thread():
    """Thousands of tiny forward passes: one thread avoids thread hand-offs that cost more than the math."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    from infemeral.client_half.half import ClientModel
    from infemeral.cloak.bundle import ClientBundle, ServerBundle
    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource
    from infemeral.layers.stack import LayerStack

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         initializer_range=0.15, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = prepare(output=tmp_path_factory.mktemp("tiny"), source=ModelSource(model), progress=False)
    server_bundle = ServerBundle.open(out.server_dir)
    first = server_bundle.first_layer
    server = LayerStack(server_bundle.config, first,
                        [server_bundle.layer_weights(i) for i in range(first, first + server_bundle.num_layers)])
    return model, ClientModel(ClientBundle.open(out.client_dir)), server


def exact_joint(model) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3) after PROMPT under the sampler's distribution, from the plain model."""
    sampler = Sampler(SamplingParams(**PARAMS))

    def dist(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + prefix])).logits[0, -1]
        return sampler.probabilities(logits, PROMPT + prefix)

    joint = {}
    p1 = dist([])
    for x1 in torch.nonzero(p1).flatten().tolist():
        p2 = dist([x1])
        for x2 in torch.nonzero(p2).flatten().tolist():
            p3 = dist([x1, x2])
            for x3 in torch.nonzero(p3).flatten().tolist():
                joint[(x1, x2, x3)] = float(p1[x1] * p2[x2] * p3[x3])
    return joint


def top3(model, prefix) -> list[int]:
    with torch.no_grad():
        return model(torch.tensor([PROMPT + prefix])).logits[0, -1].topk(3).indices.tolist()


def speculative_samples(tiny, rule, runs: int = RUNS) -> tuple[list[tuple[int, ...]], int]:
    """Many seeded runs of the first three positions, drafting two tokens each run (a right guess about
    half the time), through the split with both caches truncated after a rejection; the samples and
    the number of drafts accepted."""
    model, client, server = tiny
    ccache, scache = client.new_cache(), server.new_cache()
    client.logits(server(client.cloak(PROMPT[:-1], ccache), scache))
    base = ccache.length
    candidates = {(): top3(model, [])}

    def guess(rng, prefix):
        key = tuple(prefix)
        if key not in candidates:
            candidates[key] = top3(model, prefix)
        best, *others = candidates[key]
        return best if rng.random() < 0.5 else rng.choice(others + [31])  # right about half the time

    def verify(tokens):
        return client.logits(server(client.cloak(tokens, ccache), scache))

    samples, accepted = [], 0
    for run in range(runs):
        sampler, rng = Sampler(SamplingParams(seed=run, **PARAMS)), random.Random(10_000 + run)
        d1 = guess(rng, [])
        drafts = [d1, guess(rng, [d1])]
        context = list(PROMPT)  # ends with the step's first token, as after a sampled token
        tokens = rule(sampler, verify([PROMPT[-1]] + drafts), context, drafts)
        rejected = len(drafts) - (len(tokens) - 1)
        accepted += len(tokens) - 1
        while len(tokens) < 3:  # the next step starts with the correction; no drafts this time
            for cache in (ccache, scache):
                cache.truncate(rejected)
            rejected = 0
            tokens += rule(sampler, verify([tokens[-1]]), context + tokens, [])
        samples.append(tuple(tokens[:3]))
        for cache in (ccache, scache):
            cache.truncate(cache.length - base)
    return samples, accepted


def chi_square_p(samples, joint) -> float:
    """Pearson's chi-square p-value of observed counts against an exact distribution; sparse cells pooled."""
    n = len(samples)
    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if set(counts) - set(joint):
        return 0.0  # a sequence the target can never produce
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in joint.items():
        expected, observed = n * p, counts.get(cell, 0)
        if expected < 5:
            pooled_obs, pooled_exp = pooled_obs + observed, pooled_exp + expected
            continue
        stat += (observed - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def first_positions_p(samples, joint) -> float:
    """The smallest p-value over the first 1, 2 and 3 positions' joint distributions, times 3 (Bonferroni):
    one position alone is the most sensitive to a wrong residual, three to a wrong context."""
    p_values = []
    for length in (1, 2, 3):
        marginal: dict = {}
        for cell, p in joint.items():
            marginal[cell[:length]] = marginal.get(cell[:length], 0.0) + p
        p_values.append(chi_square_p([s[:length] for s in samples], marginal))
    return min(1.0, 3 * min(p_values))


def point_mass_rule(remove_rejected: bool):
    """The rule written out: accept d with probability p(d); else sample the residual p - d (or, wrongly,
    p itself)."""

    def rule(sampler, logits, context, drafts):
        context, out = list(context), []
        for i, row in enumerate(logits):
            p = sampler.probabilities(row, context)
            if i < len(drafts) and torch.rand((), generator=sampler.generator) < p[drafts[i]]:
                out.append(drafts[i])
                context.append(drafts[i])
                continue
            if i < len(drafts) and remove_rejected:
                p = p.clone()
                p[drafts[i]] = 0
                p /= p.sum()
            out.append(int(torch.multinomial(p, 1, generator=sampler.generator)))
            break
        return out

    return rule


def always_accept(sampler, logits, context, drafts):
    return list(drafts) + [sampler(logits[len(drafts)], list(context) + list(drafts))]


def stale_context(sampler, logits, context, drafts):
    """Forgets that accepted drafts are part of the context (the repetition penalty then misses them)."""
    return accept_drafts(lambda row, _: sampler(row, list(context)), logits, context, drafts)


@pytest.fixture(scope="module")
def joint(tiny):
    return exact_joint(tiny[0])


@pytest.mark.parametrize("rule", [accept_drafts, point_mass_rule(remove_rejected=True)], ids=["sdk", "explicit"])
def test_speculative_sampling_keeps_the_target_distribution(tiny, joint, rule):
    samples, accepted = speculative_samples(tiny, rule)
    assert len(set(samples)) > 10  # a real distribution, not one sequence
    assert 0.2 * RUNS < accepted < 1.5 * RUNS  # drafts were right often, and wrong often
    p = first_positions_p(samples, joint)
    assert p > 1e-3, f"speculative samples do not follow the target distribution (p = {p:.2e})"


def head_samples(tiny, runs: int = RUNS) -> tuple[list[tuple[int, ...]], int]:
    """As `speculative_samples`, drafting two tokens every step from a draft head (`HeadDrafter`) that reads the
    features of the verified positions, as a session does. Its draft vocabulary is the model's likely tokens
    after the prompt, so that its drafts are accepted often enough to matter."""
    from infemeral.speculation.head.drafter import DraftHead
    from infemeral.speculation.head.model import HeadModel, layer_config

    model, client, server = tiny
    likely = top3(model, [])
    ids = sorted(set(likely + [t for x in likely for t in top3(model, [x])]))
    torch.manual_seed(1)
    head = DraftHead(HeadModel(layer_config(model.config)), client, draft_ids=torch.tensor(ids))
    ccache, scache = client.new_cache(), server.new_cache()
    prompt_features = client.features(server(client.cloak(PROMPT[:-1], ccache), scache))
    base = ccache.length
    samples, accepted = [], 0
    for run in range(runs):
        sampler = Sampler(SamplingParams(seed=run, **PARAMS))
        drafter = head.fork()
        drafter.observe(PROMPT[:-1], prompt_features)
        context, last, tokens = list(PROMPT[:-1]), PROMPT[-1], []
        while len(tokens) < 3:
            step = context + [last]
            drafts = drafter.propose(step, 2)
            features = client.features(server(client.cloak([last] + drafts, ccache), scache))
            new = accept_drafts(sampler, client.project(features), step, drafts)
            accepted += len(new) - 1
            for cache in (ccache, scache):
                cache.truncate(len(drafts) - (len(new) - 1))
            drafter.observe(step + new[:-1], features[:len(new)])
            context, last, tokens = step + new[:-1], new[-1], tokens + new
        samples.append(tuple(tokens[:3]))
        for cache in (ccache, scache):
            cache.truncate(cache.length - base)
    return samples, accepted


def test_drafts_from_a_draft_head_keep_the_target_distribution(tiny, joint):
    samples, accepted = head_samples(tiny)
    assert len(set(samples)) > 10
    assert accepted > 0.1 * RUNS  # the head's drafts were right often enough to matter
    p = first_positions_p(samples, joint)
    assert p > 1e-3, f"samples with a draft head do not follow the target distribution (p = {p:.2e})"


@pytest.mark.parametrize("rule", [always_accept, point_mass_rule(remove_rejected=False), stale_context],
                         ids=["always-accept", "no-removal", "stale-context"])
def test_the_statistical_test_catches_wrong_rules(tiny, joint, rule):
    p = first_positions_p(speculative_samples(tiny, rule)[0], joint)
    assert p < 1e-5, f"a wrong acceptance rule passed the test (p = {p:.2e})"


# -- the same test for draft trees ----------------------------------------------------------------------------

TREE_PARENTS = [-1, 0, 0, 0, 1, 2]  # the step's token; three candidates; one more under each of the first two


def tree_samples(tiny, rule, runs: int = RUNS) -> tuple[list[tuple[int, ...]], int]:
    """As `speculative_samples`, each run's first step carrying a draft tree (three candidates for the first
    position, the model's likely tokens and a stray one, in random order, and one candidate after each of the
    first two) through both halves with the tree mask; the accepted path is kept in both caches
    (`keep_positions`), the other rows dropped, and later steps carry no drafts."""
    model, client, server = tiny
    ccache, scache = client.new_cache(), server.new_cache()
    client.logits(server(client.cloak(PROMPT[:-1], ccache), scache))
    base = ccache.length
    likely = {(): top3(model, [])}

    def candidates(rng, prefix):
        key = tuple(prefix)
        if key not in likely:
            likely[key] = top3(model, prefix)
        options = likely[key][:2] + [31]
        rng.shuffle(options)
        return options

    samples, accepted = [], 0
    for run in range(runs):
        sampler, rng = Sampler(SamplingParams(seed=run, **PARAMS)), random.Random(20_000 + run)
        first = candidates(rng, [])
        tokens = [PROMPT[-1]] + first + [candidates(rng, [first[0]])[0], candidates(rng, [first[1]])[0]]
        rows = client.logits(server(client.cloak(tokens, ccache, TREE_PARENTS), scache, TREE_PARENTS))
        new, path = rule(sampler, rows, list(PROMPT), tokens, TREE_PARENTS)
        accepted += len(new) - 1
        for cache in (ccache, scache):
            cache.keep_positions(base, path)
        while len(new) < 3:
            new += accept_drafts(sampler, client.logits(server(client.cloak([new[-1]], ccache), scache)),
                                 list(PROMPT) + new, [])
        samples.append(tuple(new[:3]))
        for cache in (ccache, scache):
            cache.truncate(cache.length - base)
    return samples, accepted


def first_child_rule(sampler, logits, context, tokens, parents):
    """Wrong: a node with children always descends into its first child (drawing nothing there)."""
    context, out, rows, row = list(context), [], [0], 0
    while True:
        children = [i for i, p in enumerate(parents) if p == row]
        if not children:
            out.append(sampler(logits[row], context))
            return out, rows
        row = children[0]
        out.append(tokens[row])
        context.append(tokens[row])
        rows.append(row)


def wrong_branch_rule(sampler, logits, context, tokens, parents):
    """Wrong: the draw is kept, but the walk goes on from the first child's row whichever child it matched (the
    next position reads logits after the wrong token)."""
    children = [i for i, p in enumerate(parents) if p == 0]
    token = sampler(logits[0], list(context))
    if token not in [tokens[c] for c in children]:
        return [token], [0]
    row = children[0]
    return [token, sampler(logits[row], list(context) + [token])], [0, row]


def test_draft_trees_keep_the_target_distribution(tiny, joint):
    samples, accepted = tree_samples(tiny, accept_tree)
    assert len(set(samples)) > 10
    assert 0.5 * RUNS < accepted  # the likely candidates were accepted often, often past the first position
    p = first_positions_p(samples, joint)
    assert p > 1e-3, f"samples with draft trees do not follow the target distribution (p = {p:.2e})"


@pytest.mark.parametrize("rule", [first_child_rule, wrong_branch_rule], ids=["first-child", "wrong-branch"])
def test_the_statistical_test_catches_wrong_tree_rules(tiny, joint, rule):
    p = first_positions_p(tree_samples(tiny, rule)[0], joint)
    assert p < 1e-5, f"a wrong tree acceptance rule passed the test (p = {p:.2e})"


def test_seeded_tree_sampling_gives_the_chain_tokens(tiny):
    """One draw per position, in order: a fixed seed gives the same tokens with a tree as with no drafts."""
    trees = tree_samples(tiny, accept_tree, runs=40)[0]
    plain = [tuple(s) for s in speculative_samples(tiny, lambda sampler, rows, context, drafts: accept_drafts(
        sampler, rows[:1], context, []), runs=40)[0]]
    assert trees == plain


def test_seeded_speculative_sampling_reproduces(tiny):
    assert speculative_samples(tiny, accept_drafts, runs=40) == speculative_samples(tiny, accept_drafts, runs=40)


# -- the adaptive draft length -------------------------------------------------------------------------------

def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 8) == 9


def test_draft_length_grows_while_drafts_are_accepted():
    k = DraftLength(max_draft=8)
    first = k.choose()
    assert 0 < first < 8
    for _ in range(10):
        drafted = k.choose()
        k.update(drafted, drafted)
    assert k.choose() == 8


def test_draft_length_falls_to_zero_when_drafts_keep_failing_and_comes_back():
    k = DraftLength(max_draft=8)
    for _ in range(10):
        k.update(max(k.choose(), 1), 0)
    assert k.choose() == 0
    # A free source keeps proposing at k = 0 (not sent); once its guesses are right, k returns.
    for _ in range(10):
        k.shadow(True)
    assert k.choose() > 0


def test_draft_length_probes_a_costly_source_now_and_then():
    k = DraftLength(max_draft=4, probe_every=4)
    for _ in range(10):
        k.update(1, 0)
    choices = [k.choose(is_free=False) for _ in range(12)]
    assert choices.count(1) == 3 and set(choices) == {0, 1}  # every 4th step carries one draft
    k.update(1, 0)  # the probe failed: probes become rarer
    assert [k.choose(is_free=False) for _ in range(8)].count(1) == 1


def test_a_right_probe_that_still_does_not_pay_makes_probes_rarer():
    """A source that is nearly always right but whose draft tokens cost more than they save (the packaged model
    drafting for itself on a local link): each probe is right, yet drafting still does not pay, so probes
    become rarer just as after a wrong one — each one pays the source's cost and a catch-up besides."""
    k = DraftLength(max_draft=4, probe_every=4, acceptance=0.95)
    k.step_time(1, 0.1)
    k.step_time(2, 0.12)
    k.drafted(1, 0.2)  # a draft token costs two steps
    gaps = []
    for _ in range(4):
        steps = 1
        while k.choose(is_free=False) == 0:
            steps += 1
        gaps.append(steps)
        k.update(1, 1)  # the probe's draft was right
    assert gaps == [4, 8, 16, 32]
    for _ in range(20):
        k.drafted(1, 0.001)  # drafting became cheap: it pays again, and is chosen without waiting for a probe
    assert k.choose(is_free=False) > 0


def test_probes_stay_within_their_share_of_the_session_time():
    """A probe that took 0.5 s (a draft model reading the whole prompt first) is not repeated until the session
    has run long enough for all its probes to be 2 % of its time: 50 s here, where the gap alone would allow
    one every 8 steps. A new session starts from what the last probe took, so it waits as long."""
    k = DraftLength(probe_every=8)
    k.step_time(1, 0.1)
    assert k.probe_budget == 0.02
    steps = 0
    while not k.probe():
        k.spent(0.1)
        steps += 1
    assert steps == 7  # the first probe: its cost is not known yet, only the gap counts
    k.probed(0.5)
    k.update(1, 0)
    steps = 0
    while not k.probe():
        k.spent(0.1)
        steps += 1
    assert k.probe_budget * (steps + 7) * 0.1 >= 1.0 > k.probe_budget * (steps + 6) * 0.1  # 1 s of probes in all
    history = SourceHistory()
    history.learn(k)
    again = DraftLength.after(history, k.cost)
    assert again.probe_seconds == 0.5 and not any(again.probe() for _ in range(100))


def test_draft_length_weighs_acceptance_against_the_cost_of_a_longer_step():
    def with_cost(rtt: float, per_token: float) -> DraftLength:
        k = DraftLength(max_draft=8, acceptance=0.3)
        for n in [1, 3, 1, 5, 2, 1, 4, 1] * 4:
            k.step_time(n, rtt + per_token * n)
        return k

    wan, local = with_cost(0.080, 0.002), with_cost(0.0, 0.010)
    assert wan.cost.relative(5) == pytest.approx(0.090 / 0.082, rel=1e-6)
    assert local.cost.relative(5) == pytest.approx(5.0, rel=1e-6)
    assert wan.choose() > 0  # a long round trip: even 30 % acceptance pays
    assert local.choose() == 0  # every extra position costs as much as a step: drafts never pay
    with pytest.raises(ValueError):
        DraftLength(max_draft=-1)


def step_with_a_jump(n: int) -> float:
    """A step over an 80 ms link to a CPU server in float32 (measured on the default model): the second position
    switches every product to a matrix-matrix kernel, later positions cost little."""
    return 0.172 if n == 1 else 0.215 + 0.005 * (n - 2)


def test_the_jump_to_a_second_position_is_not_charged_to_every_position():
    """Timed steps of only 1 and 2 positions (all a source drafting one token at a time shows) must not make
    every extra position look as dear as the second: at 45 % acceptance the jump is worth paying for several
    drafts. Once longer steps are timed, k is the one that is best at their true cost."""
    length = DraftLength(max_draft=8, acceptance=0.45)
    for n in [1, 2] * 10:
        length.step_time(n, step_with_a_jump(n))
    assert length.choose() >= 3
    for n in list(range(1, 10)) * 3:
        length.step_time(n, step_with_a_jump(n))
    rate = lambda k: expected_tokens(0.45, k) * step_with_a_jump(1) / step_with_a_jump(k + 1)  # noqa: E731
    assert length.choose() == max(range(9), key=rate) == 4
    assert length.rate(4) == pytest.approx(rate(4))


def test_the_step_cost_is_learnt_per_step_size_and_shared():
    cost = StepCost(prior=0.1)
    assert cost.relative(9) == pytest.approx(1.8) and cost.one_step() is None  # nothing timed: the prior
    cost.add(1, 0.05)
    assert cost.relative(9) == 1.0  # past the largest size timed: as dear as it, until timed
    first, second = DraftLength(cost=cost), DraftLength(cost=cost)  # two sessions of one client
    for n in (1, 9, 1, 9):
        first.step_time(n, 0.05 + 0.005 * (n - 1))
    assert second.cost.relative(9) == pytest.approx(0.09 / 0.05)
    assert second.cost.relative(5) == pytest.approx(0.07 / 0.05)  # between two sizes timed: on the line
    assert second.cost.one_step() == pytest.approx(0.05)


def test_steps_of_a_size_not_taken_lately_fade_out():
    cost = StepCost(decay=0.5, min_weight=0.1)
    cost.add(1, 0.05)
    cost.add(4, 0.2)
    assert cost.is_timed(1) and cost.is_timed(4)
    for _ in range(3):
        cost.add(4, 0.2)  # the one-token step's weight: 0.5 ** 4 < 0.1
    assert not cost.is_timed(1) and cost.one_step() is None
    assert cost.relative(4) == pytest.approx(1.3)  # nothing to weigh against: the prior


def test_draft_length_zero_never_drafts():
    k = DraftLength(max_draft=0)
    k.shadow(True)
    assert k.choose() == 0
