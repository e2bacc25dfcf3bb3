"""Speculative decoding end to end on the real model: the same tokens as without it, in fewer round trips.

Greedy output with drafts is token-identical to plain `transformers` and to speculation off: one turn,
a three-turn chat, with the sliding window evicting in the middle of it, with several sessions batched
on the server, with a draft model (good drafts and poor ones, and two sessions drafting at once) and with
the answer index (which never fails a turn); seeded sampling reproduces. The prompts quote passages so
that drafts are really made and accepted.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.support.faults import TurnFault
from tests.conftest import start_server
from infemeral.client.client import Client
from infemeral.client.sampling import SamplingParams
from infemeral.errors import StatusError
from infemeral.kvcache.stored import SessionKeys
from infemeral.speculation.answer_index import AnswerIndex
from infemeral.speculation.draft_model import DraftModel

pytestmark = pytest.mark.slow

N = 24
PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at six. He trimmed the wick, polished the "
    "great lens until it shone, and wrote the weather in a leather book.",
    "To make bread, mix five hundred grams of flour with ten grams of salt and seven grams of dried yeast, add "
    "warm water and knead the dough for ten minutes.",
    "The committee agreed that the library will open an hour earlier on weekdays and that members may borrow up "
    "to six books at once.",
    "Every morning the baker opened the shop at seven, set out the warm loaves in the window, and greeted the "
    "first customers by name.",
]


def copy(passage: str) -> str:
    return f"Repeat the following passage exactly, word for word:\n\n{passage}"


def greedy(params: dict | None = None, **kwargs) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": N, **(params or {}), **kwargs})


def plain_greedy(reference, messages, n: int = N) -> list[int]:
    model, tokenizer = reference
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return [t for t in out[0, len(ids):].tolist() if t not in eos][:n]


def assert_speculated(result) -> None:
    """Drafts were really made and accepted: fewer round trips than tokens."""
    assert result.accepted_drafts > 0 and result.drafted_tokens >= result.accepted_drafts
    assert result.round_trips < result.generated_tokens


def chat_at_once(clients: list[Client], messages: list[str], sampling: SamplingParams,
                 timeout: float = 600) -> list:
    """Each message in a new session of `clients` (taken in turn), all sessions starting their turn at once in
    threads; the results in message order (an error in any thread fails the test)."""
    results, errors = {}, []
    start = threading.Barrier(len(messages))

    def run(i: int) -> None:
        try:
            session = clients[i % len(clients)].new_session()
            start.wait()
            results[i] = session.chat(messages[i], sampling)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(messages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return [results[i] for i in range(len(messages))]


def test_one_turn_is_token_identical_in_fewer_round_trips(reference, client):
    question = copy(PASSAGES[0])
    expected = plain_greedy(reference, [{"role": "user", "content": question}])
    assert len(expected) == N
    on = client.new_session().chat(question, greedy())
    off = client.new_session().chat(question, greedy(speculate="off"))
    assert on.token_ids == off.token_ids == expected
    assert_speculated(on)
    assert off.round_trips == off.generated_tokens and off.drafted_tokens == 0
    assert on.tokens_per_round_trip > 2 and off.tokens_per_round_trip == 1.0


def test_three_turn_chat_is_token_identical(reference, client):
    session, messages, accepted = client.new_session(), [], 0
    for question in (copy(PASSAGES[1]), "Now repeat the same passage once more.", copy(PASSAGES[2])):
        messages.append({"role": "user", "content": question})
        result = session.chat(question, greedy())
        assert result.token_ids == plain_greedy(reference, messages)
        messages.append({"role": "assistant", "content": result.text})
        accepted += result.accepted_drafts
    assert session.version == 3 and accepted > 10


def test_the_window_slides_in_the_middle_of_speculation(bundles, tmp_path):
    """A small window (96 tokens, pages of 16): evictions happen while drafts are verified; both caches
    stay consistent across turns, and the tokens equal speculation off's."""
    srv = start_server(bundles, tmp_path / "store", max_context=96, page_size=16, sink_tokens=4)
    client = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=300)
    try:
        on, off = client.new_session(), client.new_session()
        evicted = accepted = 0
        for passage in PASSAGES[:3]:
            a = on.chat(copy(passage), greedy())
            b = off.chat(copy(passage), greedy(speculate="off"))
            assert a.token_ids == b.token_ids
            assert a.cache_length == b.cache_length <= 96
            evicted, accepted = evicted + a.evicted_tokens, accepted + a.accepted_drafts
        assert evicted > 0 and accepted > 0
        assert on.history_ids == off.history_ids and on.cache.length == off.cache.length
        for slot in range(on.cache.num_layers):  # the client's own layer cache, by content
            for x, y in zip(on.cache.layer_tensors(slot), off.cache.layer_tensors(slot)):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        stored = []
        for session in (on, off):  # the server's committed cache, decrypted from the store, by content
            cache = srv.engine.layers.new_cache()
            srv.engine.persistence.load(session.id, SessionKeys.derive(session.id, session.key), session.version,
                                        cache)
            assert cache.length == session.cache.length
            stored.append(cache)
        for slot in range(stored[0].num_layers):
            for x, y in zip(stored[0].layer_tensors(slot), stored[1].layer_tensors(slot)):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        assert srv.engine.pool.free_pages == srv.engine.pool.num_pages  # truncations and closes freed every page
    finally:
        client.close()
        srv.stop(0)


def test_sessions_speculating_together_get_their_solo_tokens(reference, bundles, tmp_path):
    srv = start_server(bundles, tmp_path / "store")
    clients = [Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=300) for _ in range(2)]
    try:
        solo = [plain_greedy(reference, [{"role": "user", "content": copy(p)}]) for p in PASSAGES]
        results = chat_at_once(clients, [copy(p) for p in PASSAGES], greedy(), timeout=300)
        assert [r.token_ids for r in results] == solo
        for r in results:
            assert_speculated(r)
        assert srv.engine.stats["largest_batch"] >= 2  # verify steps shared forward passes
        assert srv.engine.pool.free_pages == srv.engine.pool.num_pages
    finally:
        for c in clients:
            c.close()
        srv.stop(0)


@pytest.fixture(scope="module")
def tiny_drafter(reference):
    """A tiny random Llama with the default model's tokenizer: a legal draft model that guesses badly."""
    model, tokenizer = reference
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=model.config.vocab_size, max_position_embeddings=2048)
    return DraftModel(AutoModelForCausalLM.from_config(config).eval(), tokenizer, tokenizer)


@pytest.mark.parametrize("drafter", ["self", "tiny"])
def test_a_draft_model_keeps_the_output(reference, server, bundles, tiny_drafter, drafter):
    model, tokenizer = reference
    draft = DraftModel(model, tokenizer, tokenizer) if drafter == "self" else tiny_drafter
    question = "Why is the sky blue?"  # open chat: the conversation holds little to copy
    expected = plain_greedy(reference, [{"role": "user", "content": question}])
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=300, draft_model=draft) as client:
        result = client.new_session().chat(question, greedy(speculate="draft"))
    assert result.token_ids == expected
    assert result.drafted_tokens > 0
    if drafter == "self":  # the model drafting for itself is (nearly) always right
        assert_speculated(result)
        assert result.accepted_drafts >= 0.8 * result.drafted_tokens
    else:  # random guesses are rejected, and the output is still the model's own
        assert result.accepted_drafts < result.drafted_tokens


class RecordingDrafter(DraftModel):
    """A draft model that records every proposal of every fork: (fork, context, max_draft, drafts)."""

    def __init__(self, model, calls: list):
        super().__init__(model)
        self.calls = calls

    def propose(self, context_ids, max_draft):
        drafts = super().propose(context_ids, max_draft)
        self.calls.append((id(self), list(context_ids), max_draft, drafts))
        return drafts


def test_sessions_drafting_at_once_each_draft_alone(reference, server, bundles):
    """Two sessions of one client answer at once in threads with a draft model: nothing fails, every
    draft is what a draft model that saw only that session's conversation proposes, and the tokens are
    speculation off's."""
    model, _ = reference
    questions = ["Why is the sky blue?", "What is the capital of France?"]
    expected = [plain_greedy(reference, [{"role": "user", "content": q}]) for q in questions]
    calls: list = []
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=300,
                draft_model=RecordingDrafter(model, calls)) as client:
        results = chat_at_once([client], questions, greedy(speculate="draft"))
    assert [r.token_ids for r in results] == expected
    assert all(r.drafted_tokens > 0 for r in results)
    alone = DraftModel(model)
    for _, context, max_draft, drafts in calls:
        assert drafts == alone.fork().propose(context, max_draft)
    assert len({fork for fork, *_ in calls}) == len(questions)  # one drafter per session


def test_an_answer_index_that_fails_never_fails_a_committed_turn(server, bundles, caplog):
    class FullDisk(AnswerIndex):
        def add(self, answer_ids):
            raise OSError(28, "No space left on device")

    params = SamplingParams(max_new_tokens=6)
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=300, answer_index=FullDisk()) as client:
        session = client.new_session()
        with caplog.at_level("WARNING", logger="infemeral.client.turn"):
            result = session.chat("Name a river.", params)
        assert session.version == 1 and result.generated_tokens == 6
        assert "answer index could not keep this answer" in caplog.text
        assert session.chat("How long is it?", params).version == 2  # the session carries on


def test_the_answer_index_drafts_from_an_earlier_session(reference, server, bundles, tmp_path):
    question = "Why is the sky blue?"
    expected = plain_greedy(reference, [{"role": "user", "content": question}])
    index = AnswerIndex(tmp_path / "answers.tokens")
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=300, answer_index=index) as client:
        first = client.new_session().chat(question, greedy())
        assert index.num_tokens == len(first.token_ids)  # the committed answer went into the index
        second = client.new_session().chat(question, greedy())  # another session, the same question
    assert first.token_ids == second.token_ids == expected
    assert second.accepted_drafts > first.accepted_drafts and second.round_trips < first.round_trips


@pytest.fixture(scope="module")
def random_head(reference, tmp_path_factory):
    """A draft head for the default model with random weights, in the layout train-drafter writes: it drafts
    (badly), and the output must not depend on how well."""
    from infemeral.speculation.head.checkpoint import probe_of, save_head
    from infemeral.speculation.head.model import HeadModel, layer_config

    model, _ = reference
    torch.manual_seed(0)
    module = HeadModel(layer_config(model.config))
    ids, rows = probe_of(lambda i: model.model.embed_tokens.weight[i].detach(), model.config.vocab_size)
    return save_head(tmp_path_factory.mktemp("head"), module, draft_ids=torch.arange(0, 4096),
                     vocab_size=model.config.vocab_size, probe_ids=ids, probe_rows=rows)


def test_a_draft_head_keeps_the_output(reference, server, bundles, random_head):
    """Greedy output with a draft head (alone, and chosen automatically beside prompt lookup) is speculation
    off's, over two turns of one session (the head's state carries over) and with sampling seeded."""
    questions = ["Why do cats purr?", "And dogs?"]
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=300, draft_head=random_head) as client:
        results = {}
        for speculate in ("off", "head", "auto"):
            session = client.new_session()
            results[speculate] = [session.chat(q, greedy(speculate=speculate)) for q in questions]
        sampled = [client.new_session().chat(questions[0], greedy(dict(temperature=0.8, seed=7), speculate=s))
                   for s in ("off", "head")]
    expected = plain_greedy(reference, [{"role": "user", "content": questions[0]}])
    for speculate, (first, second) in results.items():
        assert first.token_ids == expected, speculate
        assert second.token_ids == results["off"][1].token_ids, speculate
    assert all(r.drafted_tokens > 0 for r in results["head"])
    assert sampled[0].token_ids == sampled[1].token_ids and sampled[1].drafted_tokens > 0


def test_draft_trees_keep_the_output_across_a_window_slide_and_a_reload(bundles, tmp_path, random_head,
                                                                        monkeypatch):
    """Every head step sends a three-level tree of all its drafted nodes (depth and size forced to the most
    the room allows, so trees are really sent whatever the random head believes): over three turns with a 96-token window sliding
    mid-answer, and a session saved and loaded again between turns, the tokens, the caches' lengths and the
    evictions are speculation off's, and the server's pages all come back."""
    from infemeral.client.session import Session
    from infemeral.client.turn_link import TurnLink
    from infemeral.speculation.draft_length import DraftLength
    from infemeral.speculation.tree import TreeSize

    monkeypatch.setattr(TreeSize, "choose", lambda self, tree, limit, chain=(), chain_yield=0.0: limit)
    monkeypatch.setattr(DraftLength, "choose", lambda self, is_free=True: 3)  # three levels every step
    kept_paths = []
    keep_path = TurnLink.keep_path
    monkeypatch.setattr(TurnLink, "keep_path", lambda link, rows: (kept_paths.append(rows), keep_path(link, rows)))
    srv = start_server(bundles, tmp_path / "store", max_context=96, page_size=16, sink_tokens=4)
    client = Client(f"127.0.0.1:{srv.port}", bundles.client_dir, timeout=300, draft_head=random_head)
    try:
        assert client.server_info().draft_trees
        on, off = client.new_session(), client.new_session()
        evicted = 0
        for i, passage in enumerate(PASSAGES[:3]):
            if i == 1:  # the tree session from its file, as a restarted client would have it
                on = Session.load(client, on.save(tmp_path / "on.session"))
            a = on.chat(copy(passage), greedy(speculate="head"))
            b = off.chat(copy(passage), greedy(speculate="off"))
            assert a.token_ids == b.token_ids
            assert a.cache_length == b.cache_length <= 96 and a.evicted_tokens == b.evicted_tokens
            evicted += a.evicted_tokens
        assert evicted > 0 and len(kept_paths) > 10
        assert on.history_ids == off.history_ids
        assert srv.engine.pool.free_pages == srv.engine.pool.num_pages
    finally:
        client.close()
        srv.stop(0)


def test_sessions_drafting_from_one_head_at_once_each_draft_alone(reference, server, bundles, random_head):
    """Two sessions of one client answer at once in threads with one draft head: the tokens are speculation
    off's, each session drafts through a drafter of its own, and replaying what one drafter was told (the
    features it observed, the contexts it drafted for) on a fresh drafter, alone, gives the same drafts."""
    from infemeral.speculation.head.drafter import DraftHead, HeadDrafter

    calls: list = []

    class RecordingDrafter(HeadDrafter):
        def observe(self, context_ids, features):
            calls.append((id(self), "observe", list(context_ids), features.clone()))
            super().observe(context_ids, features)

        def propose(self, context_ids, max_draft):
            drafts = super().propose(context_ids, max_draft)
            calls.append((id(self), "propose", list(context_ids), max_draft, drafts))
            return drafts

    questions = ["Why is the sky blue?", "What is the capital of France?"]
    expected = [plain_greedy(reference, [{"role": "user", "content": q}]) for q in questions]
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=300) as client:
        head = DraftHead.load(random_head, client.model)
        head.fork = lambda: RecordingDrafter(head)
        client.draft_head = head
        results = chat_at_once([client], questions, greedy(speculate="head"))
    assert [r.token_ids for r in results] == expected
    assert all(r.drafted_tokens > 0 for r in results)
    drafters = {c[0] for c in calls}
    assert len(drafters) == len(questions)  # one drafter per session
    for drafter in drafters:
        alone = HeadDrafter(head)
        for _, kind, context, *rest in (c for c in calls if c[0] == drafter):
            if kind == "observe":
                alone.observe(context, rest[0])
            else:
                assert alone.propose(context, rest[0]) == rest[1]


def test_seeded_sampling_reproduces_with_speculation(client):
    params = dict(temperature=0.7, top_p=0.95, seed=1234)
    question = copy(PASSAGES[3])
    a = client.new_session().chat(question, greedy(params))
    b = client.new_session().chat(question, greedy(params))
    off = client.new_session().chat(question, greedy(params, speculate="off"))
    assert a.token_ids == b.token_ids
    assert_speculated(a)
    # Every position takes one draw from the seeded generator, drafts or not: the same sample as without.
    assert a.token_ids == off.token_ids


class _LoseCommitReply(TurnFault):
    """Records each Turn's request kinds; can make the client never hear the `committed` reply."""

    def __init__(self):
        self.kinds: list[list[str]] = []
        self.lose = False

    def on_stream(self) -> None:
        self.kinds.append([])

    def on_request(self, request) -> bool:
        self.kinds[-1].append(request.WhichOneof("kind"))
        return False

    def on_response(self, response) -> bool:
        if response.WhichOneof("kind") == "committed" and self.lose:
            self.lose = False
            return True
        return False


def test_a_lost_commit_with_dropped_drafts_is_settled(client, server, bundles):
    """The answer ends (at a stop string) inside a run of accepted drafts: the positions after it are
    dropped by a Truncate that travels with the commit. The commit's reply is lost; the next turn adopts
    the committed state, and continues exactly as a session that never lost anything."""
    short = SamplingParams(max_new_tokens=N, stop=["spiral"])
    questions = (copy(PASSAGES[0]), "Now repeat the same passage once more.")
    reference = client.new_session()
    expected = [reference.chat(q, short).token_ids for q in questions]
    spy = _LoseCommitReply()
    with Client(f"127.0.0.1:{server.port}", bundles.client_dir, timeout=120, interceptors=[spy]) as c:
        session = c.new_session()
        spy.lose = True
        with pytest.raises(StatusError):
            session.chat(questions[0], short)
        assert spy.kinds[-1][-2:] == ["truncate", "commit"]  # the drafts after the stop went with the commit
        assert session.version == 0 and session.pending_commit is not None
        result = session.chat(questions[1], short)
    assert session.version == 2 and result.token_ids == expected[1]
    assert session.history_ids == reference.history_ids
