"""The served layers over the shared page pool: runs a batch of steps, decides nothing.

Given the caches of several sessions and each one's new hidden states, it
builds the paged batch (CSR block tables, write slots, positions), runs every
served layer once over all new positions together, and returns each step's
last outputs. Which steps run, and with what pages, the scheduler decided.

Huge but finite inputs (float16's 65504 everywhere, 3e38 sent to a bfloat16
server) can overflow inside the layers. Such a step's outputs, and the keys
and values it wrote, are unusable, so the runner reports it instead of
returning them; every other step in the batch is independent of it (each
session attends only to its own pages) and is answered as usual.
"""

from __future__ import annotations

import logging

import torch

from infemeral.cloak.bundle import ServerBundle
from infemeral.devices import resolve_device, resolve_dtype
from infemeral.kvcache.paged import KVPages, PagedBatch, PagedSequence, PagePool
from infemeral.kvcache.window import rope_shift_frequencies
from infemeral.layers.stack import head_dim
from infemeral.layers.attention_backends.selector import select_backend
from infemeral.layers.plain_decoder import layer_window
from infemeral.quant.served import ServerQuant, kernels_in_use, load_stack
from infemeral.server import self_check
from infemeral.server.config import EngineConfig

log = logging.getLogger(__name__)


def served_window(bundle: ServerBundle) -> int | None:
    """The sliding window the served layers attend with (None: every one attends to its whole cache)."""
    layers = range(bundle.first_layer, bundle.first_layer + bundle.num_layers)
    return min({layer_window(bundle.config, i) for i in layers} - {None}, default=None)


class LayerRunner:
    def __init__(self, bundle: ServerBundle, config: EngineConfig):
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.quant = ServerQuant.from_manifest(bundle.manifest)
        # On a GPU, one served layer is checked against float32 on the CPU before the rest load.
        use_kernels = self_check.checked_kernels(bundle, self.dtype, self.device) if self.device.type == "cuda" else True
        self.layers = load_stack(bundle, self.dtype, self.device, use_kernels)
        if self.quant.is_quantized:
            log.info("served layers %s; linears by kernel: %s", self.quant.describe(),
                     ", ".join(f"{kind} {n}" for kind, n in kernels_in_use(self.layers).items()))
        model = bundle.config
        self.sliding_window = served_window(bundle)
        window = config.window
        self.inv_freq = (rope_shift_frequencies(self.layers.rotary, model, window.max_context)
                         if window.enabled else None)  # pure RoPE angles, for re-keying after evictions
        self.pool = PagePool(config.num_pages, window.page_size, max_waiting=config.max_waiting_turns)
        self.kv = self.new_kv_pages(config.num_pages, window.page_size, bundle.first_layer, bundle.num_layers,
                                    model.num_key_value_heads, head_dim(model), self.dtype, self.device)
        self.backend = select_backend(config.attention_backend, self.device, model.num_attention_heads,
                                      model.num_key_value_heads, head_dim(model), window.page_size, self.dtype)
        if self.device.type == "cuda":
            self.backend = self_check.checked_attention(config.attention_backend, self.backend, self.device,
                                                        model.num_attention_heads, model.num_key_value_heads,
                                                        head_dim(model), window.page_size, self.dtype,
                                                        self.sliding_window)

    def run(self, caches: list[PagedSequence], hidden: list[torch.Tensor], num_outputs: list[int],
            trees: list[list[int] | None] | None = None) -> list[torch.Tensor | None]:
        """Append each step's positions to its cache; return its last `num_outputs` residuals, on the CPU,
        or None for a step whose activations overflowed to inf/NaN anywhere (outputs or keys/values). `trees`:
        per step, the parents of the draft tree its positions form (None: a chain)."""
        batch = PagedBatch(self.kv, caches, [h.shape[0] for h in hidden], self.backend, trees)
        out = self.forward(torch.cat([h.to(self.dtype) for h in hidden]), batch)  # [sum n_i, d]
        ends = batch.qo_indptr.tolist()[1:]
        is_finite = self._finite_steps(batch, out, [0] + ends)
        rows = [row for end, k in zip(ends, num_outputs) for row in range(end - k, end)]
        # One copy to the host for the whole batch: on a GPU each copy waits for the device.
        answers = out.index_select(0, torch.tensor(rows, device=out.device)).to("cpu")
        # each session's rows in a tensor of its own
        return [a.clone() if ok else None for a, ok in zip(answers.split(num_outputs), is_finite)]

    @property
    def draft_trees(self) -> bool:
        """Whether steps may carry draft trees: the backend takes a tree mask and no served layer attends with a
        sliding window (a tree's mask and a window do not combine)."""
        return bool(getattr(self.backend, "draft_trees", False)) and self.sliding_window is None

    def new_kv_pages(self, *args) -> KVPages:
        """The keys and values in the pages (a tensor-parallel runner's send their reads and writes to the other
        ranks)."""
        return KVPages(*args)

    def forward(self, hidden: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """The served layers over one batch (a tensor-parallel runner first hands the batch to the other ranks)."""
        return self.layers.forward_batch(hidden, batch)

    def _finite_steps(self, batch: PagedBatch, out: torch.Tensor, bounds: list[int]) -> list[bool]:
        """Per step: every output row of every new position is finite, and so is every key and value the step
        wrote. The keys and values are screened through one sum per layer; only a batch that fails the
        screen is read back step by step."""
        rows = torch.isfinite(out).all(dim=-1).cpu()  # [sum n_i]
        is_finite = [bool(rows[start:end].all()) for start, end in zip(bounds, bounds[1:])]
        if batch.kv_sums and not bool(torch.isfinite(torch.stack(batch.kv_sums)).all()):
            for i, (seq, n) in enumerate(zip(batch.sequences, batch.new_tokens)):
                is_finite[i] = is_finite[i] and all(
                    bool(torch.isfinite(t).all())
                    for slot in range(seq.num_layers) for t in seq.layer_tensors(slot, seq.length - n))
        return is_finite
