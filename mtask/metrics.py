"""Prometheus metrics, all named ``mtask_…``, in the process's default registry.

Runs and tasks are named apart: a task can have many runs. A worker counts the runs it claims
and how they end (``mtask_runs_*_total``), times claims and runs, and tracks runs in flight;
any client counts the tasks its publish calls created (``mtask_tasks_published_total``).

The *cluster* gauges — queue depth (open tasks) per name and status, and for autoscaling the
pending tasks due now and the age of the oldest due one per name — describe the whole
collection, so they are exported once per cluster: by ``mtask serve`` on ``/metrics``, or by a
worker started with ``--cluster-metrics`` (never by every worker, or a sum over pods would count
them N times). Each comes from index-only reads, cached for ``DEPTH_TTL`` s, read when scraped.

A worker serves its metrics with ``serve_http`` (``--metrics-port``), beside ``/healthz`` and
``/readyz`` for container probes.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, make_server
from wsgiref.types import StartResponse, WSGIEnvironment

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from mtask.triggers import follower_label
from mtask.vocabulary import OPEN_STATUSES

log = logging.getLogger(__name__)
DEPTH_TTL = 5.0
T = TypeVar("T")

UNKNOWN = "unknown"  # the label of a document without a usable name or status (never "None")

PUBLISHED = Counter("mtask_tasks_published", "Tasks created by publish calls", ["name"])
# The Python names below are the ones worker code calls; the metric names say they count runs.
CLAIMED = Counter("mtask_runs_claimed", "Runs started by claims in this process", ["name"])
SUCCEEDED = Counter("mtask_runs_succeeded", "Runs that ended in SUCCESS", ["name"])
FAILED = Counter("mtask_runs_failed", "Runs that ended in FAIL", ["name"])
RETRIED = Counter(
    "mtask_runs_retried", "FAIL runs that left their task pending (retry budget)", ["name"]
)
SNOOZED = Counter(
    "mtask_runs_snoozed", "Runs whose handler raised Snooze: no retry spent", ["name"]
)
CONTINUED = Counter(
    "mtask_runs_continued", "Runs that continued as new (ctx.continue_as_new)", ["name"]
)
LEASE_LOST = Counter("mtask_runs_lease_lost", "Runs stopped because another took over", ["name"])
TOKENS = Counter(
    "mtask_tokens",
    "Tokens the runs in this process recorded (ctx.record_usage), by task name, model and kind "
    "(input, output, cached: the input tokens read from the provider's cache)",
    ["name", "model", "kind"],
)
COST = Counter(
    "mtask_cost",
    "Cost the runs in this process recorded, in the prices' currency, by task name and model",
    ["name", "model"],
)
IN_FLIGHT = Gauge("mtask_runs_in_flight", "Runs in flight in this process")
RUNS_IN_PROGRESS = Gauge(
    "mtask_runs_reporting_progress",
    "Runs in flight in this process that have reported progress (ctx.progress)",
)
SET_ASIDE = Counter(
    "mtask_documents_set_aside",
    "Change events or task documents this worker set aside, by reason: event (applying one "
    "event failed; its document is marked invalid), unmarkable (a document that could not "
    "even be marked invalid, let go with a logged reason)",
    ["reason"],
)
CLAIM_LATENCY = Histogram(
    "mtask_claim_latency_seconds",
    "One claim call (one key or a batch), from sending to the claimed documents",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
BATCH_SIZE = Histogram(
    "mtask_batch_size",
    "Tasks a batch handler was called with",
    ["name"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
RUN_DURATION = Histogram(
    "mtask_run_duration_seconds",
    "A handler's run, from claim to outcome",
    ["name"],
    buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800),
)

# -- handler isolation and time limits --
POOL_CHILDREN = Gauge(
    "mtask_pool_children", "Child processes of the process pool by state", ["state"]
)
POOL_CHILDREN_STARTED = Counter("mtask_pool_children_started", "Child processes started")
POOL_CHILDREN_ENDED = Counter(
    "mtask_pool_children_ended",
    "Child processes ended, by reason: recycled, killed (time limit, cancel, stop), died, "
    "memory_limit",
    ["reason"],
)
RUNS_HELD = Gauge(
    "mtask_runs_held",
    "Runs told to stop whose handler has not stopped yet, holding their sequence's lock and "
    "limit slots until it has",
)
TIME_LIMIT_KILLS = Counter(
    "mtask_time_limit_kills",
    "Runs ended by their hard time limit, by how (process: killed, async: cancelled, "
    "thread: abandoned)",
    ["how"],
)


# -- flow control --
LIMIT_SHED = Counter(
    "mtask_limit_shed",
    "Tasks a full lossy limit refused and this worker dropped or failed at once, per limit (a "
    "task name, or resource:<name>) and how (drop, fail)",
    ["limit", "how"],
)
SUPERSEDED = Counter(
    "mtask_tasks_superseded",
    "Tasks a publish with a supersede policy (this process's) ended, per task name and how: "
    "cancelled (an older task the newer one replaced), dropped (the newer one not stored)",
    ["name", "how"],
)
DEBOUNCED = Counter(
    "mtask_publishes_debounced",
    "Publishes by this process that joined a debounce window already open (its task's params "
    "replaced, its start put back) instead of creating a task",
    ["name"],
)
BACKOFFS = Counter(
    "mtask_backoffs",
    "Handlers' BackOff holds written by this worker, per task name and what they held: "
    "tenant (the task's own tenant), name, resource",
    ["name", "held"],
)

# -- triggers and waits on data (docs/triggers.md) --
FOLLOWER_CHANGES = Counter(
    "mtask_follower_changes",
    "Changes a follower held by this process handled, per follower (trigger:<name> or "
    "wait:<collection>)",
    ["follower"],
)
FOLLOWER_HISTORY_LOST = Counter(
    "mtask_follower_history_lost",
    "Times a follower held by this process found its stream's history gone (the oplog rolled "
    "past its position, the collection dropped or renamed) and scanned instead",
    ["follower"],
)
FOLLOWERS_TAKEN = Counter(
    "mtask_followers_taken", "Follower leases this process took", ["follower"]
)
TRIGGER_TASKS = Counter(
    "mtask_trigger_tasks",
    "Tasks a trigger followed by this process published, by how (created, joined, reset, "
    "follow-up, own; scan)",
    ["trigger", "how"],
)
DATA_WAITS_WOKEN = Counter(
    "mtask_data_waits_woken",
    "Data waits (ctx.wait_until) this process woke, per collection, by what (change, sweep)",
    ["collection", "by"],
)


@functools.lru_cache(maxsize=4096)
def by_name(metric: Counter | Histogram, name: str) -> Any:
    """``metric.labels(name)``, cached: ``labels`` validates and takes a lock on every call,
    and the worker asks for a child several times per task."""
    return metric.labels(label(name))


def label(value: object) -> str:
    """A label value: the string itself, else ``unknown`` (a document of any shape may be in
    the collection; a metric never says "None")."""
    return value if isinstance(value, str) and value and value != "None" else UNKNOWN


class Passes:
    """When the cluster gauges of a process are read again: all of them in the same pass. The
    first gauge a scrape asks for once the last pass is ``DEPTH_TTL`` seconds old begins a new
    pass, and every gauge reads again in it, in the scrape's order (the queue depth first, the
    limits' gauges last). Each gauge timed on its own, a slow read between two of them left the
    later one's figures up to a scrape behind: a scrape could say that a task's queue was empty
    while its limit still counted the run that had just ended there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = float("-inf")
        self.number = 0

    def current(self) -> int:
        """The pass a gauge asked for now belongs to (a new one if the last is stale)."""
        with self._lock:
            now = time.monotonic()
            if now - self._at >= DEPTH_TTL:
                self.number += 1
                self._at = now
            return self.number


CLUSTER_PASSES = Passes()
"""The passes of this process's cluster gauges (``register_cluster_metrics``)."""


class Fetched(Generic[T]):
    """What ``fetch`` read of the cluster, read again once per pass of ``passes`` (at most one
    every ``DEPTH_TTL`` seconds: one scrape after another, or several scrapers, cost MongoDB
    one read); a failed read reports the last figures (MongoDB out of reach)."""

    def __init__(self, fetch: Callable[[], T], empty: T, passes: Passes | None = None) -> None:
        self.fetch = fetch
        self.passes = CLUSTER_PASSES if passes is None else passes
        self._lock = threading.Lock()
        self._value = empty
        self._read_in = 0
        """The pass of the last read (0: none yet)."""

    def __call__(self) -> T:
        with self._lock:
            current = self.passes.current()
            if current != self._read_in:
                self._read_in = current
                try:
                    self._value = self.fetch()
                except Exception as exc:  # noqa: BLE001 - MongoDB out of reach: the last figures
                    log.warning("cluster metrics: %s failed, its last figures kept: %r",
                                getattr(self.fetch, "__name__", "a read"), exc)  # fmt: skip
            return self._value


class PerName(Collector):
    """A gauge of open tasks per name and one more label (``key``: their stored ``status``, or
    their derived ``state``) from ``fetch``, read through ``Fetched``. Finished work is the
    runs' counters (``mtask_runs_succeeded_total`` …), not a count of the finished tasks kept."""

    def __init__(
        self,
        metric: str,
        documentation: str,
        key: str,
        fetch: Callable[[], Mapping[str, Mapping[str, int]]],
    ) -> None:
        self.metric, self.documentation, self.key = metric, documentation, key
        self.counts: Fetched[Mapping[str, Mapping[str, int]]] = Fetched(fetch, {})

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """What it reports, without reading MongoDB (asked at registration)."""
        yield self._family()

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.metric, self.documentation, labels=["name", self.key])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        merged: dict[tuple[str, str], int] = {}
        for name, by_key in self.counts().items():
            for key, count in by_key.items():
                labels = (label(name), label(key))
                merged[labels] = merged.get(labels, 0) + count
        for labels, count in sorted(merged.items()):
            family.add_metric(list(labels), count)
        yield family


def queue_depth(fetch: Callable[[], Mapping[str, Mapping[str, int]]]) -> PerName:
    """``mtask_queue_depth{name, status}``: a stats call of the open statuses, pending and
    running (exact, at the cost of the backlog)."""
    return PerName("mtask_queue_depth", "Open tasks per name and stored status", "status", fetch)


def open_states(fetch: Callable[[], Mapping[str, Mapping[str, int]]]) -> PerName:
    """``mtask_open_tasks{name, state}``: the open tasks per derived state, as ``mtask stats``,
    ``GET /stats`` and the dashboard count them (the newest 1,000 pending tasks of a name
    explained; the rest ``state="pending_not_split"``)."""
    return PerName(
        "mtask_open_tasks", "Open tasks per name and derived state (docs/web.md)", "state", fetch
    )


class DueTasks(Collector):
    """``mtask_due_tasks{name}`` and ``mtask_oldest_due_age_seconds{name}`` from ``fetch`` (a
    ``TaskClient.due`` call: pending tasks due now on the server's clock), ``Fetched``. A name
    with nothing due is absent (a Prometheus query treats it as 0 with ``or vector(0)``); the
    scalers in deploy/kubernetes sum over names."""

    def __init__(self, fetch: Callable[[], Mapping[str, tuple[int, float]]]) -> None:
        self.due: Fetched[Mapping[str, tuple[int, float]]] = Fetched(fetch, {})

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "mtask_due_tasks", "Pending tasks due now, per name (cluster-wide)", labels=["name"]
            ),
            GaugeMetricFamily(
                "mtask_oldest_due_age_seconds",
                "Seconds since the oldest pending due task became due, per name (cluster-wide)",
                labels=["name"],
            ),
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        count, age = self._families()
        for name, (n, oldest) in sorted(self.due().items()):
            count.add_metric([label(name)], n)
            age.add_metric([label(name)], oldest)
        yield count
        yield age


class TriggerLag(Collector):
    """``mtask_trigger_lag_seconds{trigger}`` (the server's time less the time up to which
    every change is handled), ``mtask_trigger_held{trigger}`` (1 while a worker follows it) and
    ``mtask_trigger_paused{trigger}``, for every trigger and waited-on collection
    (``wait:<collection>``), from ``fetch`` (``TaskClient.triggers``: one read of the
    ``triggers`` collection), ``Fetched``; docs/triggers.md."""

    def __init__(self, fetch: Callable[[], list[dict[str, Any]]]) -> None:
        self.docs: Fetched[list[dict[str, Any]]] = Fetched(fetch, [])

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "mtask_trigger_lag_seconds",
                "Seconds between the server's time and the time up to which a trigger (or a "
                "waited-on collection, wait:<collection>) has handled every change",
                labels=["trigger"],
            ),
            GaugeMetricFamily(
                "mtask_trigger_held", "1 while a worker follows the trigger", labels=["trigger"]
            ),
            GaugeMetricFamily(
                "mtask_trigger_paused", "1 while the trigger is paused", labels=["trigger"]
            ),
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lag, held, paused = self._families()
        for doc in self.docs():
            trigger = label(follower_label(doc.get("kind"), label(doc.get("name"))))
            lag_ms = doc.get("lag_ms")
            if isinstance(lag_ms, int | float) and not isinstance(lag_ms, bool):
                lag.add_metric([trigger], max(0.0, lag_ms / 1000))
            held.add_metric([trigger], 1.0 if doc.get("held") else 0.0)
            paused.add_metric([trigger], 1.0 if doc.get("paused") else 0.0)
        yield lag
        yield held
        yield paused


class LimitUse(Collector):
    """``mtask_limit_runs_in_use{limit}`` (runs at once holding the limit's slot: units, issue
    62), ``mtask_limit_concurrency{limit}`` (its runs at once, if it sets some) and
    ``mtask_limit_backing_off{limit}`` (1 while a handler's BackOff holds it whole), for each
    task name with a limit and each shared resource (``resource:<name>``), from ``fetch``
    (``TaskClient.limit_gauges``: one read of the ``limits`` collection's names' and
    resources' documents), ``Fetched``."""

    def __init__(self, fetch: Callable[[], Sequence[Any]]) -> None:
        self.gauges: Fetched[Sequence[Any]] = Fetched(fetch, ())

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "mtask_limit_runs_in_use",
                "Runs at once holding a limit's slot (their units), per limit: a task name, or "
                "resource:<name>",
                labels=["limit"],
            ),
            GaugeMetricFamily(
                "mtask_limit_concurrency", "Runs at once a limit allows", labels=["limit"]
            ),
            GaugeMetricFamily(
                "mtask_limit_backing_off",
                "1 while a handler's BackOff holds the whole limit back",
                labels=["limit"],
            ),
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_use, concurrency, held = self._families()
        for gauge in self.gauges():
            limit = label(gauge.limit)
            in_use.add_metric([limit], gauge.in_use)
            if gauge.concurrency is not None:
                concurrency.add_metric([limit], gauge.concurrency)
            held.add_metric([limit], 1.0 if gauge.held else 0.0)
        yield in_use
        yield concurrency
        yield held


_cluster: dict[str, Collector] = {}
"""The cluster-wide collectors registered in this process, by metric: one of each."""


def _register(key: str, collector: Collector) -> Collector:
    """Register ``collector`` under ``key`` (a second call replaces the first)."""
    former = _cluster.pop(key, None)
    if former is not None:
        REGISTRY.unregister(former)
    REGISTRY.register(collector)
    _cluster[key] = collector
    return collector


def register_queue_depth(fetch: Callable[[], Mapping[str, Mapping[str, int]]]) -> PerName:
    """Report queue depth from ``fetch`` (one per process: a second call replaces it)."""
    depth = queue_depth(fetch)
    _register("queue_depth", depth)
    return depth


NOT_SPLIT = "pending_not_split"
"""The ``state`` label of pending tasks beyond the newest 1,000 of their name, not explained."""


def open_state_counts(client: Any) -> Mapping[str, Mapping[str, int]]:
    """The open tasks per name and derived state, from ``client.state_counts`` (the stored
    open statuses counted, the newest pending tasks of each name explained)."""
    split = client.state_counts(statuses=OPEN_STATUSES)
    counts = {name: dict(row) for name, row in split.counts.items()}
    for name, rest in split.unsplit.items():
        counts.setdefault(name, {})[NOT_SPLIT] = rest
    return counts


def register_cluster_metrics(client: Any) -> None:
    """Export the cluster-wide gauges (queue depth by status and by state; due tasks and the
    oldest due age; the triggers' lag; the limits' runs in use) from ``client`` (``stats()``,
    ``state_counts()``, ``due()``, ``triggers()`` and ``limit_gauges()``). Call it in ONE
    process per cluster: ``mtask serve``, or a worker started with ``--cluster-metrics``."""
    register_queue_depth(functools.partial(client.stats, statuses=OPEN_STATUSES))
    _register("open_states", open_states(functools.partial(open_state_counts, client)))
    _register("due", DueTasks(client.due))
    _register("lag", TriggerLag(client.triggers))
    _register("limits", LimitUse(client.limit_gauges))


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log on stderr for each scrape and probe."""


def serve_http(host: str, port: int, state: Callable[[], str]) -> ThreadingWSGIServer:
    """Serve ``/metrics`` (Prometheus), ``/healthz`` (200 unless the worker has stopped: a
    draining worker is alive) and ``/readyz`` (200 while it runs and claims) from a daemon
    thread. ``state`` is the worker's state (``ready``, ``running``, ``stopping``,
    ``stopped``); both probes answer ``{"state": …}`` as JSON."""
    metrics_app = make_wsgi_app()

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path not in ("/healthz", "/readyz"):
            body: Iterable[bytes] = metrics_app(environ, start_response)
            return body
        current = state()
        ok = current != "stopped" if path == "/healthz" else current == "running"
        start_response(
            "200 OK" if ok else "503 Service Unavailable",
            [("Content-Type", "application/json")],
        )
        return [json.dumps({"state": current}).encode()]

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="mtask-metrics").start()
    return server
