"""The console scripts as a user runs them: a real server process, real CLI processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import free_port, spawn_server
from infemeral.client.sampling import SamplingParams

pytestmark = pytest.mark.slow


def run_cli(*args, env=None, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "infemeral.cli", *map(str, args)], input=stdin,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def server_process(bundles, tmp_path_factory):
    port = free_port()
    proc = spawn_server(bundles.server_dir, tmp_path_factory.mktemp("cli-store"), port)
    yield f"127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.fixture
def cli_env(bundles, server_process, tmp_path):
    # Configuration by environment variables, as on a laptop.
    return dict(os.environ, INFEMERAL_SERVER=server_process, INFEMERAL_CLIENT_BUNDLE=str(bundles.client_dir),
                INFEMERAL_SESSIONS_DIR=str(tmp_path / "sessions"), INFEMERAL_ANSWER_INDEX_DIR=str(tmp_path / "answers"))


def test_help_explains_commands():
    out = run_cli("--help").stdout
    for command in ("prepare", "generate", "chat", "info", "audit", "delete", "forget-answers", "serve"):
        assert command in out
    gen = run_cli("generate", "--help").stdout
    assert "INFEMERAL_TEMPERATURE" in gen and "--max-new-tokens" in gen
    assert "--speculate {auto,ngram,draft,head,off}" in gen and "--max-draft" in gen and "--draft-model" in gen
    assert "--draft-head" in gen and "train-drafter" in out
    assert "--no-answer-index" in gen


def test_generate_streams_the_greedy_answer(cli_env, client):
    question = "Name a primary colour."
    expected = client.new_session().chat(question, SamplingParams(max_new_tokens=20)).text
    proc = run_cli("generate", question, "--max-new-tokens", 20, "--greedy", "--verbose", env=cli_env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected.strip()
    assert "tokens/s" in proc.stderr and "first token" in proc.stderr and "tokens per round trip" in proc.stderr


def test_speculation_flags_and_the_answer_index(cli_env, tmp_path):
    passage = ("The lighthouse keeper climbed the spiral stairs every evening at six. He trimmed the wick, "
               "polished the great lens until it shone, and wrote the weather in a leather book.")
    question = f"Repeat the following passage exactly, word for word:\n\n{passage}"
    off = run_cli("generate", question, "--max-new-tokens", 24, "--speculate", "off", "--greedy", "--verbose",
                  env=cli_env)
    on = run_cli("generate", question, "--max-new-tokens", 24, "--max-draft", 4, "--greedy", "--verbose", env=cli_env)
    assert off.returncode == 0 and on.returncode == 0, off.stderr + on.stderr
    assert on.stdout == off.stdout  # the same answer, in fewer round trips
    per_trip = [float(re.search(r"([\d.]+) tokens per round trip", p.stderr).group(1)) for p in (off, on)]
    assert per_trip[0] <= 1.0 < 2.0 < per_trip[1]
    assert "drafts accepted" not in off.stderr and "drafts accepted" in on.stderr
    # The answers went into an owner-only index (speculation off keeps nothing), which forget-answers clears.
    files = list((tmp_path / "answers").glob("*.tokens"))
    assert len(files) == 1 and (files[0].stat().st_mode & 0o777) == 0o600
    generated = int(re.search(r"(\d+) generated", on.stderr).group(1))
    assert files[0].stat().st_size == 4 * (generated + 1)  # the answer's tokens and a separator, as int32
    forget = run_cli("forget-answers", env=cli_env)
    assert forget.returncode == 0 and "forgot 1 answer index file" in forget.stdout
    assert not files[0].exists()
    assert run_cli("generate", "Hi", "--max-new-tokens", 2, "--no-answer-index", env=cli_env).returncode == 0
    assert not list((tmp_path / "answers").glob("*.tokens"))


def test_bad_speculation_flags_are_refused(cli_env, tmp_path):
    proc = run_cli("generate", "hi", "--speculate", "draft", env=cli_env)
    assert proc.returncode == 2 and "--draft-model" in proc.stderr
    proc = run_cli("generate", "hi", "--speculate", "sometimes", env=cli_env)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    proc = run_cli("generate", "hi", "--speculate", "draft", "--draft-model", tmp_path / "nowhere", env=cli_env)
    assert proc.returncode == 2 and "draft model not found" in proc.stderr
    proc = run_cli("generate", "hi", "--speculate", "head", env=cli_env)
    assert proc.returncode == 2 and "--draft-head" in proc.stderr and "train-drafter" in proc.stderr
    proc = run_cli("generate", "hi", "--speculate", "head", "--draft-head", tmp_path / "nowhere", env=cli_env)
    assert proc.returncode == 2 and "draft head not found" in proc.stderr
    proc = run_cli("train-drafter", "--minutes", 0, "--output", tmp_path / "head", env=cli_env)
    assert proc.returncode == 2 and "--minutes must be above 0" in proc.stderr
    proc = run_cli("train-drafter", "--unroll", 0, "--output", tmp_path / "head", env=cli_env)
    assert proc.returncode == 2 and "--unroll must be at least 1" in proc.stderr


def test_auto_finds_the_draft_head_train_drafter_wrote_beside_the_bundle(tmp_path):
    from infemeral.cli.commands import DRAFT_HEAD_DIR, draft_head_path
    from infemeral.client.settings import ClientSettings

    bundle = tmp_path / "client"
    assert draft_head_path(ClientSettings(client_bundle=bundle)) is None  # nothing there: lookup alone
    (tmp_path / DRAFT_HEAD_DIR).mkdir()
    (tmp_path / DRAFT_HEAD_DIR / "config.json").write_text("{}")
    assert draft_head_path(ClientSettings(client_bundle=bundle)) == tmp_path / DRAFT_HEAD_DIR
    assert draft_head_path(ClientSettings(client_bundle=bundle, speculate="ngram")) is None
    given = tmp_path / "mine"
    assert draft_head_path(ClientSettings(client_bundle=bundle, speculate="head", draft_head=given)) == given


def test_info_reports_matching_bundle(cli_env):
    proc = run_cli("info", env=cli_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hidden size 576" in proc.stdout
    assert "matches server bundle: yes" in proc.stdout and "laptop half" not in proc.stdout  # no model loaded
    proc = run_cli("info", "--laptop-half", env=cli_env)
    assert "laptop half: float32 on " in proc.stdout and "float32 weights" in proc.stdout  # the exact default


def test_info_shows_the_laptop_half_as_configured(cli_env):
    env = dict(cli_env, INFEMERAL_CLIENT_QUANT="int8", INFEMERAL_CLIENT_DEVICE="cpu")
    proc = run_cli("info", "--laptop-half", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "laptop half: bfloat16 on cpu, int8 weights" in proc.stdout
    bad = run_cli("info", "--client-dtype", "float64", env=cli_env)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_chat_session_resumes_across_processes(cli_env, tmp_path):
    first = run_cli("chat", "--session", "trip", "--max-new-tokens", 16, env=cli_env,
                    stdin="My name is Ada. Remember it.\n")
    assert first.returncode == 0, first.stderr
    saved = tmp_path / "sessions" / "trip.session"
    assert saved.exists() and (saved.stat().st_mode & 0o777) == 0o600
    second = run_cli("chat", "--session", "trip", "--max-new-tokens", 16, env=cli_env,
                     stdin="What is my name?\n")
    assert second.returncode == 0, second.stderr
    assert "resumed session 'trip' (2 messages)" in second.stderr
    deleted = run_cli("delete", "--session", "trip", env=cli_env)
    assert deleted.returncode == 0, deleted.stderr
    assert not saved.exists()


def test_wrong_bundle_gives_an_actionable_error(cli_env, tmp_path):
    env = dict(cli_env, INFEMERAL_CLIENT_BUNDLE=str(tmp_path / "nowhere"))
    proc = run_cli("generate", "hi", env=env)
    assert proc.returncode == 2
    assert "not an infemeral bundle" in proc.stderr and "prepare" in proc.stderr


def tiny_draft_model(directory, tokenizer_dir):
    """A one-layer random Llama with the served model's tokenizer, saved as a user's draft model directory:
    loading and running it goes through the same transformers code as a real one, in a fraction of the time."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, directory / f.name)
    return directory


def test_a_draft_model_prints_nothing_into_the_answer(cli_env, client, bundles, tmp_path):
    # Loading the draft model and running it once printed progress bars and a '[transformers] … deprecated' line
    # into the streamed answer; stdout holds the answer alone, stderr nothing at the default level.
    question = "Complete: The quick brown fox"
    draft = tiny_draft_model(tmp_path / "draft", bundles.client_dir / "tokenizer")
    drafted = run_cli("generate", question, "--max-new-tokens", 6, "--greedy", "--speculate", "draft",
                      "--draft-model", draft, env=cli_env)
    assert drafted.returncode == 0, drafted.stderr
    expected = client.new_session().chat(question, SamplingParams(max_new_tokens=6)).text
    assert drafted.stdout.strip() == expected.strip() and expected.strip()
    assert drafted.stderr == "", drafted.stderr
