"""Quantised served layers: the scheme a server bundle records, how a layer is quantised, how it is run.

The pod's layers are folded and rotated (W·diag(γ)·Q for the readers of the residual stream, Qᵀ·W for
its writers, docs/design.md §1) before they are quantised; every linear of a served layer is quantised, the
gain-free norms and any biases stay in the bundle's dtype. Schemes:

* `int8`: one scale per output row, symmetric (int8.py; `aten._weight_int8pack_mm`);
* `int4`: groups of `group_size` input columns, a scale and a zero each (int4.py; torch's int4 kernels).

Methods choose the codes: `rtn` rounds to nearest on each group's min..max range; `hqq` fits each
group's zero point without data (hqq.py; int4 only, since int8's kernel has no zero point); `gptq`
calibrates on chat text at prepare time (gptq.py, calibration.py). The measurements behind the
defaults are in docs/server_quant.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from infemeral.layers.stack import head_dim
from infemeral.quant import int4, int8
from infemeral.quant.hqq import quantize_hqq

SCHEMES = ("none", "int8", "int4")
METHODS = ("rtn", "hqq", "gptq")
LINEARS = int8.QUANTIZED_LINEARS
# int8 rounds to nearest: within 1.01x of float32 for free, where GPTQ adds many minutes to prepare for ~0.1 %;
# int4 needs the calibration (docs/server_quant.md)
DEFAULT_METHOD = {"int8": "rtn", "int4": "gptq"}
DEFAULT_GROUP_SIZE = 64
# int4 keeps these in int8: the value projection alone, in int4, costs more than every other linear together
# (docs/server_quant.md), and k/v are a few percent of a layer's weights (GQA)
DEFAULT_INT8_LINEARS = ("self_attn.k_proj", "self_attn.v_proj")


@dataclass(frozen=True)
class ServerQuant:
    """How a server bundle's layers are quantised (`none`: not at all)."""

    scheme: str = "none"
    method: str | None = None
    group_size: int | None = None
    int8_linears: tuple[str, ...] | None = None  # int4 only: linears kept in int8 (None: the default ones)

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"server quantization must be one of {', '.join(SCHEMES)}, not {self.scheme!r}")
        if self.scheme == "none":
            if self.method is not None or self.group_size is not None or self.int8_linears:
                raise ValueError("a method or group size needs --server-quant int8 or int4")
            return
        method = self.method or DEFAULT_METHOD[self.scheme]
        if method not in METHODS:
            raise ValueError(f"quantization method must be one of {', '.join(METHODS)}, not {method!r}")
        if self.scheme == "int8":
            if method == "hqq":
                raise ValueError("hqq fits a zero point, which int8's per-row kernel does not have; use rtn or gptq")
            if self.group_size is not None or self.int8_linears:
                raise ValueError("int8 has one scale per output row (the kernel's format); --group-size is for int4")
            object.__setattr__(self, "method", method)
            return
        group = self.group_size or DEFAULT_GROUP_SIZE
        if group not in int4.KERNEL_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {', '.join(map(str, int4.KERNEL_GROUP_SIZES))} "
                             f"(what torch's int4 kernels take), not {group}")
        kept = DEFAULT_INT8_LINEARS if self.int8_linears is None else tuple(self.int8_linears)
        if not set(kept) <= set(LINEARS):
            raise ValueError(f"int8_linears must name linears of a layer ({', '.join(LINEARS)}), not {kept}")
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "group_size", group)
        object.__setattr__(self, "int8_linears", tuple(name for name in LINEARS if name in kept))

    def scheme_of(self, linear: str) -> str:
        """int8 or int4 for one linear of a layer (int4 bundles keep `int8_linears` in int8)."""
        return "int8" if self.scheme == "int8" or linear in (self.int8_linears or ()) else self.scheme

    @property
    def is_quantized(self) -> bool:
        return self.scheme != "none"

    @property
    def needs_calibration(self) -> bool:
        return self.method == "gptq"

    def describe(self) -> str:
        if not self.is_quantized:
            return "not quantized"
        group = f", groups of {self.group_size}" if self.group_size else ", one scale per row"
        kept = "".join(f", {n.rsplit('.', 1)[1]}" for n in self.int8_linears or ())
        return f"{self.scheme} ({self.method}{group}{kept + ' in int8' if kept else ''})"

    def to_manifest(self) -> dict | None:
        if not self.is_quantized:
            return None
        entry = {"scheme": self.scheme, "method": self.method}
        if self.group_size:
            entry["group_size"] = self.group_size
            entry["int8_linears"] = list(self.int8_linears)
        return entry

    @classmethod
    def from_manifest(cls, manifest: Mapping) -> "ServerQuant":
        """The scheme a server bundle's manifest records (bundles prepared before it existed: none)."""
        entry = manifest.get("server_quant") or {}
        kept = entry.get("int8_linears")
        return cls(entry.get("scheme", "none"), entry.get("method"), entry.get("group_size"),
                   tuple(kept) if kept is not None else None)

    def check_shapes(self, config: PretrainedConfig) -> None:
        """Refuse a group size that does not divide every served linear's input width."""
        if self.scheme != "int4":
            return
        widths = {config.hidden_size, config.intermediate_size, config.num_attention_heads * head_dim(config)}
        bad = sorted(w for w in widths if w % self.group_size)
        if bad:
            fits = [g for g in int4.KERNEL_GROUP_SIZES if all(w % g == 0 for w in widths)]
            raise ValueError(f"int4 group size {self.group_size} does not divide the layers' input widths "
                             f"{', '.join(map(str, bad))}; this model takes {', '.join(map(str, fits)) or 'none'}")


def quantize_linear(weight: torch.Tensor, scheme: str, method: str, group_size: int | None = None,
                    hessian: torch.Tensor | None = None, symmetric: bool = False) -> dict[str, torch.Tensor]:
    """One linear's stored tensors, named by suffix ("weight" + "scale" for int8; "qweight", "scales",
    "zeros" for int4). `symmetric` (int4 rtn only) is the textbook grid the measurements compare with."""
    from infemeral.quant import gptq

    w = weight.to(torch.float32)
    if method == "gptq" and hessian is None:
        raise ValueError("gptq needs the calibration Hessian of the linear's input")
    if scheme == "int8":
        codes, scales = gptq.quantize_gptq_int8(w, hessian) if method == "gptq" else int8.quantize_rows(w)
        return {"weight": codes, int8.SCALE_SUFFIX[1:]: scales}
    if method == "gptq":
        return gptq.quantize_gptq_int4(w, hessian, group_size)
    if method == "hqq":
        return quantize_hqq(w, group_size)
    return int4.quantize_rtn(w, group_size, symmetric)


def quantize_layer(weights: Mapping[str, torch.Tensor], quant: ServerQuant,
                   hessians: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """One served layer's tensors (float, folded and rotated) with every linear weight quantised."""
    out = {k: v for k, v in weights.items() if k not in {f"{name}.weight" for name in LINEARS}}
    for name in LINEARS:
        scheme = quant.scheme_of(name)
        tensors = quantize_linear(weights[f"{name}.weight"], scheme, quant.method,
                                  quant.group_size if scheme == "int4" else None,
                                  hessians[name] if hessians is not None else None)
        out.update({f"{name}.{key}": t for key, t in tensors.items()})
    return out


def dequantize_layer(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A stored layer (quantised or not) as plain float weights, e.g. for a reference or for calibration."""
    out = {}
    for key, t in tensors.items():
        if key.endswith((int4.SCALES, int4.ZEROS, int8.SCALE_SUFFIX)):
            continue
        if key.endswith(int4.QWEIGHT):
            prefix = key[:-len(int4.QWEIGHT)]
            out[prefix + ".weight"] = int4.dequantize(t, tensors[prefix + int4.SCALES], tensors[prefix + int4.ZEROS],
                                                      dtype)
        elif key.endswith(".weight") and t.dtype == torch.int8:
            prefix = key[:-len(".weight")]
            out[key] = int8.dequantize_rows(t, tensors[prefix + int8.SCALE_SUFFIX], dtype)
        else:
            out[key] = t.to(dtype)
    return out


def adapter(quant: ServerQuant, use_kernels: bool = True) -> Callable[[torch.nn.Module], None] | None:
    """LayerStack's `adapt_layer` for this scheme: swap a (meta-device) layer's linears for quantised ones."""
    if quant.scheme == "none":
        return None
    if quant.scheme == "int8" and use_kernels:
        return int8.use_int8_linears

    def swap(layer: torch.nn.Module) -> None:
        for name in LINEARS:
            parent_name, attr = name.rsplit(".", 1)
            parent = layer.get_submodule(parent_name)
            linear = getattr(parent, attr)
            with torch.device("meta"):
                if quant.scheme_of(name) == "int4":
                    setattr(parent, attr, int4.Int4Linear.like(linear, quant.group_size, use_kernels))
                else:
                    setattr(parent, attr, (int8.Int8Linear if use_kernels else DequantizedInt8Linear).like(linear))

    return swap


class DequantizedInt8Linear(int8.Int8Linear):
    """An Int8Linear that never uses the kernel: dequantises its weight on every call (after a failed self-check)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8.dequantized_matmul(x, self.weight, self.scale, self.bias)


def load_stack(bundle, dtype: torch.dtype, device: str | torch.device = "cpu", use_kernels: bool = True,
               layers: range | None = None):
    """The bundle's served layers (or the given range of them) as a LayerStack, quantised or not."""
    from infemeral.layers.stack import LayerStack

    quant = ServerQuant.from_manifest(bundle.manifest)
    layers = layers or range(bundle.first_layer, bundle.first_layer + bundle.num_layers)
    weights = [bundle.layer_weights(i) for i in layers]
    return LayerStack(bundle.config, layers.start, weights, dtype=dtype, device=device,
                      adapt_layer=adapter(quant, use_kernels))


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of every tensor a stack of layers holds (each storage once): what stays resident for its weights."""
    storages = {}
    for t in [*module.parameters(), *module.buffers()]:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def kernels_in_use(layers: torch.nn.Module) -> dict[str, int]:
    """How many of a stack's linears run on each kernel ("int8", "cpu", "cuda", "dequantize", "dense")."""
    counts: dict[str, int] = {}
    for module in layers.modules():
        if isinstance(module, int4.Int4Linear):
            kind = f"int4 {module.kernel}"
        elif isinstance(module, DequantizedInt8Linear):
            kind = "int8 dequantize"
        elif isinstance(module, int8.Int8Linear):
            kind = "int8 " + int8.kernel_in_use(module.weight.device.type, module.scale.dtype, module.in_features)
        elif isinstance(module, torch.nn.Linear):
            kind = "dense"
        else:
            continue
        counts[kind] = counts.get(kind, 0) + 1
    return counts
