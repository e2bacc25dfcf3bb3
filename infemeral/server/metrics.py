"""Prometheus metrics on a separate port: counts, sizes and timings only, never payloads or ids."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class Metrics:
    """One registry per server, so several servers can live in one process (tests)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.turns = Counter("infemeral_turns", "turns ended, by outcome", ["outcome"], registry=r)
        self.steps = Counter("infemeral_steps", "steps run", registry=r)
        self.tokens = Counter("infemeral_tokens", "token positions run through the served layers", registry=r)
        self.step_seconds = Histogram("infemeral_step_seconds", "time from a step's arrival to its answer",
                                      buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        self.commit_bytes = Counter("infemeral_store_written_bytes", "bytes written to the session store",
                                    registry=r)
        self.store_errors = Counter("infemeral_store_errors", "session store failures", registry=r)
        self.active_turns = Gauge("infemeral_active_turns", "turns open now", registry=r)
        self.pool_used = Gauge("infemeral_kv_pool_used_pages", "KV pool pages in use", registry=r)
        self.pool_total = Gauge("infemeral_kv_pool_pages", "KV pool size in pages", registry=r)
        self.batch_steps = Histogram("infemeral_batch_steps", "steps sharing one forward pass",
                                     buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self._http = None

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
