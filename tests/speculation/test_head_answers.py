"""A draft head's training data through the split system (`train-drafter --server`): the same conversations and
features as the model answering here, from several turns in flight, and nothing left on the pod.

A tiny random Llama with the packaged model's tokenizer (it has a chat template), its bundles served in-process
in float32 with small steps, so that every prompt goes up in several steps and its features come from all of
them.
"""

from __future__ import annotations

import stat

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.conftest import start_server
from infemeral.client.client import Client
from infemeral.client.head_answers import FeatureRecorder, PodAnswers
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.speculation.head.data import LocalAnswers, training_data
from infemeral.speculation.head.prompts import chat_prompts
from infemeral.speculation.head.settings import TrainSettings

MAX_STEP = 8  # tokens a step may carry: every chat prompt here spans several


@pytest.fixture(scope="module")
def tiny_chat(reference, tmp_path_factory):
    """A tiny random Llama whose end-of-turn token ends some answers early, its bundles and a server for them
    (the packaged model's tokenizer comes with `reference`, which the suite loads anyway)."""
    tokenizer = reference[1]
    torch.manual_seed(3)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": chat_prompts(1, seed=1)[0]}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    answer = model.generate(**prompt, max_new_tokens=6, do_sample=False)[0, -6:].tolist()
    with torch.no_grad():  # the end-of-turn token just above a token the model says: some answers end on it
        model.lm_head.weight[tokenizer.eos_token_id] = 1.01 * model.lm_head.weight[answer[-1]]
    root = tmp_path_factory.mktemp("tiny-chat")
    out = prepare(output=root / "bundles", source=ModelSource(model, tokenizer), progress=False)
    store = root / "store"
    server = start_server(out, store, max_step_tokens=MAX_STEP)
    yield model, tokenizer, out, server, store
    server.stop(0)


def test_the_pods_answers_and_features_are_the_local_paths(tiny_chat, tmp_path):
    model, tokenizer, out, server, store = tiny_chat
    settings = TrainSettings(prompts=5, held_out=0, max_new_tokens=12)
    prompts = chat_prompts(5, seed=1)
    local = training_data(LocalAnswers(model, tokenizer, "tiny", torch.device("cpu"), torch.float32, batch=2),
                          prompts, settings, cache_dir=tmp_path / "local", progress=False)
    with Client(f"127.0.0.1:{server.port}", out.client_dir, timeout=60) as client:
        answers = PodAnswers(client, in_flight=3)
        split = training_data(answers, prompts, settings, cache_dir=tmp_path / "split", progress=False)
        config, embed, head = answers.target_weights()
    assert split.answer_starts == local.answer_starts
    assert all(start > MAX_STEP for start in split.answer_starts)  # every prompt went up in several steps
    lengths = [len(x) - s for x, s in zip(local.ids, local.answer_starts)]
    assert min(lengths) < settings.max_new_tokens - 1 < max(lengths) + 1  # an answer that ended, one that ran out
    for got, want in zip(split.ids, local.ids, strict=True):
        assert got.tolist() == want.tolist()
    for got, want in zip(split.features, local.features, strict=True):
        assert got.shape == want.shape and (got.float() - want.float()).abs().max().item() < 1e-4
    assert split.eos_ids == local.eos_ids
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight) and config.vocab_size == len(tokenizer)
    assert not any(p.is_file() for p in store.rglob("*")), "a training turn left a session on the pod"
    files = sorted((tmp_path / "split").iterdir())  # the features and their index, owner-only, no temporary
    assert [p.suffix for p in files] == [".features", ".safetensors"]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)


def test_a_recorder_keeps_the_verified_positions_in_order():
    recorder = FeatureRecorder().fork()
    rows = torch.arange(10.0)[:, None]
    recorder.observe([0, 1, 2, 3], rows[:4])      # the prompt
    recorder.observe([0, 1, 2, 3, 4], rows[4:5])  # a decode step
    recorder.observe([0, 1, 2, 3, 4, 5, 6], rows[5:7])  # two verified at once
    assert recorder.ids == list(range(7)) and recorder.features[:, 0].tolist() == list(range(7))
    recorder.observe([0, 1, 2, 3, 4, 9], rows[9:10])  # the same position again: the new one holds
    assert recorder.features[:, 0].tolist() == [0, 1, 2, 3, 4, 9]
    with pytest.raises(RuntimeError, match="never observed"):
        recorder.observe(list(range(9)), rows[8:9])
    assert recorder.propose([0, 1], 4) == []


def test_train_drafter_with_server_answers_through_the_pod(monkeypatch, tmp_path):
    """--server (with the connection flags) has the pod answer; without it, the model here does even when
    INFEMERAL_SERVER is set for chat; --model beside --server is refused before anything connects."""
    from infemeral.cli import commands
    from infemeral.cli.main import build_parser
    from infemeral.client import client as client_module, head_answers
    from infemeral.errors import UsageError
    from infemeral.speculation.head import train

    ran, opened = [], []

    class FakeClient:
        @classmethod
        def from_settings(cls, settings):
            opened.append(settings)
            return cls()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(client_module, "Client", FakeClient)
    monkeypatch.setattr(head_answers, "PodAnswers", lambda client, in_flight: ("pod", in_flight))
    monkeypatch.setattr(train, "run", lambda args, answers=None: ran.append((args.model, answers)) or 0)
    monkeypatch.setenv("INFEMERAL_SERVER", "chat.example:50051")
    parse = build_parser().parse_args
    assert commands.train_drafter(parse(["train-drafter", "-o", str(tmp_path)])) == 0
    assert ran.pop() == ("default", None) and not opened
    args = parse(["train-drafter", "-o", str(tmp_path), "--server", "pod.example:50051", "--api-key", "k",
                  "--in-flight", "16"])
    assert commands.train_drafter(args) == 0
    assert ran.pop() == ("served at pod.example:50051", ("pod", 16))
    assert opened[0].server == "pod.example:50051" and opened[0].api_key == "k"
    with pytest.raises(UsageError, match="give one"):
        commands.train_drafter(parse(["train-drafter", "-o", str(tmp_path), "--server", "pod:1", "--model", "x"]))
    assert len(opened) == 1
