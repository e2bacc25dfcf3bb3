"""One throwaway turn through the served layers before the server says SERVING.

The first forward passes of a fresh process pay for the kernels' one-time set-up (the CPU's matmul and
attention kernels, CUDA's and FlashInfer's), which made the first user's first token many times slower
than any later one. A prefill of a few positions and one decode step, on the engine's own device, dtype,
attention backend and ranks, pay it at start instead. The turn touches no store and commits nothing.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from infemeral.errors import InfemeralError, StatusError
from infemeral.layers.attention_backends.torch_backend import MAX_PADDED_QUERY
from infemeral.server.engine import Engine
from infemeral.server.sessions import SESSION_ID_BYTES, SESSION_KEY_BYTES

log = logging.getLogger(__name__)

# Above the torch backend's padded-batch limit, so that a prompt's prefill (one SDPA of its own) and a decode
# step (a padded batch) both run once; FlashInfer's prefill and decode wrappers likewise.
PREFILL_TOKENS = MAX_PADDED_QUERY + 1


class WarmUpFailed(InfemeralError):
    """The served layers could not run a step at start: the server would fail every turn."""


def warm_up(engine: Engine) -> float:
    """Run a prefill of `PREFILL_TOKENS` random positions and one decode step; return the seconds it took."""
    started = time.perf_counter()
    turn = engine.claim_turn(os.urandom(SESSION_ID_BYTES), os.urandom(SESSION_KEY_BYTES), engine.bundle.fingerprint)
    try:
        turn.cache.grant(PREFILL_TOKENS + 1)
        generator = torch.Generator().manual_seed(0)
        for positions in (PREFILL_TOKENS, 1):
            hidden = torch.randn(positions, engine.hidden_size, generator=generator).to(engine.dtype)
            engine.submit_step(turn, hidden, turn.cache.length).result()
    except StatusError as e:
        raise WarmUpFailed(f"the served layers failed their first step at start: {e}") from None
    finally:
        engine.close_turn(turn)
    seconds = time.perf_counter() - started
    log.info("warmed up in %.2f s (a prefill of %d positions and a decode step)", seconds, PREFILL_TOKENS)
    return seconds
