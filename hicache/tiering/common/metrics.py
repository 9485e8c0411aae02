"""Counters of the tiered cache: a plain dict for everyone, Prometheus metrics when installed.

Counters only go up; gauges (``l3_enabled``, queue depths) are read when asked. The Prometheus
side is a collector that reads the same counters at scrape time, so nothing is counted twice and
a process with no prometheus-client pays nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from hicache.tiering.common.policies import TerminationReason

__all__ = ["COUNTERS", "HiCacheMetrics"]

# Every counter, with its help text. Tiers: device (L1), host (L2), l3.
COUNTERS: dict[str, str] = {
    "device_hit_tokens": "tokens matched on the device",
    "host_hit_tokens": "tokens matched on host and loaded back to the device",
    "l3_hit_tokens": "tokens prefetched from L3 and inserted into the cache",
    "l3_miss_tokens": "tokens asked of L3 that it did not have or that did not arrive",
    "bytes_device_to_host": "bytes backed up from the device to host memory",
    "bytes_host_to_device": "bytes loaded back from host memory to the device",
    "bytes_host_to_l3": "bytes written from host memory to L3",
    "bytes_l3_to_host": "bytes read from L3 into host memory",
    "pages_submitted_l3": "pages handed to the L3 writer (each is then written, skipped, failed "
    "or dropped)",
    "pages_written_l3": "pages written to L3",
    "pages_skipped_l3": "pages not written to L3 because it already had them",
    "l3_write_failures": "pages not written to L3: the backend call failed, timed out or said no",
    "l3_read_failures": "pages a prefetch could not read: a backend call failed or timed out",
    "dropped_writes": "L3 writes dropped because the write queue was full",
    "corrupt_pages": "L3 pages that failed their checks and were treated as misses",
    "corrupt_removed": "L3 objects deleted after failing their checks (rewritten when recomputed)",
    "l3_repaired_pages": "L3 pages found bad or listed but not delivered (by a read, or checked "
    "before a write was skipped) and written again",
    "pages_checked_l3": "pages the engine computed while L3 held them, read back and checked "
    "before their write was skipped",
    "missing_pages": "L3 pages that were gone when read",
    "timeouts": "backend calls that ran past their deadline",
    "errors": "backend calls that raised",
    "task_restarts": "background tasks that failed and were restarted",
    "prefetch_started": "prefetches started",
    "l3_lookup_candidates": "pages prefetches could have asked L3 about",
    "l3_lookup_pages": "pages prefetches asked L3 about (up to the first page it lacked)",
    "prefetch_skipped_small": "prefetch candidates under the threshold",
    "prefetch_skipped_capacity": "prefetches refused by the host capacity limit",
    "prefetch_skipped_slow": "prefetches skipped because reading L3 was slower than recomputing",
    "host_evicted_tokens": "tokens evicted from host memory",
    "device_evicted_tokens": "tokens evicted from the device",
    "l3_unavailable": "starts with L3 configured but unreachable",
    "l3_discarded_objects": "L3 objects deleted at close because the cache's namespaces were "
    "scratch (storage.discard_on_close)",
}
for _reason in TerminationReason:
    COUNTERS[f"prefetch_{_reason.value}"] = f"prefetches that ended: {_reason.value}"


class HiCacheMetrics:
    """The counters, plus gauges read from callables at report time."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._gauges: dict[str, Callable[[], float]] = {}

    def add(self, name: str, amount: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}")
        self.counts[name] += amount

    def gauge(self, name: str, read: Callable[[], float]) -> None:
        self._gauges[name] = read

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {name: float(self.counts.get(name, 0)) for name in COUNTERS}
        for name, read in self._gauges.items():
            out[name] = float(read())
        return out

    def register_prometheus(self, registry: Any = None, prefix: str = "hicache") -> Any:
        """Expose the counters to prometheus-client; returns the collector.

        Raises ImportError with an install hint when prometheus-client is missing.
        """
        try:
            from prometheus_client import REGISTRY
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        except ImportError as exc:
            raise ImportError("pip install 'hicache[prometheus]' for Prometheus metrics") from exc
        metrics = self

        class _Collector:
            def collect(self) -> Iterator[Any]:
                for name, help_text in COUNTERS.items():
                    family = CounterMetricFamily(f"{prefix}_{name}", help_text)
                    family.add_metric([], metrics.counts.get(name, 0))
                    yield family
                for name, read in metrics._gauges.items():
                    gauge = GaugeMetricFamily(f"{prefix}_{name}", name.replace("_", " "))
                    gauge.add_metric([], float(read()))
                    yield gauge

        collector = _Collector()
        (registry or REGISTRY).register(collector)
        return collector
