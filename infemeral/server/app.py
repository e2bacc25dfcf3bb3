"""Build and run the server: addresses first, then the model; gRPC on asyncio, health and reflection.

`Server` is a synchronous facade over grpc's asyncio server, whose event loop
runs on a thread of its own: `Server(settings).start()`, `.port`, `.stop()`
work from plain code (the CLI, tests, benchmarks). Start-up settles everything
the environment can refuse — TLS files, the listen addresses, the metrics
port — before the slow part (verifying and loading the model, then a warm-up
turn through it), and binds every address or none (see `listen.py`). Health
says SERVING once all of that is done.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from infemeral.cloak.bundle import ServerBundle
from infemeral.protocol import SERVICE_NAME, pb_grpc
from infemeral.server.engine import Engine
from infemeral.server.listen import CannotListen, ListenAddress, bind_all, reason
from infemeral.server.metrics import Metrics
from infemeral.server.parallel import driver as tensor_parallel
from infemeral.server.parallel import ranks
from infemeral.server.service import InfemeralService
from infemeral.server.settings import ServerSettings
from infemeral.server.warm_up import warm_up
from infemeral.storage.open import open_store
from infemeral.transport import ApiKeyInterceptor, is_loopback, read_api_keys, server_credentials

log = logging.getLogger(__name__)

WIRE_OVERHEAD = 1 << 16
MAINTENANCE_SECONDS = 5.0
PORT_ZERO_ATTEMPTS = 5  # port 0 on a host name: the port the first address got may be taken on another
FAILURE_GRACE_SECONDS = 2.0  # a server whose ranks were lost: time for open turns to hear UNAVAILABLE


class Server:
    """A running infemeral server; `port` is the bound port (useful with port 0)."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.metrics = Metrics()
        self.metrics_port: int | None = None
        self.engine: Engine | None = None
        self.tensor_parallel: tensor_parallel.TensorParallel | None = None
        self.failure: str | None = None  # why the server cannot serve any more (a tensor-parallel rank was lost)
        self._failure_listeners: list = []
        self.service: InfemeralService | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self._stopped = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="infemeral-grpc", daemon=True)
        self._loop_thread.start()
        try:
            self._build()
        except BaseException:
            self._shut(grace=0)
            raise

    def _build(self) -> None:
        s = self.settings
        listen = ListenAddress.parse(s.listen)
        credentials = server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca)
        if credentials is None and not is_loopback(listen.host) and not s.allow_plaintext:
            raise ValueError(f"refusing plaintext gRPC on {s.listen}: give --tls-cert and --tls-key, or "
                             f"--listen 127.0.0.1:{listen.port} (loopback needs no TLS), or --allow-plaintext behind "
                             "a TLS proxy you control (env INFEMERAL_TLS_CERT, INFEMERAL_TLS_KEY, INFEMERAL_LISTEN, "
                             "INFEMERAL_ALLOW_PLAINTEXT)")
        keys = read_api_keys(s.api_keys, s.api_keys_file)
        bundle = ServerBundle.open(s.bundle, verify=False)  # manifest and config only: the message size limit
        engine_config = s.engine_config(len(set(keys)))
        world = ranks.rank_count(s.tensor_parallel)
        if world > 1:
            ranks.check(bundle.config, s.device, world)
        self.max_message_bytes = s.max_step_tokens * bundle.config.hidden_size * 4 + WIRE_OVERHEAD
        self.port = self._call(self._bind(listen, credentials, keys))
        if s.metrics_port:
            self.metrics_port = self._listen_metrics(s.metrics_host, s.metrics_port)
        if credentials is None and not is_loopback(listen.host):
            log.warning("serving plaintext gRPC on %s: the session key and hidden states cross the network "
                        "in the clear unless a TLS proxy terminates in front of this server", s.listen)
        # The slow part, now that nothing the environment refuses can stop the server any more. The files' hashes
        # are checked on a thread while the layers load (both mostly read the same files), and before serving.
        verifying = ThreadPoolExecutor(1, thread_name_prefix="infemeral-verify")
        verified = verifying.submit(bundle.verify) if s.verify_bundle else None
        verifying.shutdown(wait=False)  # its one task still runs
        runner = None
        if world > 1:
            self.tensor_parallel = tensor_parallel.TensorParallel.start(
                bundle, engine_config, world, s.tensor_parallel_timeout, log_format=s.log_format,
                log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()))
            self.tensor_parallel.on_failure(self._fail)
            runner = self.tensor_parallel.runner
        try:
            self.engine = Engine(bundle, open_store(s.store, s.session_ttl_seconds), engine_config,
                                 metrics=self.metrics, runner=runner)
        finally:
            if verified is not None:
                verified.result()  # also when the load failed: a file that does not match explains it best
        warm_up(self.engine)  # the kernels' one-time set-up, before health says SERVING, not in a user's turn
        self.service = InfemeralService(self.engine, s.service_limits(len(set(keys))), self.max_message_bytes,
                                        bundle_verified=s.verify_bundle)
        self.metrics.pool_total.set(self.engine.pool.num_pages)
        self.metrics.pool_used.set_function(lambda: self.engine.pool.num_pages - self.engine.pool.free_pages)
        self.metrics.active_turns.set_function(lambda: self.engine.active_turns)
        self.metrics.turn_streams.set_function(lambda: self.service.num_streams)
        self._call(self._add_services())

    # -- failure ----------------------------------------------------------------------------------------
    def on_failure(self, callback) -> None:
        """`callback(reason)` once the server can serve no more (its tensor-parallel ranks were lost)."""
        self._failure_listeners.append(callback)

    def _fail(self, reason: str) -> None:
        """The ranks are lost: new turns are refused at once, open ones fail with UNAVAILABLE as they step or
        commit; whoever runs the server stops it (`serve_forever` then exits with status 1)."""
        self.failure = reason
        if self.engine is not None:
            self.engine.begin_shutdown()
        if getattr(self, "health", None) is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.health.enter_graceful_shutdown(), self._loop)
        for callback in self._failure_listeners:
            callback(reason)

    # -- on the event loop ----------------------------------------------------------------------------
    def _call(self, coroutine):
        """Run a coroutine on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _bind(self, listen: ListenAddress, credentials, keys: list[str]) -> int:
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [ApiKeyInterceptor(keys)] if keys else []
        for attempt in range(PORT_ZERO_ATTEMPTS):
            self.grpc_server = grpc.aio.server(options=options, interceptors=interceptors)
            if credentials is not None:
                def add_port(address): return self.grpc_server.add_secure_port(address, credentials)
            else:
                add_port = self.grpc_server.add_insecure_port
            try:
                return bind_all(listen, add_port)
            except CannotListen:
                await self.grpc_server.stop(None)
                if listen.port != 0 or attempt == PORT_ZERO_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _add_services(self) -> None:
        pb_grpc.add_InfemeralServicer_to_server(self.service, self.grpc_server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.grpc_server)

    async def _start(self) -> None:
        await self.grpc_server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def _stop(self, grace: float) -> None:
        if self.service is not None:
            await self.health.enter_graceful_shutdown()
        if self.engine is not None:
            self.engine.begin_shutdown()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)
        if self.service is not None:
            await self.service.finish()

    def _listen_metrics(self, host: str, port: int) -> int:
        try:
            return self.metrics.serve(host, port)
        except OSError as e:
            raise CannotListen(f"cannot listen on the metrics port {host}:{port}: {reason(e)}") from None

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> "Server":
        self._call(self._start())
        self._maintainer = threading.Thread(target=self._maintain, name="infemeral-maintenance", daemon=True)
        self._maintainer.start()
        log.info("listening on %s (port %d)", self.settings.listen, self.port)
        return self

    def _maintain(self) -> None:
        """Now and then: release store locks a failed close left behind; delete expired sessions (Redis
        expires keys by itself)."""
        purge_every = min(600.0, max(1.0, self.settings.session_ttl_seconds / 4))
        since_purge = 0.0
        while not self._stopped.wait(MAINTENANCE_SECONDS):
            self.engine.release_leftover_locks()
            since_purge += MAINTENANCE_SECONDS
            if since_purge < purge_every:
                continue
            since_purge = 0.0
            try:
                purged = self.engine.store.purge_expired()
                if purged:
                    log.info("purged %d expired sessions", purged)
            except OSError as e:
                log.warning("session purge failed: %s", type(e).__name__)

    def stop(self, grace: float | None = None) -> None:
        """Stop taking new turns, let open ones finish within `grace` seconds, then stop."""
        if not self._stopped.is_set():
            self._shut(self.settings.grace_seconds if grace is None else grace)

    def _shut(self, grace: float) -> None:
        self._stopped.set()
        try:
            self._call(self._stop(grace))
        finally:
            if self.service is not None:
                self.service.close()
            self.metrics.stop()
            if self.engine is not None:
                self.engine.stop()
                self.engine.store.close()
            if self.tensor_parallel is not None:
                self.tensor_parallel.close()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=10)
            if not self._loop_thread.is_alive():
                self._loop.close()

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(0)


def serve_forever(settings: ServerSettings) -> int:
    """Serve until SIGTERM or SIGINT (exit status 0), or until the server fails by itself (1: a tensor-parallel
    rank was lost; its supervisor restarts it)."""
    server = Server(settings).start()
    done = threading.Event()

    def on_signal(signum, _frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.on_failure(lambda _reason: done.set())
    if server.failure is not None:  # failed before the listener was in place
        done.set()
    done.wait()
    if server.failure is not None:
        server.stop(min(FAILURE_GRACE_SECONDS, settings.grace_seconds))
        log.error("stopped: %s", server.failure)
        return 1
    server.stop()
    log.info("stopped")
    return 0
