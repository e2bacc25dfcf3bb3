"""The client's half of the model: everything that touches tokens.

Embedding, the first `client_layers` decoder layers (plain weights, their own
small KV cache), the secret basis, final norm and LM head. What leaves this
object for the server is only `hidden @ Q`; what comes back is un-rotated here.

It computes in a dtype, on a device and with weights in full precision or int8
as `compute.py` resolves them; its token tables are `tables.py`'s. On a CPU with
native bf16/fp16 kernels those dtypes run on packed weights (`packed.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from infemeral.client_half import packed
from infemeral.client_half.compute import resolve_compute
from infemeral.client_half.tables import DenseTokenTable, Int8TokenTable
from infemeral.cloak.bundle import ClientBundle, dtype_name
from infemeral.kvcache.cache import KVCache
from infemeral.layers import plain_decoder
from infemeral.layers.stack import LayerStack
from infemeral.quant import int8

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class ClientModel:
    """The client half of one model, computing as `compute` says; built from a client bundle or from tensors."""

    def __init__(self, bundle: ClientBundle, dtype: str | torch.dtype = "auto", device: str = "auto",
                 quant: str = "auto"):
        with safe_open(str(bundle.directory / "client.safetensors"), framework="pt") as f:
            self._build(bundle.config, bundle.client_layers, _LazyTensors(f), bundle.basis(), dtype, device, quant)
        self.bundle = bundle

    @classmethod
    def from_tensors(cls, config: PretrainedConfig, client_layers: int, tensors: Mapping[str, torch.Tensor],
                     basis: torch.Tensor, dtype: str | torch.dtype = "auto", device: str = "auto",
                     quant: str = "auto") -> "ClientModel":
        """A client half from tensors named as in a client bundle (benchmarks and evaluations build them in memory)."""
        self = cls.__new__(cls)
        self._build(config, client_layers, tensors, basis, dtype, device, quant)
        self.bundle = None
        return self

    def _build(self, config, client_layers, tensors, basis, dtype, device, quant) -> None:
        self.config = config
        stored_quant = "int8" if "embed_tokens.scale" in tensors else "none"
        dtype = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
        self.compute = resolve_compute(tensors["norm.weight"].dtype, stored_quant, dtype, device, quant)
        self.dtype, self.device = self.compute.dtype, self.compute.device
        is_int8 = self.compute.quant == "int8"
        self.packs = not is_int8 and packed.packs(self.device.type, self.dtype)
        per_layer = [self._layer_weights(tensors, i, stored_quant) for i in range(client_layers)]
        self.layers = LayerStack(config, 0, per_layer, dtype=self.dtype, device=self.device,
                                 adapt_layer=int8.use_int8_linears if is_int8 else None, plain=True)
        del per_layer
        if self.packs:
            packed.pack_linears(self.layers)
        self.embed = self._table(tensors, "embed_tokens", stored_quant)
        if "lm_head.weight" not in tensors:
            self.head = self.embed  # tied: one table (a packed one could not serve the embedding's lookups)
        elif self.packs:
            self.head = packed.PackedHead(tensors["lm_head.weight"].to(self.device, self.dtype))
        else:
            self.head = self._table(tensors, "lm_head", stored_quant)
        self.norm = plain_decoder.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)  # every family's own
        self.norm.weight.data = tensors["norm.weight"].to(self.device, self.dtype)
        self.norm.requires_grad_(False)
        self.basis = basis.to(self.device, self.dtype)
        self.inv_freq = self.layers.rotary.inv_freq.detach().cpu().to(torch.float64)  # pure RoPE angles for the window

    def _layer_weights(self, tensors, index: int, stored_quant: str) -> dict[str, torch.Tensor]:
        prefix = f"layers.{index}."
        weights = {name[len(prefix):]: tensors[name] for name in tensors.keys() if name.startswith(prefix)}
        if self.compute.quant == "int8" and stored_quant == "none":
            weights = int8.quantize_layer(weights)
        # int8 codes keep their dtype; LayerStack casts the float tensors (norms, scales, biases) to the compute dtype
        return {k: int8.aligned(v.to(self.device)) if v.dtype == torch.int8 else v for k, v in weights.items()}

    def _table(self, tensors, name: str, stored_quant: str):
        if self.compute.quant == "int8":
            if stored_quant == "int8":
                codes, scales = tensors[f"{name}.weight"], tensors[f"{name}{int8.SCALE_SUFFIX}"]
            else:
                codes, scales = int8.quantize_rows(tensors[f"{name}.weight"])
            return Int8TokenTable(codes, scales, self.dtype, self.device)
        return DenseTokenTable(tensors[f"{name}.weight"].to(self.device, self.dtype))

    @property
    def basis(self) -> torch.Tensor:
        """The secret basis Q in the compute dtype; `cloak` multiplies by Q, `logits` by Qᵀ."""
        return self._to_secret.matrix()

    @basis.setter
    def basis(self, q: torch.Tensor) -> None:
        self._to_secret, self._from_secret = packed.Projection(q), packed.Projection(q.T)

    def describe(self) -> str:
        """How this half computes, for `infemeral-client info`."""
        return self.compute.describe() + (" (packed for oneDNN)" if self.packs else "")

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def memory_bytes(self) -> int:
        """Bytes of every weight this client half holds (each storage counted once: a tied table once)."""
        tensors = [*self.layers.parameters(), *self.layers.buffers(), *self.embed.tensors(), *self.head.tensors(),
                   self.norm.weight, *self._to_secret.tensors(), *self._from_secret.tensors()]
        storages = {(id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()): packed.nbytes(t) for t in tensors}
        return sum(storages.values())

    def new_cache(self) -> KVCache:
        return self.layers.new_cache()

    @torch.inference_mode()
    def cloak(self, token_ids: list[int], cache: KVCache, parents: list[int] | None = None) -> torch.Tensor:
        """Embed new tokens, run the local layers, and rotate into the secret basis: [n, d]. With `parents` the
        tokens are a draft tree (layers/draft_tree.py)."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.layers(self.embed.lookup(ids), cache, parents)
        return self._to_secret(hidden)

    @torch.inference_mode()
    def logits(self, residual: torch.Tensor) -> torch.Tensor:
        """Un-rotate the server's final residual [n, d] and apply final norm and LM head: [n, vocab], float32 on CPU."""
        return self.project(self.features(residual))

    @torch.inference_mode()
    def features(self, residual: torch.Tensor) -> torch.Tensor:
        """Un-rotate the server's final residual [n, d] and apply the final norm: what the LM head reads (the
        feature a draft head drafts from), [n, d] in the compute dtype."""
        hidden = self._from_secret(residual.to(self.device, self.dtype))
        return self.norm(hidden.unsqueeze(0))[0]

    @torch.inference_mode()
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The LM head over `features` [n, d]: [n, vocab], float32 on CPU."""
        return self.head.project(features).float().cpu()


class _LazyTensors(Mapping):
    """A client bundle's tensors read one at a time, so loading never holds the file and its conversion at once."""

    def __init__(self, handle):
        self._handle = handle
        self._names = list(handle.keys())

    def __contains__(self, name) -> bool:  # without reading the tensor, as Mapping's default would
        return name in self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
