"""``/metrics`` of the HTTP endpoint: Prometheus text from a registry of the server's own.

The tiered cache's counters and gauges (hit tokens per tier, bytes moved between tiers,
prefetch terminations by reason, L3 read and write rates) come from
:meth:`~hicache.tiering.common.metrics.HiCacheMetrics.register_prometheus`; this module adds
what the server sees per request: requests by outcome, TTFT and queue-time histograms, tokens in
and out, and hit tokens per tier as each request was admitted (also in the modes without a
tiered cache).
"""

from __future__ import annotations

from typing import Any

from hicache.serving.request import ServeRequest
from hicache.tiering.common.metrics import HiCacheMetrics

__all__ = ["ConnectionCounts", "ServingMetrics"]

# Seconds: TTFTs from a cached 10 ms to an uncached long prompt on a CPU.
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServingMetrics:
    """Prometheus metrics of one server (a registry of its own, so servers never collide)."""

    def __init__(self, cache_metrics: HiCacheMetrics | None, prefix: str = "hicache") -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        except ImportError as exc:
            raise ImportError("pip install 'hicache[prometheus]' for /metrics") from exc
        self.registry = CollectorRegistry()
        if cache_metrics is not None:
            cache_metrics.register_prometheus(self.registry, prefix)
        reg = self.registry
        self.requests = Counter(
            f"{prefix}_requests", "completion requests by outcome", ["outcome"], registry=reg
        )
        self.ttft = Histogram(
            f"{prefix}_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=reg
        )
        self.queue = Histogram(
            f"{prefix}_queue_seconds", "arrival to admission", buckets=_LATENCY_BUCKETS,
            registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter(f"{prefix}_prompt_tokens", "prompt tokens", registry=reg)
        self.generated_tokens = Counter(
            f"{prefix}_generated_tokens", "tokens generated", registry=reg
        )
        self.request_hits = Counter(
            f"{prefix}_request_hit_tokens", "prompt tokens found cached at admission, by tier",
            ["tier"], registry=reg,
        )  # fmt: skip
        self.in_flight = Gauge(f"{prefix}_requests_in_flight", "requests not done", registry=reg)

    def watch_connections(self, guard: Any, prefix: str = "hicache") -> None:
        """Export a :class:`~hicache.server.connections.ConnectionGuard`'s counts: connections
        open, closed at once over the cap, and closed for want of a request head in time."""
        self.registry.register(ConnectionCounts(guard, prefix))

    def refused(self) -> None:
        """A request answered 4xx before it reached the engine."""
        self.requests.labels("refused").inc()

    def done(self, request: ServeRequest) -> None:
        """A request the engine is done with."""
        record = request.record
        self.requests.labels("failed" if record.error is not None else "ok").inc()
        if record.error is not None:
            return
        if record.ttft_s is not None:
            self.ttft.observe(record.ttft_s)
        if record.queue_s is not None:
            self.queue.observe(record.queue_s)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generated_tokens.inc(len(request.generated))
        for tier in ("device", "host", "l3"):
            self.request_hits.labels(tier).inc(getattr(record, f"hit_{tier}"))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def sample(self, name: str, labels: dict[str, str] | None = None) -> Any:
        """One sample's value by full name (for tests); None if absent."""
        return self.registry.get_sample_value(name, labels or {})


class ConnectionCounts:
    """A collector reading a :class:`~hicache.server.connections.ConnectionGuard`'s numbers at
    each scrape (register it on a registry)."""

    def __init__(self, guard: Any, prefix: str) -> None:
        self._guard = guard
        self._prefix = prefix

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p, guard = self._prefix, self._guard
        yield GaugeMetricFamily(f"{p}_http_connections_open", "connections open", guard.open)
        yield CounterMetricFamily(
            f"{p}_http_connections_refused", "connections closed at once: a cap was reached",
            guard.refused,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_http_connections_timed_out",
            "connections closed: no request head (or TLS handshake) within the header timeout",
            guard.timed_out,
        )  # fmt: skip
