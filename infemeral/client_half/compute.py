"""How the laptop's half computes: activation dtype, device, and full-precision or int8 weights.

The default follows the bundle: a float32 bundle runs in float32 on the CPU and stays token-identical
to plain transformers; lower precision, int8 weights and local accelerators trade that identity for
speed (their agreement is measured by `infemeral.eval.client_precision`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infemeral.cloak.bundle import DTYPES, dtype_name
from infemeral.devices import is_available, resolve_device
from infemeral.errors import FailedPrecondition, InfemeralError
from infemeral.quant.int8 import QUANT_MODES

DEVICES = ("auto", "cpu", "cuda", "mps")


@dataclass(frozen=True)
class ClientCompute:
    """How the client half computes: activation dtype, device, and whether its weights are int8."""

    dtype: torch.dtype
    device: torch.device
    quant: str  # "none" or "int8"

    def describe(self) -> str:
        weights = "int8 weights" if self.quant == "int8" else f"{dtype_name(self.dtype)} weights"
        return f"{dtype_name(self.dtype)} on {self.device}, {weights}"


CLIENT_AUTO = ("cuda", "mps", "cpu")  # the laptop's "auto": CUDA, else Apple's MPS, else the CPU


def _device(name: str) -> torch.device:
    if name.split(":")[0] not in DEVICES:
        raise ValueError(f"client device must be one of {', '.join(DEVICES)}, not {name!r}")
    device = resolve_device(name, CLIENT_AUTO)
    if not is_available(device.type):
        raise InfemeralError(f"client device {name!r} is not available to torch on this machine; "
                             "use --client-device cpu or auto")
    return device


def resolve_compute(stored_dtype: torch.dtype, stored_quant: str, dtype: str = "auto", device: str = "auto",
                    quant: str = "auto") -> ClientCompute:
    """Turn the requested settings ("auto" or a name) into a ClientCompute for a bundle stored as given.

    auto quant: what the bundle holds. auto dtype: the bundle's dtype; bfloat16 for int8 weights (the CPU
    int8 kernel is fast with bf16 activations). auto device: cuda, else mps, else cpu.
    """
    if quant not in ("auto", *QUANT_MODES):
        raise ValueError(f"client quant must be auto, none or int8, not {quant!r}")
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"client dtype must be auto, {', '.join(DTYPES)}, not {dtype!r}")
    quant = stored_quant if quant == "auto" else quant
    if quant == "none" and stored_quant == "int8":
        raise FailedPrecondition("this client bundle was prepared with --client-quant int8 and holds no "
                                 "full-precision weights; run with --client-quant int8 (or auto), or prepare the "
                                 "bundles again without --client-quant to get them back")
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if quant == "int8" else stored_dtype
    else:
        torch_dtype = DTYPES[dtype]
    return ClientCompute(torch_dtype, _device(device), quant)
