"""The GPU path's start-up self-checks, decided on the CPU with backends and kernels that fail or disagree."""

from __future__ import annotations

import logging

import pytest
import torch

from infemeral.cloak.bundle import ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.model.paged_attention import TorchBackend
from infemeral.quant import int4, int8, served
from infemeral.server import self_check
from infemeral.server.self_check import SelfCheckFailed, checked_attention, checked_kernels
from test_server_quant import tiny_model

SHAPE = dict(num_qo_heads=8, num_kv_heads=2, head_dim=32, page_size=16)
CPU = torch.device("cpu")


class FakeBackend:
    """Plays FlashInfer: raises, or returns the PyTorch backend's answer shifted by `offset`, or gets it right."""

    name = "flashinfer"

    def __init__(self, fail: str | None = None, offset: float = 0.0, only: str | None = None):
        self.fail, self.offset, self.only = fail, offset, only
        self.inner = TorchBackend()
        self.calls = 0

    def plan(self, batch):
        self.inner.plan(batch)

    def run(self, q, k_pages, v_pages, batch, sm_scale, sliding_window=None):
        self.calls += 1
        if self.fail:
            raise RuntimeError(self.fail)
        out = self.inner.run(q, k_pages, v_pages, batch, sm_scale, sliding_window)
        if self.only is None or (self.only == "window") == (sliding_window is not None):
            out = out + self.offset
        return out


def check(backend, requested="auto", dtype=torch.float32):
    return checked_attention(requested, backend, CPU, **SHAPE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pytorch_backend_passes_its_own_check(dtype):
    assert self_check.attention_failure(TorchBackend(), CPU, **SHAPE, dtype=dtype) is None


def test_every_case_is_exercised():
    names = {case.name for case in self_check.ATTENTION_CASES}
    assert names == {"decode", "prefill with a causal offset", "sliding window", "ragged batch"}
    prefill = next(c for c in self_check.ATTENTION_CASES if c.name == "prefill with a causal offset")
    assert all(k > n for k, n in zip(prefill.kv_lengths, prefill.new_tokens))  # queries sit after cached keys
    backend = FakeBackend()
    assert check(backend) is backend and backend.calls == len(self_check.ATTENTION_CASES)


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
    assert "relative error" in self_check.layer_failure(int4_bundle, torch.float32, CPU)
    assert "relative error" in self_check.layer_failure(int4_bundle, torch.bfloat16, CPU)
    with caplog.at_level(logging.WARNING, logger="infemeral.server.self_check"):
        assert checked_kernels(int4_bundle, torch.float32, CPU) is False
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


def test_a_layer_wrong_even_without_its_kernel_refuses_to_start(int4_bundle, monkeypatch):
    monkeypatch.setattr(int4.Int4Linear, "forward", lambda self, x: torch.zeros(*x.shape[:-1], self.out_features,
                                                                                 dtype=x.dtype))
    with pytest.raises(SelfCheckFailed, match="even without its kernel"):
        checked_kernels(int4_bundle, torch.float32, CPU)
