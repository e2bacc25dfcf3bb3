"""`train-drafter --server` keeps memory to the turns in flight: once a finished turn's features are written, neither
`PodAnswers` nor the `AnswerWriter` holds them (docs/benchmarks/train_drafter.md measures what is left at the
Llama-3-8B shape). The turns themselves are stubbed: each records random features through a `FeatureRecorder`, as
a session's turn does, so no model or pod is needed."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import torch

from infemeral.client.head_answers import FeatureRecorder, PodAnswers
from infemeral.speculation.head.data import AnswerWriter, read_answers

HIDDEN = 8


def stub_client() -> SimpleNamespace:
    """What `PodAnswers` reads of a client before any turn."""
    return SimpleNamespace(draft_head=None, server_info=lambda: SimpleNamespace(dtype="float32"),
                           bundle=SimpleNamespace(server_fingerprint="sha256:stub"), wire_mode="server",
                           model=SimpleNamespace(dtype=torch.float32))


def test_a_written_turns_features_are_let_go_before_the_next_is_written(tmp_path):
    prompts = [[1, 2, 3 + i % 4] for i in range(24)]
    answers = PodAnswers(stub_client(), in_flight=4)

    def answer_one(prompt_ids, params):  # a turn: its prompt's features, then one per answer token
        recorder = FeatureRecorder().fork()
        recorder.observe(prompt_ids, torch.randn(len(prompt_ids), HIDDEN))
        for token in range(params.max_new_tokens - 1):
            recorder.observe(recorder.ids + [token], torch.randn(1, HIDDEN))
        return recorder.ids, recorder.features

    answers._answer_one = answer_one
    written: list[weakref.ref] = []
    still_held: list[int] = []
    copies: dict[int, torch.Tensor] = {}
    with AnswerWriter(tmp_path / "answers", [len(p) for p in prompts]) as writer:
        def keep(i: int, ids: list[int], features: torch.Tensor) -> None:
            still_held.extend(j for j, ref in enumerate(written) if ref() is not None)
            writer.add(i, ids, features)
            copies[i] = features.clone()
            written.append(weakref.ref(features))

        answers.answer(prompts, max_new_tokens=5, keep=keep, progress=False)
    assert len(written) == len(prompts) and still_held == [], \
        f"features of {len(set(still_held))} written turns were still held when a later one was written"
    data = read_answers(tmp_path / "answers", set())
    assert [len(f) for f in data.features] == [len(p) + 4 for p in prompts]
    assert all(torch.equal(data.features[i], copies[i]) for i in range(len(prompts)))
