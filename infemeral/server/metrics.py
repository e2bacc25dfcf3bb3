"""Engine and server metrics: counts, sizes and timings only, never payloads or ids.

The engine and the service report through the methods of `NullMetrics`, which
do nothing; `Metrics` records the same events in Prometheus on its own port.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class NullMetrics:
    """Where metrics go when nobody collects them."""

    def turn_ended(self, outcome: str) -> None:
        """A turn ended: committed, abandoned, cancelled, or the lower-case name of its error status."""

    def batch_ran(self, num_steps: int, num_tokens: int) -> None:
        """One forward pass ran `num_steps` steps of `num_tokens` positions in all."""

    def step_answered(self, seconds: float) -> None:
        """A step was answered this long after it arrived."""

    def store_written(self, num_bytes: int) -> None:
        """A commit wrote this many bytes to the session store."""

    def store_failed(self) -> None:
        """The session store failed (unreachable, full, ...)."""


class Metrics(NullMetrics):
    """Prometheus metrics; one registry per server, so several servers can live in one process (tests)."""

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
        self.turn_streams = Gauge("infemeral_turn_streams", "Turn streams open now, turns not yet opened included",
                                  registry=r)
        self.pool_used = Gauge("infemeral_kv_pool_used_pages", "KV pool pages in use", registry=r)
        self.pool_total = Gauge("infemeral_kv_pool_pages", "KV pool size in pages", registry=r)
        self.batch_steps = Histogram("infemeral_batch_steps", "steps sharing one forward pass",
                                     buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self._http = None

    def turn_ended(self, outcome: str) -> None:
        self.turns.labels(outcome).inc()

    def batch_ran(self, num_steps: int, num_tokens: int) -> None:
        self.steps.inc(num_steps)
        self.tokens.inc(num_tokens)
        self.batch_steps.observe(num_steps)

    def step_answered(self, seconds: float) -> None:
        self.step_seconds.observe(seconds)

    def store_written(self, num_bytes: int) -> None:
        self.commit_bytes.inc(num_bytes)

    def store_failed(self) -> None:
        self.store_errors.inc()

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
