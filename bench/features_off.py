"""Bench WB's worker-side variants: features of the worker's run path turned off *in the bench's
worker process only*, to find each one's share of a task's cost. The product has no
switch for them (a plain worker needs its metrics, its lease deadline and its claim's time
limit), so the bench replaces them here, in the process it starts, before the worker runs.

``MTASK_BENCH_OFF`` (comma-separated ``FEATURES``) names what to turn off; ``bench.app`` calls
``apply()`` on import, so ``spawn_worker`` with that variable set runs a worker without them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ENV = "MTASK_BENCH_OFF"


class _Nothing:
    """A metric child that records nothing: ``inc``, ``dec``, ``observe``, ``set``."""

    def inc(self, amount: float = 1) -> None:
        return None

    def dec(self, amount: float = 1) -> None:
        return None

    def observe(self, amount: float) -> None:
        return None

    def set(self, value: float) -> None:
        return None

    def labels(self, *args: Any, **kwargs: Any) -> _Nothing:
        return self


def _metrics() -> None:
    """Every Prometheus update the run path makes (per-name children, the in-flight gauge, the
    claim's latency histogram)."""
    from mtask import metrics

    nothing = _Nothing()
    metrics.by_name = lambda metric, name: nothing  # type: ignore[assignment]
    metrics.IN_FLIGHT = nothing  # type: ignore[assignment]
    metrics.CLAIM_LATENCY = nothing  # type: ignore[assignment]


def _lease_timer() -> None:
    """The local deadline of each run: the look at its lease's end that keeps the one timer
    (``Deadlines``) set for the earliest, which stops a run whose lease ran out by the
    process's own clock."""
    from mtask.worker.running.deadlines import Deadlines

    Deadlines.watch = lambda self, run: None  # type: ignore[method-assign]


def _claim_timeout() -> None:
    """The claim's client-side time limit (``pymongo.timeout`` around each claim call)."""
    from mtask.store import claims

    claims.CLAIM_TIMEOUT_S = None  # type: ignore[assignment]


FEATURES: dict[str, Callable[[], None]] = {
    "metrics": _metrics,
    "lease timer": _lease_timer,
    "claim timeout": _claim_timeout,
}


def apply() -> list[str]:
    """Turn off what ``MTASK_BENCH_OFF`` names; returns those names. An unknown name is an
    error (a typo would measure the shipped worker under another label)."""
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise SystemExit(f"{ENV}: unknown feature(s) {unknown}; known: {sorted(FEATURES)}")
    for name in names:
        FEATURES[name]()
    return names
