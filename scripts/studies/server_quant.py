"""How much quantising the served layers costs, method by method: the study behind docs/server_quant.md.

The served layers of one model quantised every way worth comparing, in float32 arithmetic (weights dequantised
after quantisation, so only the rounding is measured), in four arrangements:
  - `plain`: the model's own weights, norm gains apart (what ordinary quantisers see);
  - `folded`: gains folded into the weights that read each norm, no rotation;
  - `rotated`: folded and rotated, what the pod holds (W·diag(γ)·Q, Qᵀ·W);
  - `gains apart`: W·Q quantised and Qᵀ·diag(γ)·Q (a dense d×d matrix per norm) kept in float.
Methods: round-to-nearest symmetric (`rtn-sym`, the textbook baseline) and asymmetric (`rtn`), HQQ (data-free),
GPTQ (calibrated on the packaged chat text, infemeral/quant/data/calibration.json). Perplexity is over held text
(the Genesis excerpt the package ships, and the GPL-3 licence where the system has it), scored in chunks with
dense attention. Also: what keeping the gains apart costs a decode step, and which GPU fits how many sessions.

A user's own bundles are measured by `infemeral-client eval server-quant` (infemeral/eval/server_quant.py).

    python scripts/studies/server_quant.py methods --write docs/server_quant.md
    python scripts/studies/server_quant.py fits --context 8192 --write
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from infemeral.cloak.rotate import rotate_layer
from infemeral.eval.metrics import perplexity
from infemeral.eval.server_quant import DEFAULT_TEXT, TEXT_TOKENS
from infemeral.layers import architecture
from infemeral.layers.architecture import NORM_FEEDS
from infemeral.layers.stack import LayerStack
from infemeral.quant import served
from infemeral.quant.calibration import Calibration, calibration_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the studies package, run as a file too
from studies.docs_block import put_block  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# The text the first measurements used (docs/design.md §13): the GPL-3 licence as Debian and Ubuntu install it.
# Not copied into this repository (it would read as a licence of the project); used where the system has it.
GPL3_TEXT = Path("/usr/share/common-licenses/GPL-3")
DEFAULT_DOC = REPO / "docs" / "server_quant.md"
TABLE_START, TABLE_END = "<!-- server-quant-table:start -->", "<!-- server-quant-table:end -->"
FITS_MARKERS = ("<!-- server-quant-fits:start -->", "<!-- server-quant-fits:end -->")
ROWS = ("plain", "folded", "rotated", "gains apart")
ROW_TITLES = {"plain": "plain model, norm gains apart", "folded": "gains folded in, no rotation",
              "rotated": "folded and rotated (the pod's weights)",
              "gains apart": "rotated, Qᵀ·diag(γ)·Q kept apart in float"}
METHODS = ("rtn-sym", "rtn", "hqq", "gptq")



@dataclass(frozen=True)
class Mode:
    """One way to quantise every served linear: int8 per row, or int4 in groups."""

    scheme: str
    method: str
    group_size: int | None = None
    int8_linears: tuple[str, ...] = ()  # int4 modes: linears kept in int8

    @property
    def label(self) -> str:
        label = f"{self.scheme} {'per row' if self.group_size is None else f'g={self.group_size}'}"
        if self.int8_linears:
            label += ", " + "/".join(n.rsplit(".", 1)[1].removesuffix("_proj") for n in self.int8_linears) + " int8"
        return label

    @classmethod
    def of(cls, quant: served.ServerQuant) -> "Mode":
        return cls(quant.scheme, quant.method, quant.group_size, tuple(quant.int8_linears or ()))


# -- the model, arranged as each row needs it --------------------------------------------------------------
class MixedNorm(torch.nn.Module):
    """A gain-free RMSNorm followed by a dense d×d matrix: rms-normalise, then multiply by Qᵀ·diag(γ)·Q."""

    def __init__(self, eps: float, mix: torch.Tensor):
        super().__init__()
        self.eps = eps
        self.register_buffer("mix", mix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) @ self.mix


def use_mixed_norms(config: PretrainedConfig) -> Callable[[torch.nn.Module], None]:
    def adapt(layer: torch.nn.Module) -> None:
        for norm in NORM_FEEDS:
            with torch.device("meta"):
                setattr(layer, norm, MixedNorm(config.rms_norm_eps, torch.empty(config.hidden_size,
                                                                                config.hidden_size)))
    return adapt


class Reference:
    """A model's float32 tensors split as infemeral splits it: client layers, served layers, tables, Q."""

    def __init__(self, config: PretrainedConfig, state_dict: Mapping[str, torch.Tensor], tokenizer,
                 client_layers: int = 1, basis: torch.Tensor | None = None, seed: int = 0):
        from infemeral.cloak.basis import random_orthogonal

        self.config, self.tokenizer, self.client_layers = config, tokenizer, client_layers
        prefix = "model." if any(k.startswith("model.layers.") for k in state_dict) else ""
        self.layers = []
        for i in range(config.num_hidden_layers):
            head = f"{prefix}layers.{i}."
            self.layers.append({k[len(head):]: v.float() for k, v in state_dict.items() if k.startswith(head)})
        self.embed = state_dict[f"{prefix}embed_tokens.weight"].float()
        self.head = state_dict.get("lm_head.weight", self.embed).float()
        self.norm = state_dict[f"{prefix}norm.weight"].float()
        self.basis = (basis if basis is not None else
                      random_orthogonal(config.hidden_size, seed.to_bytes(32, "little"))).to(torch.float64)

    @classmethod
    def from_transformers(cls, model, tokenizer, **kwargs) -> "Reference":
        return cls(model.config, model.state_dict(), tokenizer, **kwargs)

    @property
    def served(self) -> range:
        return range(self.client_layers, self.config.num_hidden_layers)

    def arranged(self, row: str, index: int) -> dict[str, torch.Tensor]:
        """Served layer `index` in float32 as `row` arranges it (gains apart: `<norm>.mix` holds Qᵀ·diag(γ)·Q)."""
        weights = self.layers[index]
        if row == "plain":
            return dict(weights)
        if row == "folded":
            return rotate_layer(weights, torch.eye(self.config.hidden_size, dtype=torch.float64), torch.float32)
        if row == "rotated":
            return rotate_layer(weights, self.basis, torch.float32)
        if row != "gains apart":
            raise ValueError(f"unknown row {row!r}")
        gainless = dict(weights)
        q = self.basis
        mixes = {}
        for norm in NORM_FEEDS:
            gamma = weights[f"{norm}.weight"].to(torch.float64)
            mixes[f"{norm}.mix"] = (q.T @ torch.diag(gamma) @ q).to(torch.float32)
            gainless[f"{norm}.weight"] = torch.ones_like(weights[f"{norm}.weight"])
        out = rotate_layer(gainless, q, torch.float32)
        for norm in NORM_FEEDS:
            del out[f"{norm}.weight"]
        return {**out, **mixes}

    def rotates(self, row: str) -> bool:
        return row in ("rotated", "gains apart")

    def adapt(self, row: str):
        return use_mixed_norms(self.config) if row == "gains apart" else None


def quantize_row(ref: Reference, row: str, mode: Mode | None,
                 progress: Callable[[str], None] | None = None) -> list[dict[str, torch.Tensor]]:
    """The served layers of `row` with every linear quantised by `mode` and dequantised to float32 again
    (None: left in float32). GPTQ calibrates layer by layer on the already-quantised layers' outputs."""
    calibration = None
    if mode is not None and mode.method == "gptq":
        calibration = Calibration.from_tokens(ref.config, ref.embed, calibration_ids(ref.tokenizer))
        calibration.advance_stack(0, ref.layers[:ref.client_layers])
        if ref.rotates(row):
            calibration.rotate(ref.basis)
        calibration.adapt_layer = ref.adapt(row)
    out = []
    for i in ref.served:
        weights = ref.arranged(row, i)
        if mode is None:
            out.append(weights)
            continue
        hessians = calibration.hessians(i, weights) if calibration is not None else None
        quantized = dict(weights)
        for name in served.LINEARS:
            scheme, group = ("int8", None) if name in mode.int8_linears else (mode.scheme, mode.group_size)
            stored = served.quantize_linear(weights[f"{name}.weight"], scheme, "rtn" if mode.method == "rtn-sym"
                                            else mode.method, group, hessians[name] if hessians else None,
                                            symmetric=mode.method == "rtn-sym")
            quantized[f"{name}.weight"] = served.dequantize_layer({f"{name}.{k}": t for k, t in stored.items()})[
                f"{name}.weight"]
        if calibration is not None:
            calibration.advance(i, quantized)
        out.append(quantized)
        if progress:
            progress(f"layer {i}")
    return out


class FloatSplit:
    """Embedding, client layers, Q, the given served layers, Qᵀ, final norm and head, all in float32."""

    def __init__(self, ref: Reference, row: str, served_layers: list[dict[str, torch.Tensor]]):
        self.ref = ref
        self.client = LayerStack(ref.config, 0, ref.layers[:ref.client_layers])
        self.server = LayerStack(ref.config, ref.client_layers, served_layers, adapt_layer=ref.adapt(row))
        self.q = ref.basis.to(torch.float32) if ref.rotates(row) else None
        norm_cls = architecture.norm_class(ref.config)
        self.norm = norm_cls(ref.config.hidden_size, eps=ref.config.rms_norm_eps)
        self.norm.weight.data = ref.norm
        self.norm.requires_grad_(False)

    def new_cache(self):
        return self.client.new_cache(), self.server.new_cache()

    @torch.inference_mode()
    def logits(self, ids: list[int], cache) -> torch.Tensor:
        client_cache, server_cache = cache
        h = self.client(self.ref.embed[torch.tensor(ids)], client_cache)
        if self.q is not None:
            h = h @ self.q
        h = self.server(h, server_cache)
        if self.q is not None:
            h = h @ self.q.T
        return (self.norm(h.unsqueeze(0))[0] @ self.ref.head.T).float()



# -- the methods table ----------------------------------------------------------------------------------------
@dataclass
class Cell:
    row: str
    method: str
    mode: str
    perplexity: dict  # text -> perplexity with every served layer quantised
    ratio: dict       # text -> over the float32 model's perplexity
    seconds: float    # quantising every served layer (GPTQ: with its calibration)


KV = ("self_attn.k_proj", "self_attn.v_proj")


def default_modes(groups=(32, 64, 192), kv_groups=(64,)) -> list[Mode]:
    """int8 per row; int4 at each of `groups`; int4 at each of `kv_groups` with k_proj and v_proj in int8."""
    modes = [Mode("int8", m) for m in ("rtn", "gptq")]
    modes += [Mode("int4", m, g) for g in groups for m in METHODS]
    modes += [Mode("int4", m, g, KV) for g in kv_groups for m in METHODS if m != "rtn-sym"]
    return modes


def measure_methods(ref: Reference, texts: dict[str, list[int]], modes: list[Mode], rows=ROWS,
                    progress: Callable[[str], None] = lambda s: None,
                    on_cell: Callable[[dict, list[Cell]], None] = lambda base, cells: None) -> tuple[dict, list[Cell]]:
    floats = FloatSplit(ref, "rotated", quantize_row(ref, "rotated", None))
    base = {name: perplexity(floats, ids) for name, ids in texts.items()}
    progress(f"float32: perplexity {base}")
    cells = []
    for row in rows:
        for mode in modes:
            if mode.scheme == "int8" and mode.method in ("rtn-sym", "hqq"):
                continue  # int8 rtn is symmetric already; hqq fits a zero point the int8 kernel lacks
            t = time.perf_counter()
            layers = quantize_row(ref, row, mode)
            seconds = time.perf_counter() - t
            split = FloatSplit(ref, row, layers)
            ppl = {name: perplexity(split, ids) for name, ids in texts.items()}
            cells.append(Cell(row, mode.method, mode.label, ppl, {k: v / base[k] for k, v in ppl.items()}, seconds))
            progress(f"{row:12s} {mode.label:18s} {mode.method:8s} " + ", ".join(
                f"{k} {v:.3f}x" for k, v in cells[-1].ratio.items()) + f"; quantised in {seconds:.0f} s")
            on_cell(base, cells)
    return base, cells


def methods_table(cells: list[Cell]) -> str:
    """One row per arrangement and method, one column per mode; each cell the ratio on every text, '/'-separated."""
    labels = list(dict.fromkeys(c.mode for c in cells))
    lines = ["| served layers | method | " + " | ".join(labels) + " |", "|---|---|" + "---:|" * len(labels)]
    for row in dict.fromkeys(c.row for c in cells):
        for method in METHODS:
            found = {c.mode: c for c in cells if c.row == row and c.method == method}
            if not found:
                continue
            values = [" / ".join(f"{r:.3f}" for r in found[lab].ratio.values()) if lab in found else "–"
                      for lab in labels]
            lines.append(f"| {ROW_TITLES[row]} | {method} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def write_block(path: Path, body: str, start: str = TABLE_START, end: str = TABLE_END) -> None:
    put_block(path, start, end, body, "Quantised served layers")


def held_texts() -> dict[str, Path]:
    """The held texts for perplexity: the GPL-3 licence where the system has it, the Genesis excerpt always."""
    texts = {"GPL-3": GPL3_TEXT} if GPL3_TEXT.exists() else {}
    texts["KJV Genesis 37-40"] = DEFAULT_TEXT
    return texts


# -- what keeping the gains apart costs -------------------------------------------------------------------
@torch.inference_mode()
def gains_apart_cost(shape: str = "Llama-3-8B", group_size: int = 64, context: int = 128, reps: int = 20,
                     dtype: torch.dtype = torch.bfloat16) -> dict:
    """One served layer of `shape` in int4 (random weights, round-to-nearest), as the pod holds it and with the
    gains kept apart (a dense d×d matrix after each of its two norms, in `dtype`): bytes and a decode step."""
    from transformers import LlamaConfig

    s = SHAPES[shape]
    d = s["hidden"]
    config = LlamaConfig(hidden_size=d, intermediate_size=s["ffn"], num_hidden_layers=1, num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], rms_norm_eps=1e-5,
                         max_position_embeddings=8192)
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        names = {k: v.shape for k, v in architecture.decoder_layer_class(config)(config, 0).state_dict().items()}
    weights = {k: (torch.ones(shape) if "norm" in k else 0.02 * torch.randn(shape, generator=g)) for k, shape in
               names.items()}
    quant = served.ServerQuant("int4", "rtn", group_size)
    stored = served.quantize_layer(weights, quant)
    apart = {k: v for k, v in stored.items() if not k.endswith("layernorm.weight")}
    apart.update({f"{norm}.mix": torch.linalg.qr(torch.randn(d, d, generator=g))[0] for norm in NORM_FEEDS})
    adapt_quant, adapt_mix = served.adapter(quant), use_mixed_norms(config)

    def both(layer):
        adapt_quant(layer)
        adapt_mix(layer)

    stacks = {"folded": LayerStack(config, 0, [stored], dtype=dtype, adapt_layer=adapt_quant),
              "gains apart": LayerStack(config, 0, [apart], dtype=dtype, adapt_layer=both)}
    caches = {name: stack.new_cache(context + reps + 4) for name, stack in stacks.items()}
    for name, stack in stacks.items():
        stack(torch.randn(context, d, generator=g), caches[name])
    x = torch.randn(1, d, generator=g)
    times = {name: [] for name in stacks}
    for rep in range(reps + 2):
        for name in (list(stacks) if rep % 2 else list(stacks)[::-1]):
            t = time.perf_counter()
            stacks[name](x, caches[name])
            if rep >= 2:
                times[name].append(time.perf_counter() - t)
            caches[name].truncate(1)
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    sizes = {name: served.weight_bytes(stack) for name, stack in stacks.items()}
    return {"shape": shape, "bytes": sizes, "step_seconds": med,
            "bytes_ratio": sizes["gains apart"] / sizes["folded"], "step_ratio": med["gains apart"] / med["folded"]}


# -- what fits where ---------------------------------------------------------------------------------------------
SHAPES = {  # served layers = all but the client's first
    "Llama-3-8B": dict(hidden=4096, ffn=14336, layers=32, heads=32, kv_heads=8, head_dim=128),
    "Llama-3-70B": dict(hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8, head_dim=128),
}
GPUS_GB = (24, 48, 80, 141)
OVERHEAD_GB = 2.0  # CUDA context, activations of a batch, attention workspace


def served_bytes(shape: dict, mode: str, group_size: int = 64) -> float:
    """Bytes of a model's served layers (all but one) in `mode`: bfloat16, int8 (a float32 scale per row), or
    int4 (a bf16 scale and zero per group) with the default linears (k and v) kept in int8."""
    d, f, kv = shape["hidden"], shape["ffn"], shape["kv_heads"] * shape["head_dim"]
    q = shape["heads"] * shape["head_dim"]
    linears = {"self_attn.q_proj": (q, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
               "self_attn.o_proj": (d, q), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
               "mlp.down_proj": (d, f)}  # (out, in)
    per_layer = 2 * 2 * d  # two norms
    for name, (n, k) in linears.items():
        scheme = "int8" if mode == "int4" and name in served.DEFAULT_INT8_LINEARS else mode
        per_layer += {"bfloat16": 2 * n * k, "int8": n * k + 4 * n, "int4": n * k / 2 + 4 * n * k / group_size}[scheme]
    return per_layer * (shape["layers"] - 1)


def kv_bytes_per_token(shape: dict, itemsize: int = 2) -> float:
    return (shape["layers"] - 1) * 2 * shape["kv_heads"] * shape["head_dim"] * itemsize


def fits_table(context: int = 8192, group_size: int = 64) -> str:
    """Sessions of `context` tokens that fit beside the served weights on one GPU, by model, mode and GPU size."""
    lines = ["| model | served layers | weights GB | KV per session GB | " + " | ".join(f"sessions on {g} GB" for g in GPUS_GB)
             + " |", "|---|---|---:|---:|" + "---:|" * len(GPUS_GB)]
    for name, shape in SHAPES.items():
        kv = kv_bytes_per_token(shape) * context / 1e9
        for mode in ("bfloat16", "int8", "int4"):
            weights = served_bytes(shape, mode, group_size) / 1e9
            cells = []
            for gpu in GPUS_GB:
                sessions = int((gpu - OVERHEAD_GB - weights) // kv) if gpu - OVERHEAD_GB > weights else 0
                cells.append(f"{sessions}" if sessions > 0 else "does not fit")
            label = f"int4 g={group_size}" if mode == "int4" else mode
            lines.append(f"| {name} | {label} | {weights:.1f} | {kv:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/studies/server_quant.py",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    methods = sub.add_parser("methods", help="every method x mode x arrangement on a model (float32 arithmetic)")
    methods.add_argument("--model", help="a .gguf file, checkpoint directory or Hub id (default: packaged SmolLM2)")
    methods.add_argument("--text", type=Path, nargs="+", default=None,
                         help="held texts (default: the Genesis excerpt, and the GPL-3 licence where installed)")
    methods.add_argument("--tokens", type=int, default=TEXT_TOKENS)
    methods.add_argument("--json", type=Path, help="also write every cell here")
    methods.add_argument("--groups", type=int, nargs="+", default=[32, 64, 192])
    methods.add_argument("--kv-groups", type=int, nargs="*", default=[64],
                         help="int4 group sizes also measured with k_proj and v_proj in int8 (none: leave out)")
    methods.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    methods.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    methods.add_argument("--schemes", nargs="+", choices=["int8", "int4"], default=["int8", "int4"])
    methods.add_argument("--threads", type=int, default=None)
    methods.add_argument("--write", type=Path, nargs="?", const=DEFAULT_DOC, metavar="PATH")
    table = sub.add_parser("table", help="one table from the --json files of several `methods` runs")
    table.add_argument("json", type=Path, nargs="+")
    table.add_argument("--write", type=Path, nargs="?", const=DEFAULT_DOC, metavar="PATH")
    cost = sub.add_parser("gains-apart-cost", help="bytes and decode step of one int4 layer with the gains apart")
    cost.add_argument("--shape", choices=list(SHAPES), default="Llama-3-8B")
    fits = sub.add_parser("fits", help="sessions that fit beside the served weights on one GPU (arithmetic)")
    fits.add_argument("--context", type=int, default=8192)
    fits.add_argument("--group-size", type=int, default=64)
    fits.add_argument("--write", type=Path, nargs="?", const=REPO / "README.md", metavar="PATH",
                      help="also put the table between the server-quant-fits markers of PATH (default: README.md)")
    args = parser.parse_args(argv)
    if args.command == "fits":
        table = fits_table(args.context, args.group_size)
        print(table)
        if args.write:
            write_block(args.write, table, *FITS_MARKERS)
        return 0
    if args.command == "table":
        return table_command(args)
    if args.command == "gains-apart-cost":
        print(json.dumps(gains_apart_cost(args.shape), indent=1))
        return 0
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    from infemeral.cloak.sources import load_model

    model, tokenizer = load_model(args.model, hub=True)
    ref = Reference.from_transformers(model, tokenizer)
    del model
    paths = {p.name: p for p in args.text} if args.text else held_texts()
    texts = {name: tokenizer(path.read_text(), add_special_tokens=False)["input_ids"][:args.tokens]
             for name, path in paths.items()}
    modes = [m for m in default_modes(tuple(args.groups), tuple(args.kv_groups))
             if m.method in args.methods and m.scheme in args.schemes]
    name = args.model or "packaged SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32)"

    def save(base: dict, cells: list[Cell]) -> None:  # after every cell: a long run that is stopped keeps its cells
        if args.json:
            tokens = {k: len(v) for k, v in texts.items()}
            args.json.write_text(json.dumps({"model": name, "tokens": tokens, "base": base,
                                             "cells": [asdict(c) for c in cells]}, indent=1))

    base, cells = measure_methods(ref, texts, modes, tuple(args.rows), progress=lambda s: print(s, file=sys.stderr),
                                  on_cell=save)
    body = methods_report(name, {k: len(v) for k, v in texts.items()}, base, cells)
    print(body)
    if args.write:
        write_block(args.write, body)
    return 0


def methods_report(model: str, tokens: dict[str, int], base: dict[str, float], cells: list[Cell]) -> str:
    texts = ", ".join(f"{k} (first {tokens[k]} tokens, float32 perplexity {base[k]:.3f})" for k in base)
    settings = (f"Model: {model}. Texts: {texts}. Cells: perplexity with every served layer quantised, over "
                f"float32's (on each text, '/'-separated, in that order). Quantising every served layer took "
                f"{min(c.seconds for c in cells):.0f} to {max(c.seconds for c in cells):.0f} s a cell.")
    return settings + "\n\n" + methods_table(cells)


def table_command(args) -> int:
    """Merge the --json files of several `methods` runs (e.g. one per row, run side by side) into one table."""
    runs = [json.loads(path.read_text()) for path in args.json]
    bases = [r["base"] for r in runs]
    if any(b.keys() != bases[0].keys() or any(abs(b[k] - bases[0][k]) > 1e-6 * bases[0][k] for k in b)
           for b in bases):
        raise ValueError("these runs measured different texts or models (their float32 perplexities differ)")
    cells = [Cell(**c) for r in runs for c in r["cells"]]
    order = {row: i for i, row in enumerate(ROWS)}
    cells.sort(key=lambda c: order[c.row])
    body = methods_report(runs[0]["model"], runs[0]["tokens"], bases[0], cells)
    print(body)
    if args.write:
        write_block(args.write, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
