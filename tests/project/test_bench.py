"""The benchmark package's contract: every section is complete, targets print in one format, --only is checked."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench import harness, report  # noqa: E402
from bench.sections import ORDER, Result, load  # noqa: E402


def test_every_section_module_has_the_contract():
    for name in ORDER:
        module = load(name)
        assert module.NAME == name
        assert module.TITLE and module.__doc__
        assert callable(module.run) and callable(module.report)


def test_target_lines_have_one_format():
    ok = harness.at_least("context", "float32_decode_ratio", "goal", 0.93, 0.9, "min 0.93x")
    miss = harness.at_least("concurrency", "8_sessions", "goal", 2.1, 3.5, "2.10x")
    nan = harness.at_most("store", "history_independent", "goal", math.nan, 1.25, "nan")
    assert ok.line() == "TARGET context float32_decode_ratio: PASS (min 0.93x)"
    assert miss.line() == "TARGET concurrency 8_sessions: MISS (2.10x)"
    assert nan.line() == "TARGET store history_independent: MISS (nan)"  # no figure is no pass


def test_interleave_alternates_which_side_goes_first():
    calls = []
    base, subj = harness.interleave(3, lambda: calls.append("b") or "b", lambda: calls.append("s") or "s")
    assert calls == ["b", "s", "s", "b", "b", "s"]
    assert base == ["b"] * 3 and subj == ["s"] * 3


def test_repeated_speculation_runs_keep_the_fastest_of_each_mode_and_every_mismatch():
    from bench.sections.speculation import SpecRow, summarise

    def row(mode, tokens_per_second, identical=True):
        return SpecRow("chat", 0, 80, mode, 48, tokens_per_second, 100.0, 48, 0, 0, 1.0, identical)

    rows = [row("off", 5.0), row("ngram", 4.0), row("head", 6.0),  # the first repeat
            row("off", 4.0), row("ngram", 5.5), row("head", 7.5, identical=False)]  # the second
    facts = summarise(rows)
    cell = facts["cells"]["chat/head/80"]
    assert cell["tps_off"] == [5.0] and cell["tps_on"] == [7.5] and cell["mean_speedups"] == 1.5
    assert facts["cells"]["chat/ngram/80"]["mean_speedups"] == 1.1
    assert facts["runs"] == 6 and facts["mismatches"] == ["chat#0/head/80ms"]


def test_results_json_keeps_row_properties_and_drops_nan(tmp_path):
    from bench.sections.context import ContextRow

    row = ContextRow("float32", 128, 50.0, 45.0, 30.0, 2.0, 18.0, 300.0, math.nan)
    doc = report.jsonable(Result("context", "how", [row]))
    assert doc["rows"][0]["decode_ratio"] == 0.9 and doc["rows"][0]["plain_prefill_ms"] is None


def test_cli_refuses_an_unknown_section():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--only", "nonsense"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--only takes" in out.stderr


def test_gpu_check_says_clearly_when_there_is_no_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run scripts/gpu_check.py itself")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no CUDA device" in out.stdout and "RunPod" in out.stdout
    help_text = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--help"], capture_output=True,
                               text=True, timeout=120)
    assert help_text.returncode == 0 and "FlashInfer" in help_text.stdout


def test_the_profile_probe_finds_every_function_it_times_and_puts_them_back():
    """The profile wraps functions by name in the modules a decode step passes through; a function that moved
    must fail here, not half-way through a full benchmark run."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from infemeral.client import turn_link
    from infemeral.client.sampling import Sampler
    from infemeral.server import turn_call

    profile = load("profile")

    class Layers:
        def forward_batch(self, hidden, batch):
            return hidden

    class Engine:
        layers = Layers()

        def submit_step(self, turn, hidden, *args):
            future = Future()
            future.set_result(hidden)
            return future

    model = SimpleNamespace(cloak=lambda ids, cache: ids, logits=lambda hidden: hidden)
    split = SimpleNamespace(client=SimpleNamespace(model=model, tokenizer=SimpleNamespace(decode=lambda ids: "")),
                            engine=Engine())
    before = (turn_link.to_proto, turn_call.from_proto, Sampler.__call__)
    with profile.Probe(split) as probe:
        assert turn_link.to_proto is not before[0] and Sampler.__call__ is not before[2]
        split.engine.submit_step(None, SimpleNamespace(shape=(1, 4)))
        model.cloak([1, 2], None)
    assert probe.records["engine_step"][0][1] == 1 and probe.records["client_cloak"][0][1] == 2
    assert (turn_link.to_proto, turn_call.from_proto, Sampler.__call__) == before
    assert "submit_step" not in vars(split.engine)


def test_prepare_big_times_every_served_layer_from_read_to_written(tmp_path):
    """The per-method section wraps prepare's layer reader and file writer by name: if either moves, the timings
    must come out wrong here, not after a long run at the 8B shape."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    prepare_big = load("prepare_big")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(90)} | {"<unk>": 90}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(tmp_path / "model")
    started = harness.now()
    seconds = prepare_big.timed_prepare(str(tmp_path / "model"), str(tmp_path / "out"), "none", "none")
    assert len(seconds) == 2  # layer 0 is the client's
    assert all(0 < s < harness.now() - started for s in seconds)
    import infemeral.cloak.prepare as P
    assert P.save_file.__module__.startswith("safetensors")  # put back


def test_upload_transport_sends_the_wires_bytes_through_the_rate_and_targets_need_agreement():
    """A stand-in pod behind a 20 Mbit/s link: the 8-bit wire sends half of bfloat16's bytes, no turn beats its
    bytes / rate floor, and a fast wire whose agreement is below the bar does not pass."""
    import torch
    from delay_proxy import DelayProxy

    from bench.sections import upload

    rows = torch.randn(512, 256)
    pod = upload.StandInPod(256)
    try:
        with DelayProxy(f"127.0.0.1:{pod.port}", rtt_ms=0, up_mbit=20) as proxy:
            sent = {w: upload.transport_turn(proxy.address, rows, upload.wire_of(w), 256) for w in upload.WIRES}
    finally:
        pod.close()
    assert sent["bfloat16"][2] > 2 * 512 * 256
    assert 0 < sent["e4m3-up"][2] - sent["e4m3"][2] <= 2 * 12  # its two steps' answer_dtype fields, no more
    assert 0.49 < sent["e4m3"][2] / sent["bfloat16"][2] < 0.52
    names = 2 * (len("float8_e4m3fn") - len("int8"))  # two steps each name their dtype; the data is a byte a value
    assert sent["e4m3"][2] - sent["int8"][2] == names and sent["e4m3-up"][2] - sent["int8-up"][2] == names
    assert all(seconds >= 0.9 * size * 8 / 20e6 for seconds, _, size in sent.values())

    def eight_bit(top1: dict, ratio: float = 0.5) -> str:
        facts = {"ratio_to_bf16": {f"llama-3-8b/{w}/4096/20": ratio for w in upload.WIRES[1:]}, "top1": top1}
        return next(t.line() for t in upload.targets(facts) if t.name == "eight_bit_ttft_4096_8b_20mbit")

    # the line reports the best 8-bit wire: one that meets the agreement bar passes, a fast one below it does not
    assert eight_bit({"e4m3": 0.95, "e4m3-up": 0.995, "int8": 0.97}).startswith(
        "TARGET upload eight_bit_ttft_4096_8b_20mbit: PASS (e4m3-up: 0.50x, top-1 99.5 %")
    assert eight_bit({"e4m3": 0.95, "int8-up": 0.979, "bfloat16": 0.988}).startswith(
        "TARGET upload eight_bit_ttft_4096_8b_20mbit: MISS (int8-up: 0.50x, top-1 97.9 % (the bfloat16 wire against "
        "itself: 98.8 %)")
    assert ": MISS (" in eight_bit({"int8-up": 0.995}, ratio=0.6)  # agreeing but slow


def test_upload_overlap_target_is_the_pipelined_prompt_over_the_upload_alone_at_4096_tokens():
    from bench.sections import upload

    def verdict(overlap: dict) -> str:
        facts = {"ratio_to_bf16": {}, "top1": {}, "overlap": overlap}
        return next(t.line() for t in upload.targets(facts) if t.name == "overlap")

    assert verdict({"pipelined/4096": 1.02, "one step at a time/4096": 2.0}) == "TARGET upload overlap: PASS (1.02x)"
    assert verdict({"pipelined/4096": 1.2}).startswith("TARGET upload overlap: MISS")
    assert verdict({"pipelined/1024": 1.02}).startswith("TARGET upload overlap: MISS")  # a quick run's prompt
