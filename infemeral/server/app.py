"""Build and run the gRPC server: engine, service, health and reflection."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from infemeral.cloak.bundle import ServerBundle
from infemeral.config import ServerSettings
from infemeral.kvcache.window import WindowPolicy
from infemeral.protocol import SERVICE_NAME, pb_grpc
from infemeral.server.engine import Engine
from infemeral.server.service import InfemeralService
from infemeral.storage.base import open_store

log = logging.getLogger(__name__)

WIRE_OVERHEAD = 1 << 16


class Server:
    """A running infemeral server; `port` is the bound port (useful with port 0)."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self._stopped = threading.Event()
        bundle = ServerBundle.open(settings.bundle, verify=settings.verify_bundle)
        self.engine = Engine(bundle, open_store(settings.store, settings.session_ttl_seconds), device=settings.device, dtype=settings.dtype,
                             max_step_tokens=settings.max_step_tokens, max_sessions=settings.max_sessions,
                             window=WindowPolicy(settings.max_context, settings.sink_tokens, settings.page_size,
                                                 enabled=settings.window),
                             kv_pool_tokens=settings.kv_pool_tokens, max_batch_tokens=settings.max_batch_tokens,
                             admission_wait=settings.admission_wait, attention_backend=settings.attention_backend)
        self.max_message_bytes = settings.max_step_tokens * bundle.config.hidden_size * 4 + WIRE_OVERHEAD
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.so_reuseport", 0),
        ]
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=settings.workers), options=options)
        pb_grpc.add_InfemeralServicer_to_server(InfemeralService(self.engine, self.max_message_bytes),
                                                self.grpc_server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.grpc_server)
        self.port = self.grpc_server.add_insecure_port(settings.listen)
        if self.port == 0:
            raise OSError(f"could not listen on {settings.listen}")

    def start(self) -> "Server":
        self.grpc_server.start()
        self._purger = threading.Thread(target=self._purge_loop, name="infemeral-purge", daemon=True)
        self._purger.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("listening on %s (port %d)", self.settings.listen, self.port)
        return self

    def _purge_loop(self) -> None:
        """Delete expired sessions now and then (Redis expires keys by itself)."""
        interval = min(600.0, max(1.0, self.settings.session_ttl_seconds / 4))
        while not self._stopped.wait(interval):
            try:
                purged = self.engine.store.purge_expired()
                if purged:
                    log.info("purged %d expired sessions", purged)
            except OSError as e:
                log.warning("session purge failed: %s", type(e).__name__)

    def stop(self, grace: float | None = None) -> None:
        """Stop taking new turns, let open ones finish within `grace` seconds, then stop."""
        self.health.enter_graceful_shutdown()
        self.engine._stopping = True
        self.grpc_server.stop(self.settings.grace_seconds if grace is None else grace).wait()
        self._stopped.set()
        self.engine.stop()
        self.engine.store.close()

    def wait(self) -> None:
        self.grpc_server.wait_for_termination()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(0)


def serve_forever(settings: ServerSettings) -> None:
    server = Server(settings).start()
    done = threading.Event()

    def on_signal(signum, _frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    server.stop()
    log.info("stopped")
