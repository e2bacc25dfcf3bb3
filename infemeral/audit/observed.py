"""Exactly what the pod sees of a prompt: the hidden states it receives and the keys/values it keeps.

The hidden states come out of the client's own code path: the chat template as the
SDK renders a turn, `ClientModel.cloak` (embedding, the local layers, times Q) in
the SDK's step sizes, through the wire's encoding as the pod decodes it (an 8-bit
wire's rounding included). The keys/values are what the first
served layer writes into the pod's KV cache for those states, computed with the
server bundle's rotated weights the way the server runs them (`LayerStack` over a
KV cache). The attacks then work on these tensors and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infemeral.client_half.half import ClientModel
from infemeral.cloak.bundle import DTYPES, ServerBundle
from infemeral.errors import InvalidArgument
from infemeral.kvcache.prefix import common_prefix
from infemeral.protocol.tensors import from_proto, to_proto
from infemeral.quant.served import load_stack
from infemeral.server.config import EngineConfig

# A fresh session sends its prompt in steps of at most the server's max_step_tokens.
STEP_TOKENS = EngineConfig.max_step_tokens


@dataclass
class Observation:
    """One prompt as the server receives it."""

    token_ids: list[int]
    user_positions: range  # the user's own message inside the chat template
    hidden: torch.Tensor   # [n, d] in the secret basis, as the pod decodes the wire

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def render(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a turn as the SDK renders it (chat template with the generation prompt)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def user_positions(tokenizer, messages: list[dict]) -> range:
    """Where the last message's own text sits: what differs from the same turn with that message empty."""
    full = render(tokenizer, messages)
    empty = render(tokenizer, messages[:-1] + [{**messages[-1], "content": ""}])
    start = common_prefix(full, empty)
    end = len(full) - common_prefix(full[start:][::-1], empty[start:][::-1])
    return range(start, end)


def on_the_wire(hidden: torch.Tensor, wire: str) -> torch.Tensor:
    """`hidden` [n, d] as the pod receives it over a wire of dtype `wire` (a WIRE_NAMES entry): encoded as the
    client sends it and decoded as the server does."""
    return from_proto(to_proto(hidden, wire), hidden.shape[1], hidden.shape[0], "observed")


def observe(model: ClientModel, tokenizer, messages: list[dict], wire: str = "float32",
            step_tokens: int = STEP_TOKENS) -> Observation:
    """Run the client half on a fresh session's prompt and return what the pod receives over `wire`."""
    ids = render(tokenizer, messages)
    context = model.config.max_position_embeddings
    if len(ids) > context:
        raise InvalidArgument(f"the prompt is {len(ids)} tokens with the chat template, longer than the model's "
                              f"context of {context}; audit a shorter prompt")
    cache = model.new_cache()
    sent = [on_the_wire(model.cloak(ids[i:i + step_tokens], cache), wire) for i in range(0, len(ids), step_tokens)]
    return Observation(ids, user_positions(tokenizer, messages), torch.cat(sent))


@torch.inference_mode()
def served_keys_values(server: ServerBundle, hidden: torch.Tensor,
                       step_tokens: int = STEP_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [kv_heads, n, head_dim] the first served layer keeps for `hidden` (received states)."""
    first = server.first_layer
    # as the server runs it (quantised layers through their kernels)
    stack = load_stack(server, DTYPES[server.manifest["dtype"]], layers=range(first, first + 1))
    cache = stack.new_cache(hidden.shape[0])
    for i in range(0, hidden.shape[0], step_tokens):
        stack(hidden[i:i + step_tokens], cache)
    keys, values = cache.layer_tensors(0)
    return keys.float(), values.float()
