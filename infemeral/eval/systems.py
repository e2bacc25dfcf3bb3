"""The systems evaluations compare (`infemeral.eval.metrics.System`): plain transformers, and the split
(a client half and served layers, from a user's bundles or built in memory)."""

from __future__ import annotations

from pathlib import Path

import torch

from infemeral.layers import architecture
from infemeral.quant import served


def load_model(spec: str | Path | None = None, dtype: torch.dtype = torch.float32, *, hub: bool = False,
               what: str = "model"):
    """A causal LM (in eval mode) and its tokenizer: the packaged SmolLM2 (None or 'default'), a .gguf file, a local
    checkpoint directory, or with `hub` a Hub id. Without `hub` nothing is downloaded, and a path that is not there
    is a FileNotFoundError naming `what` was asked for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infemeral.cloak.sources import DEFAULT_MODEL, default_gguf_path, require_gguf

    path = default_gguf_path() if spec is None or str(spec) == DEFAULT_MODEL else Path(spec).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        require_gguf()
        kwargs, where = dict(gguf_file=path.name), path.parent
    elif path.is_dir():
        kwargs, where = dict(local_files_only=True), path
    elif path.exists():
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")
    elif hub and path.suffix != ".gguf":
        kwargs, where = {}, str(spec)
    else:
        raise FileNotFoundError(f"{what} not found: {path} (give a local model directory or .gguf file"
                                f"{', or a Hub id' if hub else ''})")
    model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    return model, tokenizer


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
