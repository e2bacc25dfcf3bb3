"""The server's settings, from flags and INFEMERAL_* environment variables (pydantic-settings).

`infemeral-server` reads them; the engine and the gRPC service get the frozen
parts they need (`engine_config`, `service_limits`). Their defaults live in those
config dataclasses (server/config.py), the window's sinks and pages in `WindowPolicy`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from infemeral.paths import DATA_HOME
from infemeral.server.config import DEFAULT_MAX_CONTEXT, EngineConfig, ServiceLimits


class ServerSettings(BaseSettings):
    """Server configuration; every field can be set as INFEMERAL_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="INFEMERAL_", extra="ignore")

    bundle: Path = Field(DATA_HOME / "bundles" / "default" / "server", description="server bundle directory")
    listen: str = Field("127.0.0.1:50051", description="host:port to listen on")
    store: str = Field(str(DATA_HOME / "store"),
                       description="session store: a directory path, file:///path or redis://host:port/db")
    session_ttl_seconds: float = Field(7 * 24 * 3600, gt=0, description="sessions idle this long are deleted")
    device: str = Field(EngineConfig.device, description="cpu, cuda, cuda:N or auto")
    dtype: str = Field(EngineConfig.dtype,
                       description="float32, bfloat16, float16 or auto (float32 on CPU, bfloat16 on CUDA)")
    max_step_tokens: int = Field(EngineConfig.max_step_tokens, ge=1, description="most tokens one step may carry")
    # the window's other defaults are WindowPolicy's (tests/server/test_server_config.py): importing it loads torch
    max_context: int = Field(DEFAULT_MAX_CONTEXT, ge=1,
                             description="most tokens a session's cache may hold (the window size)")
    window: bool = Field(True, description="slide a window over long conversations instead of refusing them")
    sink_tokens: int = Field(4, ge=0, description="first tokens the window always keeps (attention sinks)")
    page_size: int = Field(16, ge=1, description="tokens per KV page; the window evicts whole pages")
    max_sessions: int = Field(EngineConfig.max_sessions, ge=1, description="most turns open at once")
    kv_pool_tokens: int = Field(EngineConfig.kv_pool_tokens, ge=1,
                                description="KV cache pool size in tokens, shared by all open turns")
    max_batch_tokens: int = Field(EngineConfig.max_batch_tokens, ge=1,
                                  description="most tokens one batched forward pass may carry")
    admission_wait: float = Field(EngineConfig.admission_wait, ge=0,
                                  description="seconds a new turn waits for its KV page quota (and a step past its "
                                              "quota for spare pages) before RESOURCE_EXHAUSTED; at most half of "
                                              "max_sessions wait at once, more are refused at once")
    default_reserve_tokens: int = Field(EngineConfig.default_reserve_tokens, ge=1,
                                        description="tokens a turn that declares no reserve_tokens may add within "
                                                    "its KV page quota (past it, it grows only into spare pages); "
                                                    "the SDK always declares")
    max_sessions_per_key: int = Field(EngineConfig.max_sessions_per_key, ge=0,
                                      description="most turns one API key may have open at once; more are refused "
                                                  "at once with RESOURCE_EXHAUSTED (0: half of max_sessions when "
                                                  "more than one API key is set, else no limit; no API keys: no "
                                                  "limit)")
    max_sessions_per_peer: int = Field(EngineConfig.max_sessions_per_peer, ge=0,
                                       description="without API keys: most turns one client address may have open "
                                                   "at once, loopback clients apart; more are refused at once with "
                                                   "RESOURCE_EXHAUSTED (0: no limit, e.g. behind a proxy every "
                                                   "client shares; with API keys the per-key limits apply instead)")
    kv_pool_share_per_key: float = Field(EngineConfig.kv_pool_share_per_key, ge=0, le=1,
                                         description="share of the KV pool the turns of one API key may hold, at "
                                                     "least one max_context (0: half when more than one API key is "
                                                     "set, else all; no API keys: all)")
    attention_backend: str = Field(EngineConfig.attention_backend,
                                   description="auto, torch or flashinfer (auto: FlashInfer on CUDA in bfloat16 or "
                                               "float16 when installed; float32 and the CPU take torch)")
    max_batch_hold: float = Field(EngineConfig.max_batch_hold, ge=0,
                                  description="seconds a forward pass may wait for sessions about to send their next "
                                              "step, so they share it (0: never wait; e.g. 0.05 to try)")
    max_streams: int = Field(ServiceLimits.max_streams, ge=0,
                             description="most Turn streams open at once, turns not yet opened included; more are "
                                         "refused at once with RESOURCE_EXHAUSTED (0: four times max_sessions)")
    turn_idle_seconds: float = Field(ServiceLimits.turn_idle_seconds, gt=0,
                                     description="a turn whose client sends nothing for this long is aborted "
                                                 "(DEADLINE_EXCEEDED, nothing committed) and its session and KV "
                                                 "pages released; the SDK keeps busy turns alive")
    max_turn_seconds: float = Field(ServiceLimits.max_turn_seconds, gt=0,
                                    description="a turn open longer than this is aborted the same way (above the "
                                                "SDK's default 600 s turn deadline)")
    tensor_parallel: int = Field(1, ge=1, description="ranks the served layers are split over (tensor parallelism), "
                                                      "one per GPU (cuda:0..N-1; on a machine without CUDA, N CPU "
                                                      "processes): the attention and KV head counts must divide by "
                                                      "N; under torchrun, its WORLD_SIZE")
    tensor_parallel_timeout: float = Field(120.0, gt=0, description="seconds one tensor-parallel rank may keep the "
                                                                    "others waiting before it counts as lost: the "
                                                                    "open turns fail with UNAVAILABLE and the server "
                                                                    "exits with status 1 (for its supervisor to "
                                                                    "restart it)")
    workers: int = Field(ServiceLimits.delete_threads, ge=1,
                         description="threads for session deletes (turns get one thread per max_sessions slot for "
                                     "their store I/O and encryption)")
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
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="least severe log lines shown")

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

    def limit_per_peer(self, num_api_keys: int) -> int:
        """Turns one client address may hold (0: no limit): only without API keys, which tell clients apart
        better (clients behind one proxy share an address)."""
        return 0 if num_api_keys else self.max_sessions_per_peer

    def engine_config(self, num_api_keys: int = 0) -> EngineConfig:
        """The engine's part of these settings, as one frozen `EngineConfig`."""
        from infemeral.kvcache.window import WindowPolicy  # torch: not loaded for --help

        sessions_per_key, share_per_key = self.limits_per_key(num_api_keys)
        return EngineConfig(device=self.device, dtype=self.dtype, max_step_tokens=self.max_step_tokens,
                            max_sessions=self.max_sessions,
                            window=WindowPolicy(self.max_context, self.sink_tokens, self.page_size,
                                                enabled=self.window),
                            kv_pool_tokens=self.kv_pool_tokens, max_batch_tokens=self.max_batch_tokens,
                            admission_wait=self.admission_wait, attention_backend=self.attention_backend,
                            max_batch_hold=self.max_batch_hold, default_reserve_tokens=self.default_reserve_tokens,
                            max_sessions_per_key=sessions_per_key, kv_pool_share_per_key=share_per_key,
                            max_sessions_per_peer=self.limit_per_peer(num_api_keys))

    def service_limits(self, num_api_keys: int = 0) -> ServiceLimits:
        """The gRPC service's part: one API key or client address may hold the same share of the streams as
        of the turn slots."""
        limits = ServiceLimits(max_streams=self.max_streams, turn_idle_seconds=self.turn_idle_seconds,
                               max_turn_seconds=self.max_turn_seconds, delete_threads=self.workers,
                               max_sessions=self.max_sessions)

        def streams(sessions: int) -> int:
            return math.ceil(limits.max_streams * sessions / self.max_sessions) if sessions else 0

        sessions_per_key, _ = self.limits_per_key(num_api_keys)
        return replace(limits, max_streams_per_key=streams(sessions_per_key),
                       max_streams_per_peer=streams(self.limit_per_peer(num_api_keys)))
