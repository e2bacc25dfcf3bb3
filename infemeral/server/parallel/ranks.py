"""How many ranks serve, and whether this model and machine allow them: read from the settings, the model's
config and the GPU count alone, so that the server refuses a wrong count before the model's code is imported."""

from __future__ import annotations

import math

import torch

from infemeral.devices import resolve_device
from infemeral.server.parallel.group import torchrun_rank


def rank_count(setting: int) -> int:
    """How many ranks serve: the setting, or torchrun's WORLD_SIZE when torchrun started this process and the
    setting was left at 1."""
    launch = torchrun_rank()
    return launch.world if launch is not None and setting == 1 else setting


def valid_rank_counts(config) -> list[int]:
    """Rank counts the model's head counts divide by."""
    g = math.gcd(config.num_attention_heads, config.num_key_value_heads)
    return [n for n in range(1, g + 1) if g % n == 0]


def check_divisible(config, world: int) -> None:
    """Refuse, in one line, a rank count that the attention or KV heads do not divide by."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if world < 1 or heads % world or kv % world:
        counts = ", ".join(str(n) for n in valid_rank_counts(config))
        raise ValueError(f"tensor parallelism over {world} ranks needs head counts that divide by {world}, and "
                         f"this model has {heads} attention heads and {kv} KV heads; use one of: {counts}")


def check(model_config, device: str, world: int) -> str:
    """Whether `world` ranks can serve this model here (a one-line ValueError if not); their device kind."""
    check_divisible(model_config, world)
    return device_kind(device, world)


def device_kind(device: str, world: int) -> str:
    """cpu or cuda for every rank, or a one-line refusal."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"with tensor parallelism the ranks take cuda:0..N-1 (or the CPU); set device to cuda, cpu "
                         f"or auto, not {device!r} (CUDA_VISIBLE_DEVICES chooses the GPUs)")
    kind = resolve_device(device).type
    if kind == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor parallelism over {world} ranks needs {world} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    return kind
