"""The GPU path's start-up self-checks, decided on the CPU with backends and kernels that fail or disagree."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from infemeral.cloak.bundle import ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.layers.attention_backends.torch_backend import TorchBackend
from infemeral.quant import int4, int8, served
from infemeral.server import self_check
from infemeral.server.layer_runner import served_window
from infemeral.server.self_check import SelfCheckFailed, checked_attention, checked_kernels
from tests.quant.test_server_quant import tiny_model

SHAPE = dict(num_qo_heads=8, num_kv_heads=2, head_dim=32, page_size=16)
CPU = torch.device("cpu")


class FakeBackend:
    """Plays FlashInfer: raises, or returns the PyTorch backend's answer shifted by `offset` (or with NaN in all
    or one of its values), or gets it right; `only` limits the fault to the windowed cases ("window") or to
    batches holding a draft tree ("tree")."""

    name = "flashinfer"

    def __init__(self, fail: str | None = None, offset: float = 0.0, only: str | None = None, nan: str | None = None):
        self.fail, self.offset, self.only, self.nan = fail, offset, only, nan
        self.inner = TorchBackend()
        self.calls = 0
        self.runs = []  # (sliding window, new tokens of each sequence) of every call

    def plan(self, batch):
        self.inner.plan(batch)

    def run(self, q, k_pages, v_pages, batch, sm_scale, sliding_window=None):
        self.calls += 1
        self.runs.append((sliding_window, tuple(batch.qo_indptr.diff().tolist())))
        if self.fail:
            raise RuntimeError(self.fail)
        out = self.inner.run(q, k_pages, v_pages, batch, sm_scale, sliding_window)
        has_tree = any(t is not None for t in getattr(batch, "trees", None) or [])
        if self.only is None or (has_tree if self.only == "tree" else
                                 (self.only == "window") == (sliding_window is not None)):
            out = out + self.offset
            if self.nan == "all":
                out = torch.full_like(out, float("nan"))
            elif self.nan == "one":
                out = out.clone()
                out[-1, 0, 0] = float("nan")
        return out


def check(backend, requested="auto", dtype=torch.float32, sliding_window=64):
    return checked_attention(requested, backend, CPU, **SHAPE, dtype=dtype, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pytorch_backend_passes_its_own_check(dtype):
    assert self_check.attention_failure(TorchBackend(), CPU, **SHAPE, dtype=dtype) is None


def test_every_case_is_exercised():
    names = {case.name for case in self_check.ATTENTION_CASES}
    assert names == {"decode", "prefill with a causal offset", "sliding window, decode",
                     "sliding window, mixed batch", "ragged batch"}
    prefill = next(c for c in self_check.ATTENTION_CASES if c.name == "prefill with a causal offset")
    assert all(k > n for k, n in zip(prefill.kv_lengths, prefill.new_tokens))  # queries sit after cached keys
    backend = FakeBackend()
    assert check(backend) is backend and backend.calls == len(self_check.ATTENTION_CASES)


def test_a_model_with_a_window_checks_the_windowed_decode_and_one_without_skips_the_window():
    """FlashInfer plans a decode-only batch on its decode wrapper and anything else on its prefill wrapper: a
    windowed model needs both checked with a window; a model without one never attends with a window."""
    windowed = FakeBackend()
    check(windowed, sliding_window=64)
    window_runs = [tokens for window, tokens in windowed.runs if window is not None]
    assert {window for window, _ in windowed.runs} == {None, 64}
    assert any(set(tokens) == {1} for tokens in window_runs)  # every sequence adds one token: the decode wrapper
    assert any(max(tokens) > 1 for tokens in window_runs)
    small = FakeBackend()
    check(small, sliding_window=4)  # a window smaller than the cases' is the model's own
    assert {window for window, _ in small.runs} == {None, 4}
    plain = FakeBackend()
    check(plain, sliding_window=None)
    assert plain.runs and all(window is None for window, _ in plain.runs)


def test_the_runner_checks_the_window_of_the_served_layers():
    """Qwen2 windows only the layers from max_window_layers on: whether the served range has one decides."""
    qwen = Qwen2Config(num_hidden_layers=6, sliding_window=4, use_sliding_window=True, max_window_layers=3)
    assert served_window(SimpleNamespace(config=qwen, first_layer=1, num_layers=2)) is None
    assert served_window(SimpleNamespace(config=qwen, first_layer=1, num_layers=3)) == 4
    assert served_window(SimpleNamespace(config=MistralConfig(sliding_window=8), first_layer=1, num_layers=2)) == 8
    assert served_window(SimpleNamespace(config=LlamaConfig(), first_layer=1, num_layers=2)) is None


@pytest.mark.parametrize("nan, only", [("all", None), ("one", None), ("one", "window")])
def test_a_backend_returning_nan_fails_the_check(nan, only, caplog):
    """NaN is no number: `nan > limit` is false, so a NaN anywhere in a backend's answer (where the reference is
    finite) must be caught on its own."""
    with caplog.at_level(logging.WARNING, logger="infemeral.server.self_check"):
        assert isinstance(check(FakeBackend(nan=nan, only=only)), TorchBackend)
    assert "non-finite output" in caplog.text
    with pytest.raises(SelfCheckFailed, match="non-finite output"):
        check(FakeBackend(nan=nan, only=only), requested="flashinfer")


@pytest.mark.parametrize("fake, reason", [(dict(fail="no kernel image for this device"), "no kernel image"),
                                          (dict(offset=0.2), "max |flashinfer - reference|"),
                                          (dict(offset=0.2, only="window"), "sliding window")])
def test_auto_falls_back_to_pytorch_with_one_line(fake, reason, caplog):
    with caplog.at_level(logging.WARNING, logger="infemeral.server.self_check"):
        chosen = check(FakeBackend(**fake))
    assert isinstance(chosen, TorchBackend)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()
    assert "PyTorch backend" in warnings[0].getMessage()


def test_an_explicit_flashinfer_refuses_to_start_with_the_reason():
    with pytest.raises(SelfCheckFailed, match="refusing to start.*|no kernel image") as e:
        check(FakeBackend(fail="no kernel image for this device"), requested="flashinfer")
    assert "no kernel image" in str(e.value) and "--attention-backend torch" in str(e.value)
    with pytest.raises(SelfCheckFailed, match="max \\|flashinfer - reference\\|"):
        check(FakeBackend(offset=0.2), requested="flashinfer")


def test_the_tree_case_decides_whether_a_backend_verifies_draft_trees(caplog):
    """FlashInfer plans a draft tree with a custom mask, apart from its chains: a backend right on the chain cases
    verifies trees only if its tree case matches too; wrong there, it still serves, chains only (an explicit
    flashinfer included), in one logged line. A windowed model takes no trees and runs no tree case."""
    right = check(FakeBackend(), sliding_window=None)
    assert right.name == "flashinfer" and right.draft_trees is True
    assert (None, (7, 5, 1)) in right.runs  # the tree beside a chain and a decode
    for requested in ("auto", "flashinfer"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="infemeral.server.self_check"):
            wrong = check(FakeBackend(offset=0.2, only="tree"), requested=requested, sliding_window=None)
        assert wrong.name == "flashinfer" and wrong.draft_trees is False
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "draft tree" in warnings[0] and "chains only" in warnings[0]
    windowed = check(FakeBackend(offset=0.2, only="tree"), sliding_window=64)
    assert not hasattr(windowed, "draft_trees") and (None, (7, 5, 1)) not in windowed.runs
    assert self_check.attention_failure(TorchBackend(), CPU, **SHAPE, dtype=torch.bfloat16,
                                        cases=list(self_check.TREE_CASES)) is None


def test_a_tolerance_below_rounding_is_not_a_mismatch():
    assert check(FakeBackend(offset=1e-2), dtype=torch.bfloat16).name == "flashinfer"  # bf16 noise is allowed
    assert isinstance(check(FakeBackend(offset=1e-2), dtype=torch.float32), TorchBackend)


def test_a_broken_pytorch_backend_refuses_to_start(monkeypatch):
    monkeypatch.setattr(self_check, "torch_paged_attention",
                        lambda *a, **k: torch.zeros(1))  # the reference and the backend can no longer agree
    with pytest.raises(SelfCheckFailed, match="PyTorch attention backend"):
        check(TorchBackend(), requested="torch")


# -- one served layer ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int4_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("self-check")
    bundles = prepare(output=out, source=ModelSource(tiny_model(), None), progress=False, server_quant="int4",
                      quant_method="rtn", group_size=32)
    return ServerBundle.open(bundles.server_dir)


def test_a_correct_quantised_layer_passes(int4_bundle):
    assert self_check.layer_failure(int4_bundle, torch.float32, CPU) is None
    assert self_check.layer_failure(int4_bundle, torch.bfloat16, CPU) is None
    assert checked_kernels(int4_bundle, torch.float32, CPU) is True


def test_a_wrong_int4_kernel_falls_back_to_dequantising(int4_bundle, monkeypatch, caplog):
    real = int4._kernel_mm
    monkeypatch.setattr(int4, "_kernel_mm", lambda *a: real(*a).roll(1, dims=-1))  # rows of the wrong outputs
    assert "relative error" in self_check.layer_failure(int4_bundle, torch.bfloat16, CPU)
    assert self_check.layer_failure(int4_bundle, torch.float32, CPU) is None  # float32 dequantises: no kernel
    with caplog.at_level(logging.WARNING, logger="infemeral.server.self_check"):
        assert checked_kernels(int4_bundle, torch.bfloat16, CPU) is False
    assert "kernels of int4 (rtn, groups of 32" in caplog.text and "dequantising" in caplog.text


def test_a_wrong_int8_kernel_falls_back_to_dequantising(int4_bundle, monkeypatch, caplog):
    """The int4 bundle keeps k_proj and v_proj in int8: a wrong int8 kernel is caught by the same check."""
    real = int8.int8_matmul
    monkeypatch.setattr(int8, "int8_matmul", lambda *a: real(*a) * 1.5)  # scales read wrong
    assert "relative error" in self_check.layer_failure(int4_bundle, torch.float32, CPU)
    with caplog.at_level(logging.WARNING, logger="infemeral.server.self_check"):
        assert checked_kernels(int4_bundle, torch.float32, CPU) is False
    assert "dequantising" in caplog.text
    stack = served.load_stack(int4_bundle, torch.float32, use_kernels=False)
    assert set(served.kernels_in_use(stack)) == {"int4 dequantize", "int8 dequantize"}  # what serves then


@pytest.mark.parametrize("kernel, rows, step", [("int8", (1,), "decode"), ("int4", (1,), "decode"),
                                                ("int8", (2, 3, 4), "a few positions")])
def test_a_kernel_wrong_only_for_a_few_rows_is_caught(int4_bundle, monkeypatch, kernel, rows, step):
    """A kernel may take another path for one row (decode) or a few (speculative verification) than for a prefill:
    a kernel wrong only there fails the step that runs it."""
    if kernel == "int8":
        real = int8.int8_matmul
        monkeypatch.setattr(int8, "int8_matmul", lambda x, *a: real(x, *a) * (1.5 if x.shape[0] in rows else 1))
    else:
        real = int4._kernel_mm
        monkeypatch.setattr(int4, "_kernel_mm", lambda kind, x, *a: real(kind, x, *a).roll(1, dims=-1)
                            if x.shape[0] in rows else real(kind, x, *a))
    dtype = torch.bfloat16 if kernel == "int4" else torch.float32  # the CPU int4 kernel runs bfloat16 only
    failure = self_check.layer_failure(int4_bundle, dtype, CPU)
    assert failure is not None and failure.startswith(f"{step}: relative error")


def test_a_layer_wrong_even_without_its_kernel_refuses_to_start(int4_bundle, monkeypatch):
    monkeypatch.setattr(int4.Int4Linear, "forward", lambda self, x: torch.zeros(*x.shape[:-1], self.out_features,
                                                                                 dtype=x.dtype))
    with pytest.raises(SelfCheckFailed, match="even without its kernel"):
        checked_kernels(int4_bundle, torch.float32, CPU)
