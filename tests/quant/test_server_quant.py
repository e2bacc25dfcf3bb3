"""Quantised served layers: the int4 format and its kernels, the three methods, quantised bundles end to end."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

from infemeral.cloak.bundle import ServerBundle
from infemeral.cloak.prepare import prepare
from infemeral.cloak.sources import ModelSource
from infemeral.errors import FailedPrecondition
from infemeral.layers.stack import LayerStack
from infemeral.quant import gptq, int4, int8, served
from infemeral.quant.hqq import quantize_hqq
from infemeral.quant.served import ServerQuant
from tests.cloak.test_server_bundle_scrub import tiny_chat_tokenizer

HIDDEN, FFN = 128, 256


def outlier_weight(rows: int = 64, cols: int = 128, seed: int = 0) -> torch.Tensor:
    """A weight with a few large input columns, as folded norm gains make them."""
    g = torch.Generator().manual_seed(seed)
    w = 0.02 * torch.randn(rows, cols, generator=g)
    w[:, :: cols // 4] *= 12
    return w


# -- the int4 format and kernels ------------------------------------------------------------------------
def test_nibbles_round_trip_and_layout():
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    packed = int4.pack_nibbles(codes)
    assert packed.shape == (16, 32) and packed.dtype == torch.uint8
    assert torch.equal(int4.unpack_nibbles(packed), codes)
    assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 1]) << 4  # column 2j low, 2j+1 high


@pytest.mark.parametrize("symmetric", [False, True])
def test_rtn_codes_are_within_half_a_step(symmetric):
    w = outlier_weight()
    stored = int4.quantize_rtn(w, 32, symmetric)
    deq = int4.dequantize(**stored)
    step = stored["scales"].float().repeat_interleave(32, dim=1)
    assert stored["scales"].dtype == torch.bfloat16 and stored["scales"].shape == (64, 4)
    assert bool(((deq - w).abs() <= step * 0.5 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_its_dequantised_weight_through_the_cpu_kernel(dtype):
    """The CPU kernel runs bfloat16 activations only: float32 ones dequantise (its float32 loop is scalar)."""
    w = outlier_weight(48, 128)
    stored = int4.quantize_rtn(w, 32)
    bias = torch.randn(48)
    kernel_here = "cpu" if dtype == torch.bfloat16 else "dequantize"
    for use_kernel, kernel in ((True, kernel_here), (False, "dequantize")):
        with torch.device("meta"):
            linear = int4.Int4Linear(128, 48, 32, bias=True, use_kernel=use_kernel)
        linear.load_state_dict({"qweight": stored["qweight"], "scales": stored["scales"].to(dtype),
                                "zeros": stored["zeros"].to(dtype), "bias": bias.to(dtype)}, assign=True)
        assert linear.kernel == kernel
        x = torch.randn(2, 3, 128).to(dtype)
        want = x.float() @ int4.dequantize(**stored).T + bias
        got = linear(x).float()
        assert got.shape == (2, 3, 48)
        assert float((got - want).norm() / want.norm()) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_shapes_without_a_kernel_are_said_and_dequantised(caplog):
    kind, reason = int4.kernel_for(torch.device("cpu"), torch.bfloat16, 24, 128, 32)
    assert kind is None and "multiple of 16" in reason
    assert int4.kernel_for(torch.device("cpu"), torch.bfloat16, 32, 96, 64)[0] is None  # 64 does not divide 96
    assert int4.kernel_for(torch.device("meta"), torch.bfloat16, 32, 128, 32) == (None, "no int4 kernel on meta")
    w = outlier_weight(24, 128)
    stored = int4.quantize_rtn(w, 32)
    with torch.device("meta"):
        linear = int4.Int4Linear(128, 24, 32, bias=False)
    int4._warned.clear()
    with caplog.at_level("WARNING"):
        linear.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in stored.items()},
                               assign=True)
    assert linear.kernel == "dequantize" and "dequantising them on every call" in caplog.text
    x = torch.randn(3, 128)
    assert torch.allclose(linear(x), x @ int4.dequantize(**stored).T, atol=1e-5)


class OutputsSeen(TorchDispatchMode):
    """Records the dtype and size of every tensor an operator makes while it is on."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.made += [(t.dtype, t.numel()) for t in outs if isinstance(t, torch.Tensor)]
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_dequantising_in_half_precision_makes_no_float32_weight(dtype):
    """The fallback runs on every call: its weight is made in the activation dtype, and is the float32 weight
    rounded to it, bit for bit."""
    stored = int4.quantize_rtn(outlier_weight(48, 128), 32)
    with torch.device("meta"):
        linear = int4.Int4Linear(128, 48, 32, bias=False, use_kernel=False)
    linear.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in stored.items()}, assign=True)
    x = torch.randn(3, 128).to(dtype)
    with OutputsSeen() as seen:
        y = linear(x)
    assert y.dtype == dtype
    assert max(n for t, n in seen.made if t == dtype) >= 48 * 128  # the weight was made, in the activation dtype
    assert not [n for t, n in seen.made if t == torch.float32]
    assert torch.equal(int4.dequantize(**stored, dtype=dtype), int4.dequantize(**stored).to(dtype))


def test_int4_dequantised_in_float32_is_unchanged():
    """float32 is every reference's dtype: (q - 8) * s + z computed in float32, bit for bit."""
    stored = int4.quantize_rtn(outlier_weight(48, 128), 64)
    groups = int4.group_view(int4.unpack_nibbles(stored["qweight"]), 64).float()
    want = (groups - 8) * stored["scales"].float().unsqueeze(-1) + stored["zeros"].float().unsqueeze(-1)
    assert torch.equal(int4.dequantize(**stored), want.reshape(48, 128))


def test_int4_on_a_cpu_runs_its_kernel_in_bfloat16_only():
    """The CPU kernel's float32 and float16 paths are scalar loops (0.19 s for 256 rows of a 576x576 weight,
    1 ms in bfloat16): a float32 or float16 layer dequantises instead, and the reason says how to get the kernel."""
    assert int4.kernel_for(torch.device("cpu"), torch.bfloat16, 64, 128, 32) == ("cpu", "")
    for dtype in (torch.float32, torch.float16):
        kind, reason = int4.kernel_for(torch.device("cpu"), dtype, 64, 128, 32)
        assert kind is None and "bfloat16" in reason and str(dtype) in reason


def test_int4_on_cuda_takes_bfloat16_only():
    """tinygemm refuses other activations; the reason (logged once) says so, without a CUDA device to ask."""
    for dtype in (torch.float16, torch.float32):
        kind, reason = int4.kernel_for(torch.device("cuda"), dtype, 64, 128, 32)
        assert kind is None and "bfloat16 only" in reason and str(dtype) in reason


# -- the methods ----------------------------------------------------------------------------------------
def output_error(x: torch.Tensor, w: torch.Tensor, deq: torch.Tensor) -> float:
    return float((x @ (w - deq).T).norm() / (x @ w.T).norm())


def correlated_inputs(n: int = 512, k: int = 128, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    scale = torch.ones(k)
    scale[:8] = 6.0  # a few loud input channels, as real hidden states have
    return (torch.randn(n, k, generator=g) * scale) @ mix


def test_hqq_fits_outlier_groups_better_than_round_to_nearest():
    w = outlier_weight()
    rtn, fitted = int4.dequantize(**int4.quantize_rtn(w, 64)), int4.dequantize(**quantize_hqq(w, 64))
    lp = lambda d: float(d.abs().pow(0.7).mean())  # noqa: E731 - the norm HQQ minimises
    assert lp(fitted - w) < 0.99 * lp(rtn - w)


def test_gptq_lowers_the_output_error_of_round_to_nearest():
    w, x = outlier_weight(), correlated_inputs()
    h = x.T @ x
    rtn4 = int4.dequantize(**int4.quantize_rtn(w, 32))
    gptq4 = int4.dequantize(**gptq.quantize_gptq_int4(w, h, 32))
    assert output_error(x, w, gptq4) < 0.8 * output_error(x, w, rtn4)
    codes, scales = int8.quantize_rows(w)
    gcodes, gscales = gptq.quantize_gptq_int8(w, h)
    assert torch.equal(scales, gscales) and gcodes.dtype == torch.int8  # same format, other codes
    assert output_error(x, w, int8.dequantize_rows(gcodes, gscales, torch.float32)) < \
        0.8 * output_error(x, w, int8.dequantize_rows(codes, scales, torch.float32))


def test_clipped_grids_round_groups_with_an_outlier_closer_than_their_full_range():
    w = outlier_weight()
    full = int4.dequantize(**int4.quantize_rtn(w, 64))  # round-to-nearest over each group's min..max
    scales, zeros = int4.round_params(*int4.clipped_params(int4.group_view(w, 64)))
    clipped = int4.dequantize(**int4.stored(int4.codes_for(w, scales, zeros), scales, zeros))
    norm = lambda d: float(d.abs().pow(int4.CLIP_NORM).sum())  # noqa: E731 - what the search minimises
    assert norm(clipped - w) < 0.95 * norm(full - w)
    assert torch.all(scales.float() <= int4.minmax_params(int4.group_view(w, 64))[0] * 1.01)  # never wider


def test_gptq_in_activation_order_keeps_groups_in_column_order_and_lowers_the_error():
    """Columns taken loudest input first: the codes and grids are stored where the kernel reads them (column j's
    code in column j, group g's grid from columns g·size…), and the output error falls."""
    w, x = outlier_weight(), correlated_inputs()
    x[:, 100] *= 20  # the loudest input sits late in the weight: taken first in activation order
    h = x.T @ x
    plain = gptq.quantize_gptq_int4(w, h, 32, fit=int4.minmax_params, act_order=False)
    ordered = gptq.quantize_gptq_int4(w, h, 32, fit=int4.minmax_params, act_order=True)
    assert output_error(x, w, int4.dequantize(**ordered)) < output_error(x, w, int4.dequantize(**plain))
    # the grids are the static ones of the weight's own groups, in place
    scales, zeros = int4.round_params(*int4.minmax_params(int4.group_view(w, 32)))
    assert torch.equal(ordered["scales"], scales) and torch.equal(ordered["zeros"], zeros)
    # with an identity Hessian GPTQ has no error to spread: every code is round-to-nearest on that grid
    exact = gptq.quantize_gptq_int4(w, torch.eye(w.shape[1]), 32, fit=int4.minmax_params, act_order=True)
    assert torch.equal(int4.unpack_nibbles(exact["qweight"]), int4.codes_for(w, scales, zeros))


def test_scheme_checks_and_manifest_round_trip():
    assert ServerQuant("int4").to_manifest() == {"scheme": "int4", "method": served.DEFAULT_METHOD["int4"],
                                                 "group_size": served.DEFAULT_GROUP_SIZE,
                                                 "int8_linears": list(served.DEFAULT_INT8_LINEARS)}
    assert ServerQuant("int4", int8_linears=()).scheme_of("self_attn.v_proj") == "int4"
    assert ServerQuant.from_manifest({}) == ServerQuant("none")  # bundles from before quantisation
    entry = ServerQuant("int4", "hqq", 128).to_manifest()
    assert ServerQuant.from_manifest({"server_quant": entry}) == ServerQuant("int4", "hqq", 128)
    for bad in (dict(scheme="int3"), dict(scheme="int4", group_size=48), dict(scheme="int8", method="hqq"),
                dict(scheme="int8", group_size=64), dict(scheme="none", method="gptq"),
                dict(scheme="int4", int8_linears=("self_attn.x_proj",))):
        with pytest.raises(ValueError):
            ServerQuant(**bad)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    ServerQuant("int4", "rtn", 64).check_shapes(config)
    with pytest.raises(ValueError, match="takes 32, 64"):
        ServerQuant("int4", "rtn", 128).check_shapes(config)


# -- bundles ---------------------------------------------------------------------------------------------
def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn_like(p).abs())
    return model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(), tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def prepared(tiny, tmp_path_factory):
    """Bundles of one tiny model with one basis: unquantised and every scheme x method."""
    model, tokenizer = tiny
    out = tmp_path_factory.mktemp("quant-bundles")
    kinds = {"none": {}, "int8-rtn": dict(server_quant="int8", quant_method="rtn"),
             "int4-rtn": dict(server_quant="int4", quant_method="rtn", group_size=32),
             "int4-hqq": dict(server_quant="int4", quant_method="hqq", group_size=32),
             "int4-gptq": dict(server_quant="int4", quant_method="gptq", group_size=32, calibration_tokens=512),
             "int4-rtn-64": dict(server_quant="int4", quant_method="rtn", group_size=64),
             "int4-rtn-all": dict(server_quant="int4", quant_method="rtn", group_size=32, int8_linears=())}
    return {kind: prepare(output=out / kind, source=ModelSource(model, tokenizer), progress=False,
                          basis_seed=b"\7" * 32, **kw) for kind, kw in kinds.items()}


def test_manifest_records_the_scheme_and_the_fingerprint_covers_it(prepared):
    fingerprints = {kind: b.fingerprint for kind, b in prepared.items()}
    assert len(set(fingerprints.values())) == len(fingerprints)  # every scheme, method and group differs
    plain = ServerBundle.open(prepared["none"].server_dir)
    assert plain.manifest["format_version"] == 1 and "server_quant" not in plain.manifest
    bundle = ServerBundle.open(prepared["int4-gptq"].server_dir)
    assert bundle.manifest["format_version"] == 2
    assert bundle.manifest["server_quant"]["scheme"] == "int4"
    assert bundle.manifest["server_quant"]["calibration_tokens"] == 512
    tensors = bundle.layer_weights(1)
    assert tensors["self_attn.q_proj.qweight"].dtype == torch.uint8
    assert tensors["self_attn.v_proj.weight"].dtype == torch.int8 and "self_attn.v_proj.qweight" not in tensors
    assert tensors["mlp.down_proj.scales"].shape == (HIDDEN, FFN // 32)
    assert tensors["input_layernorm.weight"].dtype == torch.float32
    # changing the recorded scheme is caught like any other edit of the manifest
    path = prepared["int4-rtn"].server_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["server_quant"]["group_size"] = 64
    path.write_text(json.dumps(manifest))
    try:
        with pytest.raises(FailedPrecondition, match="manifest has been modified"):
            ServerBundle.open(prepared["int4-rtn"].server_dir)
    finally:
        manifest["server_quant"]["group_size"] = 32
        path.write_text(json.dumps(manifest))


@torch.inference_mode()
def test_quantised_layers_run_through_their_kernels_close_to_float(prepared):
    """Each bundle's layers, as the server loads them, against the same basis unquantised: close, never equal."""
    reference = served.load_stack(ServerBundle.open(prepared["none"].server_dir), torch.float32)
    x = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(3))
    want = reference(x, reference.new_cache()) - x
    errors = {}
    for kind in ("int8-rtn", "int4-rtn", "int4-hqq", "int4-gptq", "int4-rtn-all"):
        bundle = ServerBundle.open(prepared[kind].server_dir)
        stack = served.load_stack(bundle, torch.float32)
        int8_kernel = f"int8 _weight_int8pack_mm up to {int8.CPU_UNVECTORISED_MAX_ROWS} rows, dequantize above"
        expected = {"int8": {int8_kernel: 14}, "int4-rtn-all": {"int4 dequantize": 14}}.get(  # float32: see above
            kind[:4] if kind.startswith("int8") else kind, {"int4 dequantize": 10, int8_kernel: 4})
        assert served.kernels_in_use(stack) == expected
        got = stack(x, stack.new_cache()) - x
        errors[kind] = float((got - want).norm() / want.norm())
        dense = LayerStack(bundle.config, 1, [bundle.float_layer_weights(i) for i in (1, 2)])
        assert torch.allclose(got, dense(x, dense.new_cache()) - x, atol=1e-4)  # the kernel = the dequantised weight
    assert 0 < errors["int8-rtn"] < 0.02
    assert errors["int4-rtn"] < errors["int4-rtn-all"] < 0.3 and errors["int4-gptq"] < errors["int4-rtn"]


def test_prepare_refuses_a_group_size_the_model_cannot_take(tiny, tmp_path):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="does not divide"):
        prepare(output=tmp_path, source=ModelSource(model, tokenizer), progress=False, server_quant="int4",
                group_size=256)
    with pytest.raises(ValueError, match="tokenizer"):
        prepare(output=tmp_path, source=ModelSource(model, None), progress=False, server_quant="int4",
                quant_method="gptq", group_size=32)
    assert not (tmp_path / "server").exists()


@pytest.mark.slow
def test_a_quantised_bundle_serves_over_grpc(prepared, tiny, tmp_path):
    """A real server on an int4 bundle answers turns; the server logs its scheme and kernels."""
    from tests.conftest import start_server
    from infemeral.client.client import Client
    from infemeral.client.sampling import SamplingParams

    answers = {}
    for kind in ("none", "int4-hqq"):
        server = start_server(prepared[kind], tmp_path / kind)
        try:
            assert server.engine.runner.quant.scheme == ("none" if kind == "none" else "int4")
            with Client(f"127.0.0.1:{server.port}", prepared[kind].client_dir, timeout=60) as client:
                session = client.new_session()
                answers[kind] = session.chat("w5 w9 w11 w3", SamplingParams(max_new_tokens=8)).token_ids
                assert session.version == 1
        finally:
            server.stop(0)
    assert answers["int4-hqq"], "the int4 server produced no tokens"


def test_the_audit_reads_a_quantised_server_bundle(prepared):
    """The audit's K/V inversion runs the first served layer as the server does, quantised."""
    from infemeral.audit import audit

    report = audit("w5 w9 w11 w3 w7 w8", prepared["int4-rtn"].client_dir, progress=False)
    kv = next(row for row in report.rows if row.key == "kv")
    assert kv.metrics and "%" in kv.overall


def test_the_command_line_prepares_and_evaluates_a_quantised_bundle(tiny, tmp_path, capsys):
    """`prepare --server-quant int4 --group-size 32 --quant-method rtn`, then `eval server-quant` on it."""
    from infemeral.cli.main import main

    model, tokenizer = tiny
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "bundles"
    assert main(["prepare", str(checkpoint), "--output", str(out), "--server-quant", "int4", "--group-size", "32",
                 "--quant-method", "rtn", "--quiet"]) == 0
    manifest = json.loads((out / "server" / "manifest.json").read_text())
    assert manifest["server_quant"] == {"scheme": "int4", "method": "rtn", "group_size": 32,
                                        "int8_linears": ["self_attn.k_proj", "self_attn.v_proj"]}
    text = tmp_path / "held.txt"
    text.write_text(" ".join(f"w{3 + (7 * i) % 60}" for i in range(200)))
    capsys.readouterr()
    assert main(["eval", "server-quant", "--model", str(checkpoint), "--client-bundle", str(out / "client"),
                 "--text", str(text), "--tokens", "128", "--positions", "16"]) == 0
    line = capsys.readouterr().out
    assert "int4 (rtn, groups of 32, k_proj, v_proj in int8)" in line and "perplexity" in line and "top-1" in line
    assert main(["prepare", str(checkpoint), "--output", str(tmp_path / "bad"), "--server-quant", "int4",
                 "--group-size", "48", "--quiet"]) == 2  # not a kernel's group size: one line, exit 2
    assert "group size must be one of 32, 64, 128, 256" in capsys.readouterr().err


def test_int8_codes_that_start_anywhere_in_memory_run_through_the_kernel():
    """Codes read in place from a file need not be 64-byte aligned; the CPU kernel's aligned loads crashed on them."""
    w = outlier_weight(64, 128)
    codes, scales = int8.quantize_rows(w)
    backing = torch.empty(codes.numel() + 1, dtype=torch.int8)
    backing[1:] = codes.reshape(-1)
    misaligned = backing[1:].view(codes.shape)
    assert misaligned.data_ptr() % 64 != 0
    with torch.device("meta"):
        linear = int8.Int8Linear(128, 64, bias=False)
    linear.load_state_dict({"weight": misaligned, "scale": scales.to(torch.bfloat16)}, assign=True)
    x = torch.randn(3, 128).to(torch.bfloat16)
    want = x.float() @ int8.dequantize_rows(codes, scales, torch.float32).T
    assert float((linear(x).float() - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("rows, on_cuda, on_cpu_unvectorised", [(1, True, True), (4, True, True), (5, False, True),
                                                                 (8, False, True), (9, False, False),
                                                                 (64, False, False)])
def test_int8_kernel_runs_few_rows_on_cuda_and_in_float32_on_a_cpu(monkeypatch, rows, on_cuda, on_cpu_unvectorised):
    """CUDA's `_weight_int8pack_mm` has no tensor cores and reads the weight once per row, and the CPU kernel
    is a scalar loop for float32 and float16: a prefill there multiplies the dequantised weight instead. The
    CPU kernel takes any number of bfloat16 rows (vectorised)."""
    monkeypatch.setattr(int8, "has_int8_kernel", lambda device_type, dtype: True)  # as on a GPU that has it
    assert int8.uses_int8_kernel("cuda", torch.bfloat16, rows, 128) is on_cuda
    assert int8.uses_int8_kernel("cpu", torch.bfloat16, rows, 128)
    for dtype in (torch.float32, torch.float16):
        assert int8.uses_int8_kernel("cpu", dtype, rows, 128) is on_cpu_unvectorised
    assert not int8.uses_int8_kernel("cpu", torch.bfloat16, rows, 120)  # not a multiple of 16: never the kernel
    assert int8.kernel_in_use("cuda", torch.bfloat16, 128) == (
        f"_weight_int8pack_mm up to {int8.CUDA_KERNEL_MAX_ROWS} rows, dequantize above")
    assert int8.kernel_in_use("cpu", torch.bfloat16, 128) == "_weight_int8pack_mm"
    assert int8.kernel_in_use("cpu", torch.float32, 128) == (
        f"_weight_int8pack_mm up to {int8.CPU_UNVECTORISED_MAX_ROWS} rows, dequantize above")
    assert int8.kernel_in_use("cuda", torch.bfloat16, 120) == "dequantize"
    asked = []
    monkeypatch.setattr(int8, "uses_int8_kernel", lambda *a: asked.append(a) or False)
    codes, scales = int8.quantize_rows(outlier_weight(48, 128))
    int8.int8_matmul(torch.randn(rows, 128), codes, scales)
    assert asked == [("cpu", torch.float32, rows, 128)]  # the matmul decides by its own rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [128, 120])  # through the kernel; dequantised (no kernel for the width)
def test_int8_matmul_on_a_cpu_is_unchanged(dtype, width):
    """Bit for bit what it computed before CUDA's row limit: the kernel, or x @ (codes * scales)ᵀ made in float32."""
    codes, scales = int8.quantize_rows(outlier_weight(48, width))
    x = torch.randn(7, width).to(dtype)
    s = scales.to(dtype)
    if width % 16 == 0:
        want = torch.ops.aten._weight_int8pack_mm(x, codes, s)
    else:
        want = x @ ((codes.float() * s.float().unsqueeze(-1)).to(dtype)).T
    assert torch.equal(int8.int8_matmul(x, codes, scales), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_matmul_of_many_float_rows_on_a_cpu_dequantises_within_rounding_of_the_kernel(dtype):
    """Past the CPU row limit float32 and float16 rows multiply x @ (codes * scales)ᵀ: the kernel's
    numbers within rounding, and exactly that product."""
    codes, scales = int8.quantize_rows(outlier_weight(48, 128))
    rows = int8.CPU_UNVECTORISED_MAX_ROWS + 1
    x = torch.randn(rows, 128).to(dtype)
    s = scales.to(dtype)
    got = int8.int8_matmul(x, codes, scales)
    kernel = torch.ops.aten._weight_int8pack_mm(x, codes, s)
    assert torch.equal(got, x @ (codes.to(dtype) * s.unsqueeze(-1)).T)
    assert float((got.float() - kernel.float()).norm() / kernel.float().norm()) < (1e-6 if dtype == torch.float32
                                                                                    else 1e-3)
