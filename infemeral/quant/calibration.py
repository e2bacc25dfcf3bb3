"""Calibration at prepare time: what each served linear reads on chat text, for GPTQ's Hessians.

Prepare holds the whole model on the laptop, one layer at a time, so it can run calibration text
through it as it goes: embed the text, run the client's layers, rotate into the secret basis, and
then for each served layer collect the inputs of its linears (H = XᵀX per input), quantise the
layer, and run the text on through the *quantised* layer, so later layers are calibrated on what
they will really receive (GPTQ's sequential order). Everything stays in this process; only the
quantised weights are written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import cache
from importlib import resources

import torch
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from infemeral.layers.stack import LayerStack
from infemeral.quant.gptq import ONE_THREAD_ELEMENTS
from infemeral.threads import one_thread

# Linears that read the same input share one Hessian: the first of each group is hooked.
INPUT_GROUPS = {
    "self_attn.q_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


# The last conversations are never calibrated on: prepare's agreement check reads them (quant/agreement.py).
HELD_CONVERSATIONS = 3


@cache
def conversations() -> tuple[tuple[str, str], ...]:
    """The (user, assistant) pairs of the packaged calibration text (data/calibration.json): chat turns written for
    this project on many topics, prose, lists, code and numbers, like what the served layers will see. None is used
    for evaluation: the perplexity text (infemeral/eval/data/) and the agreement prompts are on other subjects."""
    text = (resources.files("infemeral.quant") / "data" / "calibration.json").read_text(encoding="utf-8")
    return tuple((c["user"], c["assistant"]) for c in json.loads(text))


def calibration_ids(tokenizer, max_tokens: int | None = None) -> list[list[int]]:
    """One token sequence per calibration conversation, chat-templated when the tokenizer has a template."""
    return _chat_ids(tokenizer, conversations()[:-HELD_CONVERSATIONS], max_tokens)


def held_ids(tokenizer, max_tokens: int | None = None) -> list[list[int]]:
    """The held-out conversations, as calibration_ids reads the others: text that ships with the package and
    that no calibration has seen."""
    return _chat_ids(tokenizer, conversations()[-HELD_CONVERSATIONS:], max_tokens)


def _chat_ids(tokenizer, conversations, max_tokens: int | None) -> list[list[int]]:
    sequences, total = [], 0
    for user, assistant in conversations:
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
            ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        else:
            ids = tokenizer(f"User: {user}\nAssistant: {assistant}\n", add_special_tokens=True)["input_ids"]
        if max_tokens is not None:
            ids = ids[:max_tokens - total]
        if ids:
            sequences.append(ids)
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    return sequences


class Calibration:
    """Hidden states of the calibration sequences, carried through the model one layer at a time."""

    def __init__(self, config: PretrainedConfig, hidden: list[torch.Tensor], adapt_layer=None):
        self.config = config
        self.hidden = [h.to(torch.float32) for h in hidden]
        self.adapt_layer = adapt_layer  # LayerStack's hook, for layers arranged differently from the model's own
        # a bar (stderr) over the sequences of each pass: a layer's two passes take seconds each on a laptop's CPU,
        # so without it the first served layer's work passes in silence
        self.progress = False

    @classmethod
    def from_tokens(cls, config: PretrainedConfig, embedding: torch.Tensor,
                    sequences: list[list[int]]) -> "Calibration":
        return cls(config, [embedding[torch.tensor(ids)].float() for ids in sequences])

    @property
    def num_tokens(self) -> int:
        return sum(h.shape[0] for h in self.hidden)

    def rotate(self, basis: torch.Tensor) -> None:
        """Move the hidden states into the secret basis (x -> xQ), as the client does before sending."""
        q = basis.to(torch.float32)
        self.hidden = [h @ q for h in self.hidden]

    def _run(self, index: int, weights: Mapping[str, torch.Tensor], hooks: dict | None = None,
             phase: str = "calibration text through") -> list[torch.Tensor]:
        stack = LayerStack(self.config, index, [weights], dtype=torch.float32, adapt_layer=self.adapt_layer)
        handles = []
        for name, h in (hooks or {}).items():
            def accumulate(_module, args, h=h):
                x = args[0].reshape(-1, args[0].shape[-1]).to(torch.float32)
                h.addmm_(x.T, x)
            handles.append(stack.layers[0].get_submodule(name).register_forward_pre_hook(accumulate))
        small = self.config.hidden_size * self.config.intermediate_size <= ONE_THREAD_ELEMENTS
        try:
            # short sequences through a small layer: threads cost more than they save (on 2 busy shared cores, a
            # layer of the default model's shape over 20 sequences of 150 tokens: 54 s on two threads, 5.4 s on one)
            with one_thread(small):
                sequences = tqdm(self.hidden, desc=f"layer {index}: {phase}", unit="seq", leave=False,
                                 disable=not self.progress)
                return [stack(h, stack.new_cache(capacity=h.shape[0])) for h in sequences]
        finally:
            for handle in handles:
                handle.remove()

    def hessians(self, index: int, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """XᵀX of each linear's input over the calibration tokens, running layer `index` with `weights`."""
        sums = {}
        for first in INPUT_GROUPS:
            k = weights[f"{first}.weight"].shape[1]
            sums[first] = torch.zeros(k, k, dtype=torch.float32)
        self._run(index, weights, sums, phase="calibration inputs (Hessians)")
        return {name: sums[first] for first, names in INPUT_GROUPS.items() for name in names}

    def advance(self, index: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Run the calibration states through layer `index` with `weights` (e.g. the quantised ones)."""
        self.hidden = self._run(index, weights)

    def advance_stack(self, first: int, layers: list[Mapping[str, torch.Tensor]]) -> None:
        """Run them through consecutive layers (the client's own, plain, before the rotation)."""
        adapt, self.adapt_layer = self.adapt_layer, None
        try:
            for i, weights in enumerate(layers):
                self.advance(first + i, weights)
        finally:
            self.adapt_layer = adapt
