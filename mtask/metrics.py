"""Prometheus metrics, all named ``mtask_…``, in the process's default registry.

A worker counts what it claims and how runs end, times claims and runs, and tracks runs in
flight; any client counts the tasks its publish calls created. Queue depth per name and status
comes from one aggregation, cached for ``DEPTH_TTL`` seconds, read when metrics are scraped.
The worker serves them on ``--metrics-port``; ``mtask serve`` on ``/metrics``.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

DEPTH_TTL = 5.0

PUBLISHED = Counter("mtask_tasks_published", "Tasks created by publish calls", ["name"])
CLAIMED = Counter("mtask_tasks_claimed", "Runs started by claims", ["name"])
SUCCEEDED = Counter("mtask_tasks_succeeded", "Runs that ended in SUCCESS", ["name"])
FAILED = Counter("mtask_tasks_failed", "Runs that ended in FAIL", ["name"])
RETRIED = Counter(
    "mtask_tasks_retried", "FAIL runs that did not fail the task at once (retry budget)", ["name"]
)
LEASE_LOST = Counter("mtask_tasks_lease_lost", "Runs stopped because another took over", ["name"])
IN_FLIGHT = Gauge("mtask_in_flight", "Runs in flight in this process")
CLAIM_LATENCY = Histogram(
    "mtask_claim_latency_seconds",
    "One claim call (one key or a batch), from sending to the claimed documents",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
RUN_DURATION = Histogram(
    "mtask_run_duration_seconds",
    "A handler's run, from claim to outcome",
    ["name"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800),
)


@functools.lru_cache(maxsize=4096)
def by_name(metric: Counter | Histogram, name: str) -> Any:
    """``metric.labels(name)``, cached: ``labels`` validates and takes a lock on every call,
    and the worker asks for a child several times per task."""
    return metric.labels(name)


class QueueDepth(Collector):
    """``mtask_queue_depth{name, status}`` from ``fetch`` (a stats call), at most once every
    ``DEPTH_TTL`` seconds; a failed fetch reports the last counts."""

    def __init__(self, fetch: Callable[[], Mapping[str, Mapping[str, int]]]) -> None:
        self.fetch = fetch
        self._lock = threading.Lock()
        self._counts: Mapping[str, Mapping[str, int]] = {}
        self._at = float("-inf")

    def counts(self) -> Mapping[str, Mapping[str, int]]:
        with self._lock:
            if time.monotonic() - self._at >= DEPTH_TTL:
                try:
                    self._counts = self.fetch()
                finally:
                    self._at = time.monotonic()
            return self._counts

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """What it reports, without reading MongoDB (asked at registration)."""
        yield self._family()

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "mtask_queue_depth", "Tasks per name and status", labels=["name", "status"]
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        try:
            counts = self.counts()
        except Exception:  # noqa: BLE001 - MongoDB out of reach: report the last known counts
            counts = self._counts
        for name, by_status in sorted(counts.items()):
            for status, count in sorted(by_status.items()):
                family.add_metric([name, status], count)
        yield family


_depth: QueueDepth | None = None


def register_queue_depth(fetch: Callable[[], Mapping[str, Mapping[str, int]]]) -> QueueDepth:
    """Report queue depth from ``fetch`` (one per process: a second call replaces it)."""
    global _depth
    if _depth is not None:
        REGISTRY.unregister(_depth)
    _depth = QueueDepth(fetch)
    REGISTRY.register(_depth)
    return _depth
