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
from infemeral.protocol import SERVICE_NAME, pb_grpc
from infemeral.server.engine import Engine
from infemeral.server.metrics import Metrics
from infemeral.server.service import InfemeralService
from infemeral.storage.base import open_store
from infemeral.transport import ApiKeyInterceptor, is_loopback, read_api_keys, server_credentials

log = logging.getLogger(__name__)

WIRE_OVERHEAD = 1 << 16


class Server:
    """A running infemeral server; `port` is the bound port (useful with port 0)."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self._stopped = threading.Event()
        bundle = ServerBundle.open(settings.bundle, verify=settings.verify_bundle)
        self.metrics = Metrics()
        self.engine = Engine(bundle, open_store(settings.store, settings.session_ttl_seconds),
                             settings.engine_config(), metrics=self.metrics)
        self.max_message_bytes = settings.max_step_tokens * bundle.config.hidden_size * 4 + WIRE_OVERHEAD
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.so_reuseport", 0),
        ]
        keys = read_api_keys(settings.api_keys, settings.api_keys_file)
        interceptors = [ApiKeyInterceptor(keys)] if keys else []
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=settings.workers), options=options,
                                       interceptors=interceptors)
        self.metrics.pool_total.set(self.engine.pool.num_pages)
        self.metrics.pool_used.set_function(lambda: self.engine.pool.num_pages - self.engine.pool.free_pages)
        self.metrics.active_turns.set_function(lambda: self.engine.active_turns)
        pb_grpc.add_InfemeralServicer_to_server(InfemeralService(self.engine, self.max_message_bytes),
                                                self.grpc_server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.grpc_server)
        credentials = server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        if credentials is not None:
            self.port = self.grpc_server.add_secure_port(settings.listen, credentials)
        else:
            if not is_loopback(settings.listen) and not settings.allow_plaintext:
                raise ValueError(f"refusing plaintext gRPC on {settings.listen}: set INFEMERAL_TLS_CERT and "
                                 "INFEMERAL_TLS_KEY, or INFEMERAL_ALLOW_PLAINTEXT=true behind a TLS proxy you control")
            if not is_loopback(settings.listen):
                log.warning("serving plaintext gRPC on %s: the session key and hidden states cross the network "
                            "in the clear unless a TLS proxy terminates in front of this server", settings.listen)
            self.port = self.grpc_server.add_insecure_port(settings.listen)
        if self.port == 0:
            raise OSError(f"could not listen on {settings.listen}")
        self.metrics_port = None

    def start(self) -> "Server":
        self.grpc_server.start()
        self._purger = threading.Thread(target=self._purge_loop, name="infemeral-purge", daemon=True)
        self._purger.start()
        if self.settings.metrics_port:
            self.metrics_port = self.metrics.serve(self.settings.metrics_host, self.settings.metrics_port)
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
        self.engine.begin_shutdown()
        self.grpc_server.stop(self.settings.grace_seconds if grace is None else grace).wait()
        self._stopped.set()
        self.metrics.stop()
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
