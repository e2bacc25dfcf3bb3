"""Draft trees: the tree's shape checks, its attention on both halves (the laptop's plain layers, the server's
transformers layers over a contiguous cache and over the page pool), keeping the accepted path in both caches,
the acceptance walk, and the proposal and size a draft head and the controller choose.

Every check of attention is against the plain rule it must equal: each branch of a tree run as a chain of its
own gives the rows of that branch."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from infemeral.client.sampling import Sampler, SamplingParams
from infemeral.errors import InvalidArgument
from infemeral.kvcache.cache import KVCache
from infemeral.layers import draft_tree
from infemeral.layers.stack import LayerStack
from infemeral.speculation.acceptance import accept_drafts, accept_tree
from infemeral.speculation.step_cost import StepCost
from infemeral.speculation.tree import TreeDraft, TreeSize

TREE = [-1, 0, 0, 1, 1, 2, 3]  # root; two children; the first has two; a grandchild below each of those
#        0  1  2  3  4  5  6


def tiny_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=40, max_position_embeddings=128)


@pytest.fixture(scope="module")
def stacks():
    """The same two random layers as the laptop runs them (plain) and as the server does (transformers')."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = tiny_config()
    torch.manual_seed(0)
    weights = []
    for i in range(2):
        layer = LlamaDecoderLayer(config, i)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.2)
        weights.append({k: v.detach().clone() for k, v in layer.state_dict().items()})
    return {plain: LayerStack(config, 0, weights, plain=plain) for plain in (True, False)}


# -- the tree's shape ------------------------------------------------------------------------------------

def test_depths_masks_and_paths():
    assert draft_tree.depths(TREE) == [0, 1, 1, 2, 2, 2, 3]
    mask = draft_tree.ancestor_mask(TREE)
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert mask[5].nonzero().flatten().tolist() == [0, 2, 5]
    full = draft_tree.tree_attention_mask(TREE, 3)
    assert full.shape == (7, 10) and bool(full[:, :3].all()) and torch.equal(full[:, 3:], mask)
    assert draft_tree.path_to(TREE, 6) == [0, 1, 3, 6]
    assert draft_tree.is_chain(draft_tree.chain_parents(4)) and not draft_tree.is_chain(TREE)
    assert draft_tree.tree_positions(TREE, 10).tolist() == [[10, 11, 11, 12, 12, 12, 13]]


@pytest.mark.parametrize("parents, rows, message", [
    ([-1, 0], 3, "one parent per row"),
    ([0, 0, 1], 3, "first row is its root"),
    ([-1, 1, 0], 3, r"parents\[1\] = 1"),
    ([-1, 0, 5], 3, r"parents\[2\] = 5"),
    ([-1, 0, -1], 3, r"parents\[2\] = -1"),
    (list(range(-1, 70)), 71, "deep"),
])
def test_malformed_trees_are_refused_with_what_is_wrong(parents, rows, message):
    with pytest.raises(InvalidArgument, match=message):
        draft_tree.check_parents(parents, rows)


# -- attention over a tree equals each branch as a chain -----------------------------------------------------

def branch_rows(stack: LayerStack, prefix: torch.Tensor, rows: torch.Tensor, parents: list[int]) -> torch.Tensor:
    """Each row's output computed as the last position of a chain of its ancestors (a fresh cache each)."""
    out = []
    for i in range(len(parents)):
        cache = stack.new_cache()
        stack(prefix, cache)
        out.append(stack(rows[draft_tree.path_to(parents, i)], cache)[-1])
    return torch.stack(out)


@pytest.mark.parametrize("plain", [True, False], ids=["laptop-plain", "server-transformers"])
def test_a_tree_step_gives_each_branch_its_chain_outputs(stacks, plain):
    stack = stacks[plain]
    torch.manual_seed(1)
    prefix, rows = torch.randn(5, 32), torch.randn(len(TREE), 32)
    cache = stack.new_cache()
    stack(prefix, cache)
    got = stack(rows, cache, TREE)
    torch.testing.assert_close(got, branch_rows(stack, prefix, rows, TREE), rtol=1e-5, atol=1e-5)
    assert cache.length == 5 + len(TREE)


def test_the_paged_torch_backend_masks_a_tree_as_the_contiguous_cache_does(stacks):
    """A batch of a tree step, a chain step and a prefill on the page pool: each sequence's rows equal the
    contiguous reference, the tree's equal its branches' chains."""
    from infemeral.kvcache.paged import KVPages, PagedBatch, PagedSequence, PagePool
    from infemeral.layers.attention_backends.torch_backend import TorchBackend

    stack = stacks[False]
    torch.manual_seed(2)
    pool, kv = PagePool(32, 4), KVPages(32, 4, 0, 2, 2, 8, torch.float32)
    prefixes = [torch.randn(n, 32) for n in (6, 3, 1)]
    sequences = [PagedSequence(pool, kv) for _ in prefixes]
    backend = TorchBackend()
    for seq, prefix in zip(sequences, prefixes):
        seq.reserve(prefix.shape[0])
        stack.forward_batch(prefix, PagedBatch(kv, [seq], [prefix.shape[0]], backend))
    steps = [torch.randn(len(TREE), 32), torch.randn(3, 32), torch.randn(5, 32)]
    for seq, step in zip(sequences, steps):
        seq.reserve(seq.length + step.shape[0])
    out = stack.forward_batch(torch.cat(steps), PagedBatch(kv, sequences, [s.shape[0] for s in steps], backend,
                                                           [TREE, None, None]))
    tree_out, chain_out, prefill_out = out.split([s.shape[0] for s in steps])
    torch.testing.assert_close(tree_out, branch_rows(stack, prefixes[0], steps[0], TREE), rtol=1e-5, atol=1e-5)
    for prefix, step, got in ((prefixes[1], steps[1], chain_out), (prefixes[2], steps[2], prefill_out)):
        cache = stack.new_cache()
        stack(prefix, cache)
        torch.testing.assert_close(got, stack(step, cache), rtol=1e-5, atol=1e-5)


# -- keeping the accepted path ----------------------------------------------------------------------------

def filled_cache(length: int) -> KVCache:
    cache = KVCache(0, 2, 2, 4, torch.float32, capacity=4)
    for slot in range(2):
        values = torch.arange(length, dtype=torch.float32)[None, :, None].expand(2, length, 4) + 100 * slot
        cache.load_layer(slot, values, -values)
    cache.set_length(length)
    return cache


def test_keep_positions_moves_the_path_down_and_drops_the_rest():
    cache = filled_cache(12)
    cache.committed_length = 5
    cache.keep_positions(5, [0, 2, 3, 6])  # a tree of 7 rows from position 5; its path is rows 0, 2, 3, 6
    assert cache.length == 9 and cache.committed_length == 5
    for slot in range(2):
        keys, values = cache.layer_tensors(slot)
        expected = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 11], dtype=torch.float32) + 100 * slot
        assert torch.equal(keys[0, :, 0], expected) and torch.equal(values[0, :, 0], -expected)
    with pytest.raises(ValueError, match="ascend"):
        cache.keep_positions(5, [1, 0])


def test_paged_keep_positions_moves_the_path_and_frees_pages():
    from infemeral.kvcache.paged import KVPages, PagedSequence, PagePool

    pool, kv = PagePool(8, 4), KVPages(8, 4, 0, 2, 2, 4, torch.float32)
    seq = PagedSequence(pool, kv)
    reference = filled_cache(14)
    for slot in range(2):
        seq.load_layer(slot, *reference.layer_tensors(slot))
    seq.set_length(14)
    assert len(seq.pages) == 4
    reference.keep_positions(4, [0, 1, 5, 6, 9])
    seq.keep_positions(4, [0, 1, 5, 6, 9])
    assert seq.length == reference.length == 9 and len(seq.pages) == 3 and pool.free_pages == 5
    for slot in range(2):
        for x, y in zip(seq.layer_tensors(slot), reference.layer_tensors(slot)):
            assert torch.equal(x, y)


# -- acceptance --------------------------------------------------------------------------------------------

def peaked(best: list[int], vocab: int = 8) -> torch.Tensor:
    rows = torch.full((len(best), vocab), -5.0)
    for i, b in enumerate(best):
        rows[i, b] = 5.0
    return rows


def test_accept_tree_walks_the_children_the_draws_pick():
    greedy = Sampler(SamplingParams())
    tokens = [0, 3, 2, 4, 5, 1, 6]  # rows of TREE: 1 and 2 under the root, 3 and 4 under 1, 5 under 2, 6 under 3
    # the root's draw is 2 (row 2), row 2's draw is 1 (row 5), row 5's draw is 7: no child, the walk ends
    assert accept_tree(greedy, peaked([2, 0, 1, 0, 0, 7, 0]), [0], tokens, TREE) == ([2, 1, 7], [0, 2, 5])
    # through the deep branch: 3 (row 1), 4 (row 3), 6 (row 6), then row 6's own token
    assert accept_tree(greedy, peaked([3, 4, 0, 6, 0, 0, 2]), [0], tokens, TREE) == ([3, 4, 6, 2], [0, 1, 3, 6])
    assert accept_tree(greedy, peaked([7, 0, 0, 0, 0, 0, 0]), [0], tokens, TREE) == ([7], [0])
    with pytest.raises(ValueError, match="7 rows"):
        accept_tree(greedy, peaked([0] * 6), [0], tokens, TREE)


def test_a_chain_shaped_tree_accepts_as_accept_drafts_does():
    greedy = Sampler(SamplingParams(repetition_penalty=1.3))
    rows = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    drafts = [int(rows[0].argmax()), int(rows[1].argmax()), 5]
    new, path = accept_tree(greedy, rows, [0], [0] + drafts, draft_tree.chain_parents(4))
    assert new == accept_drafts(greedy, rows, [0], drafts) and path == list(range(len(new)))


# -- the proposal and its size --------------------------------------------------------------------------------

def test_best_nodes_form_a_tree_in_order():
    tree = TreeDraft(tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 0, 1], probs=[0.6, 0.3, 0.3, 0.1, 0.25])
    best = tree.best(3)
    assert best.tokens == [10, 11, 12] and best.parents == [-1, -1, 0]  # the tie 0.3/0.3: the shallower first
    assert best.step_parents() == [-1, 0, 0, 1] and best.depth == 2
    assert tree.best(0).tokens == []


def test_matching_follows_the_one_path_that_spells_the_tokens():
    """Children hold distinct tokens, so the tokens the model decodes pick one path; it stops at the first token
    no child holds, whatever deeper nodes hold."""
    tree = TreeDraft(tokens=[5, 6, 7, 8, 7, 9], parents=[-1, -1, 0, 1, 1, 4], probs=[0.5, 0.4, 0.3, 0.2, 0.2, 0.1])
    assert tree.matching([6, 7, 9, 1]) == 3  # root 6 -> its child 7 -> 9: the second branch, not 5's child 7
    assert tree.matching([5, 7, 9]) == 2     # 5's 7 has no child 9
    assert tree.matching([7, 9]) == 0        # 7 is no first-level node
    assert tree.matching([]) == 0 and TreeDraft([], [], []).matching([5]) == 0


def test_the_held_out_measure_keeps_what_a_tree_verification_keeps():
    """Stepping through an answer with trees: a step keeps the tree's path that agrees with the answer, then the
    model's token, and the next starts after them. This drafter's trees hold the answer's next token on the second
    branch only (a chain, the first branch, is always wrong) and the one after it beneath."""
    from types import SimpleNamespace

    from infemeral.speculation.head.data import TrainingData
    from infemeral.speculation.head.measure import measure

    calls = []

    class SecondBranch:
        def observe(self, ids, features):
            pass

        def propose(self, ids, k):
            return [-1] * k  # the first branch: wrong

        def propose_tree(self, ids, nodes, depth):
            calls.append((len(ids), nodes, depth))
            n = len(ids)  # the token at position i is i: the answer goes on with n, n + 1, ...
            return TreeDraft(tokens=[-1, n, n + 1], parents=[-1, -1, 1], probs=[0.6, 0.3, 0.2])

    head = SimpleNamespace(vocab=SimpleNamespace(target_ids=None), fork=SecondBranch)
    ids = torch.arange(41)
    data = TrainingData([ids], [ids.float()[:, None]], [10])  # answer positions 10..40: 30 to step through
    first, per_step, _ = measure(head, data, 2, progress=False, tree_nodes=3)
    # 10 steps of 3 tokens (2 kept drafts + the model's): 10 -> 13 -> ... -> 40
    assert per_step == pytest.approx(3.0) and len(calls) == 10 and first == 0.0  # the likeliest first node is wrong
    assert calls[0] == (11, 3, 2) and [c[0] for c in calls] == list(range(11, 41, 3))
    first, per_step, _ = measure(head, data, 2, progress=False)  # chains: nothing kept
    assert per_step == 1.0 and first == 0.0


def test_tree_size_grows_where_positions_are_cheap_and_stays_small_where_they_are_dear():
    tree = TreeDraft(tokens=list(range(12)), parents=[-1] * 4 + [0] * 4 + [1] * 4,
                     probs=[0.5, 0.2, 0.1, 0.05] + [0.3, 0.1, 0.05, 0.02] + [0.1, 0.05, 0.02, 0.01])
    gpu, cpu = StepCost(), StepCost()
    for n, gpu_t, cpu_t in ((1, 0.100, 0.172), (2, 0.101, 0.215), (5, 0.101, 0.238), (9, 0.102, 0.261),
                            (16, 0.103, 0.300), (64, 0.105, 0.600)):
        gpu.add(n, gpu_t)
        cpu.add(n, cpu_t)
    on_gpu, on_cpu = TreeSize(gpu).choose(tree, 63), TreeSize(cpu).choose(tree, 63)
    assert on_gpu >= 10 and 0 < on_cpu <= 6  # a 7-position CPU step costs 1.45 plain ones: only the likeliest pay
    assert TreeSize(gpu).choose(tree, 5) == 5  # never past the room the window leaves
    size = TreeSize(cpu)
    for _ in range(20):
        size.update(expected=1.5, accepted=0)  # the head's confidence never came true: nothing pays
    assert size.calibration < 0.2 and size.choose(tree, 63) == 0


# -- a server that verifies chains only ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_split(reference, tmp_path_factory):
    """A tiny random Llama with the packaged model's tokenizer (it comes with `reference`, which the suite loads
    anyway), its bundles and a random draft head for it."""
    from transformers import AutoModelForCausalLM

    from infemeral.cloak.prepare import prepare
    from infemeral.cloak.sources import ModelSource
    from infemeral.speculation.head.model import HeadModel, layer_config

    tokenizer = reference[1]
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out = prepare(output=tmp_path_factory.mktemp("tiny-split"), source=ModelSource(model, tokenizer), progress=False)
    return out, HeadModel(layer_config(config))


@pytest.mark.parametrize("server_trees", [True, False], ids=["trees", "chains-only"])
def test_the_client_sends_chains_to_a_server_that_verifies_chains_only(tiny_split, tmp_path, monkeypatch,
                                                                       server_trees):
    """A head that would send trees every step (depth and size forced) sends them where ServerInfo.draft_trees
    is true, and chains where it is false (as a FlashInfer server says until its tree case passed), which such
    a server verifies: the same tokens as speculation off."""
    from tests.conftest import start_server
    from infemeral.client.client import Client
    from infemeral.client.turn_link import TurnLink
    from infemeral.layers.attention_backends.torch_backend import TorchBackend
    from infemeral.speculation.draft_length import DraftLength
    from infemeral.speculation.head.drafter import DraftHead

    out, module = tiny_split
    monkeypatch.setattr(TorchBackend, "draft_trees", server_trees)
    monkeypatch.setattr(TreeSize, "choose", lambda self, tree, limit, chain=(), chain_yield=0.0: limit)
    monkeypatch.setattr(DraftLength, "choose", lambda self, is_free=True: 3)
    sent = []  # each decode step's parents (None: a chain)
    step = TurnLink.step
    monkeypatch.setattr(TurnLink, "step", lambda link, ids, *a, parents=None, **k: (
        sent.append(parents), step(link, ids, *a, parents=parents, **k))[1])
    srv = start_server(out, tmp_path / "store")
    try:
        with Client(f"127.0.0.1:{srv.port}", out.client_dir, timeout=60) as client:
            client.draft_head = DraftHead(module, client.model)
            assert client.server_info().draft_trees is server_trees
            prompt = list(range(100, 140))
            on = client.new_session().complete(prompt, SamplingParams(max_new_tokens=12, speculate="head"))
            off = client.new_session().complete(prompt, SamplingParams(max_new_tokens=12, speculate="off"))
    finally:
        srv.stop(0)
    assert on.token_ids == off.token_ids and on.drafted_tokens > 0
    trees = [p for p in sent if p is not None]
    assert bool(trees) is server_trees  # a tree went out only where the server takes them
