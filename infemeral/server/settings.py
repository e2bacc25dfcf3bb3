"""Settings from flags and INFEMERAL_* environment variables (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DATA_HOME = Path.home() / ".local" / "share" / "infemeral"


class ServerSettings(BaseSettings):
    """Server configuration; every field can be set as INFEMERAL_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="INFEMERAL_", extra="ignore")

    bundle: Path = Field(DATA_HOME / "bundles" / "default" / "server", description="server bundle directory")
    listen: str = Field("127.0.0.1:50051", description="host:port to listen on")
    store: str = Field(str(DATA_HOME / "store"),
                       description="session store: a directory path, file:///path or redis://host:port/db")
    session_ttl_seconds: float = Field(7 * 24 * 3600, gt=0, description="sessions idle this long are deleted")
    device: str = Field("auto", description="cpu, cuda, cuda:N or auto")
    dtype: str = Field("auto", description="float32, bfloat16, float16 or auto (float32 on CPU, bfloat16 on CUDA)")
    max_step_tokens: int = Field(2048, ge=1, description="most tokens one step may carry")
    max_context: int = Field(8192, ge=1, description="most tokens a session's cache may hold (the window size)")
    window: bool = Field(True, description="slide a window over long conversations instead of refusing them")
    sink_tokens: int = Field(4, ge=0, description="first tokens the window always keeps (attention sinks)")
    page_size: int = Field(16, ge=1, description="tokens per KV page; the window evicts whole pages")
    max_sessions: int = Field(64, ge=1, description="most turns open at once")
    kv_pool_tokens: int = Field(65536, ge=1, description="KV cache pool size in tokens, shared by all open turns")
    max_batch_tokens: int = Field(8192, ge=1, description="most tokens one batched forward pass may carry")
    admission_wait: float = Field(10.0, ge=0, description="seconds a new turn waits for its KV page quota (and a "
                                                          "step past its quota for spare pages) before "
                                                          "RESOURCE_EXHAUSTED; at most half of max_sessions wait "
                                                          "at once, more are refused at once")
    default_reserve_tokens: int = Field(512, ge=1, description="tokens a turn that declares no reserve_tokens may "
                                                               "add within its KV page quota (past it, it grows "
                                                               "only into spare pages); the SDK always declares")
    max_sessions_per_key: int = Field(0, ge=0, description="most turns one API key may have open at once; more are "
                                                           "refused at once with RESOURCE_EXHAUSTED (0: half of "
                                                           "max_sessions when more than one API key is set, else no "
                                                           "limit; no API keys: no limit)")
    kv_pool_share_per_key: float = Field(0.0, ge=0, le=1, description="share of the KV pool the turns of one API key "
                                                                      "may hold, at least one max_context (0: half "
                                                                      "when more than one API key is set, else all; "
                                                                      "no API keys: all)")
    attention_backend: str = Field("auto", description="auto, torch or flashinfer (auto: FlashInfer on CUDA "
                                                       "when installed)")
    max_batch_hold: float = Field(0.0, ge=0, description="seconds a forward pass may wait for sessions about to "
                                                         "send their next step, so they share it (0: never wait; "
                                                         "e.g. 0.05 to try)")
    max_streams: int = Field(0, ge=0, description="most Turn streams open at once, turns not yet opened included; "
                                                  "more are refused at once with RESOURCE_EXHAUSTED "
                                                  "(0: four times max_sessions)")
    turn_idle_seconds: float = Field(30.0, gt=0, description="a turn whose client sends nothing for this long is "
                                                             "aborted (DEADLINE_EXCEEDED, nothing committed) and its "
                                                             "session and KV pages released; the SDK keeps busy "
                                                             "turns alive")
    max_turn_seconds: float = Field(3600.0, gt=0, description="a turn open longer than this is aborted the same way "
                                                              "(above the SDK's default 600 s turn deadline)")
    tensor_parallel: int = Field(1, ge=1, description="ranks the served layers are split over (tensor parallelism), "
                                                      "one per GPU (cuda:0..N-1; on a machine without CUDA, N CPU "
                                                      "processes): the attention and KV head counts must divide by "
                                                      "N; under torchrun, its WORLD_SIZE")
    tensor_parallel_timeout: float = Field(120.0, gt=0, description="seconds one tensor-parallel rank may keep the "
                                                                    "others waiting before it counts as lost: the "
                                                                    "open turns fail with UNAVAILABLE and the server "
                                                                    "exits with status 1 (for its supervisor to "
                                                                    "restart it)")
    workers: int = Field(8, ge=1, description="threads for session deletes (turns get one thread per "
                                              "max_sessions slot for their store I/O and encryption)")
    verify_bundle: bool = Field(True, description="check the bundle's file hashes at start-up")
    grace_seconds: float = Field(10.0, ge=0, description="how long SIGTERM waits for open turns")
    tls_cert: Path | None = Field(None, description="server certificate chain (PEM); with --tls-key turns TLS on")
    tls_key: Path | None = Field(None, description="server private key (PEM)")
    tls_client_ca: Path | None = Field(None, description="CA (PEM) that client certificates must chain to: "
                                                         "turns on mutual TLS")
    api_keys: str = Field("", description="comma-separated API keys clients must send (empty: no API key)")
    api_keys_file: Path | None = Field(None, description="file with one API key per line")
    allow_plaintext: bool = Field(False, description="allow plaintext gRPC on a non-loopback address")
    metrics_port: int = Field(9400, ge=0, description="Prometheus metrics port (0: off)")
    metrics_host: str = Field("127.0.0.1", description="address the metrics endpoint binds to")
    log_format: str = Field("text", description="text or json")

    def limits_per_key(self, num_api_keys: int) -> tuple[int, float]:
        """(turns, share of the KV pool) one API key may hold, given how many keys the server accepts:
        (0, 1.0), no limit, without keys (there is nothing to tell clients apart by: behind a proxy they share
        an address); half of each by default when there are several keys."""
        if num_api_keys == 0:
            return 0, 1.0
        several = num_api_keys > 1
        sessions = self.max_sessions_per_key or (max(1, self.max_sessions // 2) if several else 0)
        share = self.kv_pool_share_per_key or (0.5 if several else 1.0)
        return sessions, share

    def engine_config(self, num_api_keys: int = 0):
        """The engine's part of these settings, as one frozen `EngineConfig`."""
        from infemeral.kvcache.window import WindowPolicy
        from infemeral.server.config import EngineConfig

        sessions_per_key, share_per_key = self.limits_per_key(num_api_keys)
        return EngineConfig(device=self.device, dtype=self.dtype, max_step_tokens=self.max_step_tokens,
                            max_sessions=self.max_sessions,
                            window=WindowPolicy(self.max_context, self.sink_tokens, self.page_size,
                                                enabled=self.window),
                            kv_pool_tokens=self.kv_pool_tokens, max_batch_tokens=self.max_batch_tokens,
                            admission_wait=self.admission_wait, attention_backend=self.attention_backend,
                            max_batch_hold=self.max_batch_hold, default_reserve_tokens=self.default_reserve_tokens,
                            max_sessions_per_key=sessions_per_key, kv_pool_share_per_key=share_per_key)


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
    api_key: str | None = Field(None, description="API key the server asks for")
    client_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the laptop's half (auto: the bundle's; bfloat16 with int8 weights)")
    client_device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="where the laptop's half runs (auto: cuda, else mps, else cpu)")
    client_quant: Literal["auto", "none", "int8"] = Field(
        "auto", description="int8: int8 weight-only LM head and local layers (auto: what the bundle holds)")
    max_new_tokens: int = Field(256, ge=1, description="most tokens to generate per answer")
    temperature: float = Field(0.0, ge=0, description="sampling temperature; 0 is greedy")
    top_k: int = Field(0, ge=0, description="sample from the k most likely tokens (0: off)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (1: off)")
    repetition_penalty: float = Field(1.0, gt=0, description="penalty for tokens already in the context (1: off)")
    seed: int | None = Field(None, description="random seed for reproducible sampling")
    stop: list[str] = Field(default_factory=list, description="stop strings; repeat the flag for several (env: a JSON list)")
    speculate: Literal["ngram", "draft", "off"] = Field(
        "ngram", description="speculative decoding: draft tokens from the conversation (ngram), also from a "
                             "local draft model (draft, needs --draft-model), or off; the output is the same")
    max_draft: int = Field(8, ge=0, description="most drafted tokens verified per round trip (the count adapts "
                                                "below it)")
    draft_model: Path | None = Field(None, description="local model directory or .gguf file that drafts for "
                                                       "--speculate draft; must use the served model's tokenizer")
    answer_index: bool = Field(True, description="remember this client's answers (token ids, in an owner-only "
                                                 "file under --answer-index-dir) to draft from them later")
    answer_index_dir: Path = Field(DATA_HOME / "answers", description="where the answer index is kept")
    answer_index_tokens: int = Field(262_144, ge=1, description="most answer tokens the index keeps (oldest "
                                                                "answers are forgotten first)")

    chat_history: str = Field(str(DATA_HOME / "chat_history"),
                              description="file the chat prompt keeps its line history in, owner-only ('': none)")

    def sampling(self, model_defaults: dict | None = None):
        """Sampling parameters from these settings. `model_defaults` (the model's generation config, see
        `sampling.generation_defaults`) replaces the settings' own defaults, not values given by flag or env."""
        from infemeral.client.sampling import SamplingParams

        chosen = {name: getattr(self, name) for name in ("max_new_tokens", "temperature", "top_k", "top_p",
                                                          "repetition_penalty", "seed")}
        chosen.update({k: v for k, v in (model_defaults or {}).items() if k not in self.model_fields_set})
        return SamplingParams(stop=list(self.stop), speculate=self.speculate, max_draft=self.max_draft, **chosen)


class ServeSettings(BaseSettings):
    """The OpenAI-compatible endpoint on the laptop (`infemeral-client serve`); INFEMERAL_SERVE_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="INFEMERAL_SERVE_", extra="ignore")

    host: str = Field("127.0.0.1", description="address to listen on; anything but loopback needs --api-key")
    port: int = Field(8080, ge=0, le=65535, description="HTTP port")
    api_key: str | None = Field(None, description="key HTTP clients must send as 'Authorization: Bearer KEY'")
    model_name: str | None = Field(None, description="model name the endpoint answers to (default: the client "
                                                     "bundle's directory name)")
    max_sessions: int = Field(8, ge=1, description="live sessions kept for reuse; the least recently used "
                                                   "beyond this are deleted on the server")
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="host names requests may be addressed to besides localhost, 127.0.0.0/8 and ::1, comma-separated "
                    "('*': any; '*.example.com': its subdomains); a non-loopback --host is always allowed. Stops a "
                    "web page from reaching the endpoint by DNS rebinding")
    max_body_bytes: int = Field(4 * 2**20, ge=1, description="largest request body accepted (bytes); a larger one is "
                                                             "answered 413 and never read whole")

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value):
        if isinstance(value, str):
            value = value.split(",")
        return [h.strip() for h in value if h.strip()]
