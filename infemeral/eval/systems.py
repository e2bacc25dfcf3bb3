"""The systems evaluations compare (`infemeral.eval.metrics.System`): plain transformers, and the split
(a client half and served layers, from a user's bundles or built in memory)."""

from __future__ import annotations

from pathlib import Path

import torch

from infemeral.layers import architecture
from infemeral.quant import served


class PlainReference:
    """Plain transformers (what the float32 split matches token for token)."""

    def __init__(self, model):
        self.model = model

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def logits(self, ids: list[int], cache) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([ids], device=self.model.device), use_cache=True,
                          **{architecture.cache_keyword(self.model): cache}).logits[0].float()


class Split:
    """A client half and the served layers: cloak on the client, the layers, logits on the client again."""

    def __init__(self, client, server):
        self.client, self.server = client, server

    def new_cache(self):
        return self.client.new_cache(), self.server.new_cache()

    @torch.inference_mode()
    def logits(self, ids: list[int], cache) -> torch.Tensor:
        client_cache, server_cache = cache
        out = self.server(self.client.cloak(ids, client_cache), server_cache)
        return self.client.logits(out.to(torch.float32))


class BundleSplit(Split):
    """A client bundle in float32 and a server bundle through its real layers (kernels and all)."""

    def __init__(self, client_dir: Path, server_dir: Path, dtype: torch.dtype = torch.float32,
                 device: str = "cpu"):
        from infemeral.client_half.half import ClientModel
        from infemeral.cloak.bundle import ClientBundle, ServerBundle

        client = ClientModel(ClientBundle.open(client_dir), dtype="float32", device="cpu")
        bundle = ServerBundle.open(server_dir)
        if bundle.fingerprint != client.bundle.server_fingerprint:
            raise ValueError(f"{server_dir} is not the server bundle {client_dir} was prepared with")
        self.quant = served.ServerQuant.from_manifest(bundle.manifest)
        super().__init__(client, served.load_stack(bundle, dtype, device))
