"""The client's settings, from flags and INFEMERAL_* environment variables (pydantic-settings).

The command line reads all of them; the SDK's `Client` reads the defaults of
its client bundle and of how the laptop's half computes from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from infemeral.paths import DATA_HOME

if TYPE_CHECKING:  # sampling.py imports torch; the command line reads these settings for --help without it
    from infemeral.client.sampling import SamplingParams


class ClientSettings(BaseSettings):
    """Client configuration; every field can be set as INFEMERAL_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="INFEMERAL_", extra="ignore")

    server: str = Field("127.0.0.1:50051", description="server address host:port")
    client_bundle: Path = Field(DATA_HOME / "bundles" / "default" / "client", description="client bundle directory")
    sessions_dir: Path = Field(DATA_HOME / "sessions", description="where named chat sessions are saved")
    timeout: float = Field(600.0, description="seconds one turn may take")
    tls_ca: Path | None = Field(None, description="CA or the server's own certificate (PEM) to trust: turns TLS on")
    tls_client_cert: Path | None = Field(None, description="client certificate (PEM) for mutual TLS")
    tls_client_key: Path | None = Field(None, description="client private key (PEM) for mutual TLS")
    tls_server_name: str | None = Field(None, description="name to check in the server certificate "
                                                          "(default: the host in --server)")
    api_key: str | None = Field(None, description="API key the server asks for (on the command line `ps` shows "
                                                  "it: prefer the environment or --api-key-file)")
    api_key_file: Path | None = Field(None, description="file holding the API key the server asks for (its first "
                                                        "line); read when --api-key is not given")
    client_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the laptop's half (auto: the bundle's; bfloat16 with int8 weights)")
    client_device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="where the laptop's half runs (auto: cuda, else mps, else cpu)")
    client_quant: Literal["auto", "none", "int8"] = Field(
        "auto", description="int8: int8 weight-only LM head and local layers (auto: what the bundle holds)")
    wire: Literal["server", "int8", "int8-up", "e4m3", "e4m3-up"] = Field(
        "server", description="how hidden states travel. server: in the server's dtype both ways (float32, the "
                              "exact path, on a float32 server); int8: 8-bit integers with a scale per token both "
                              "ways (half of bfloat16's bytes; close, not exact); int8-up: 8-bit uploads (the "
                              "prompt), answers in the server's dtype; e4m3, e4m3-up: the same with 8-bit floats "
                              "(coarser on these hidden states)")
    max_new_tokens: int = Field(256, ge=1, description="most tokens to generate per answer")
    temperature: float = Field(0.0, ge=0, description="sampling temperature; 0 is greedy")
    top_k: int = Field(0, ge=0, description="sample from the k most likely tokens (0: off)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (1: off)")
    repetition_penalty: float = Field(1.0, gt=0, description="penalty for tokens already in the context (1: off)")
    seed: int | None = Field(None, ge=-(1 << 63), le=(1 << 64) - 1,  # sampling.SEED_MIN/MAX
                             description="random seed for reproducible sampling")
    stop: list[str] = Field(default_factory=list, description="stop strings; repeat the flag for several (env: a JSON list)")
    speculate: Literal["auto", "ngram", "draft", "head", "off"] = Field(
        "auto", description="speculative decoding: where draft tokens come from. auto: whichever available source "
                            "measures fastest on this link, step by step (the conversation and earlier answers, "
                            "a draft head, a draft model); ngram: the conversation and earlier answers; draft: also "
                            "a local draft model (--draft-model); head: a draft head (--draft-head); off. The "
                            "output is the same")
    max_draft: int = Field(8, ge=0, description="most drafted tokens verified per round trip (the count adapts "
                                                "below it)")
    draft_model: Path | None = Field(None, description="local model directory or .gguf file that drafts for "
                                                       "--speculate draft; must use the served model's tokenizer")
    draft_head: Path | None = Field(None, description="draft head directory (EAGLE layout; `infemeral-client "
                                                      "train-drafter` writes one) for --speculate head or auto; "
                                                      "auto also uses draft-head/ beside the client bundle if there")
    answer_index: bool = Field(True, description="remember this client's answers (token ids, in an owner-only "
                                                 "file under --answer-index-dir) to draft from them later")
    answer_index_dir: Path = Field(DATA_HOME / "answers", description="where the answer index is kept")
    answer_index_tokens: int = Field(262_144, ge=1, description="most answer tokens the index keeps (oldest "
                                                                "answers are forgotten first)")

    chat_history: str = Field(str(DATA_HOME / "chat_history"),
                              description="file the chat prompt keeps its line history in, owner-only ('': none)")

    @model_validator(mode="after")
    def _api_key_from_file(self) -> "ClientSettings":
        if self.api_key is None and self.api_key_file is not None:
            path = self.api_key_file.expanduser()
            try:
                lines = [line.strip() for line in path.read_text().splitlines()]
            except OSError as e:
                raise ValueError(f"--api-key-file {path}: {e.strerror}") from None
            keys = [line for line in lines if line and not line.startswith("#")]
            if not keys:
                raise ValueError(f"--api-key-file {path} holds no API key")
            self.api_key = keys[0]
        return self

    def connection(self) -> dict:
        """How a `Client` or a `ServerLink` reaches the server: their keyword arguments beside the address and
        the client bundle."""
        return dict(timeout=self.timeout, tls_ca=self.tls_ca, tls_client_cert=self.tls_client_cert,
                    tls_client_key=self.tls_client_key, tls_server_name=self.tls_server_name, api_key=self.api_key)

    def sampling(self, model_defaults: dict | None = None) -> SamplingParams:
        """Sampling parameters from these settings. `model_defaults` (the model's generation config, see
        `sampling.generation_defaults`) replaces the settings' own defaults, not values given by flag or env."""
        from infemeral.client.sampling import SamplingParams

        chosen = {name: getattr(self, name) for name in ("max_new_tokens", "temperature", "top_k", "top_p",
                                                          "repetition_penalty", "seed")}
        chosen.update({k: v for k, v in (model_defaults or {}).items() if k not in self.model_fields_set})
        return SamplingParams(stop=list(self.stop), speculate=self.speculate, max_draft=self.max_draft, **chosen)
