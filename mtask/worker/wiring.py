"""The two late-bound objects the worker's parts are wired with, made before either end.

Pairs of parts would otherwise need each other at construction: the limit events the finding
parts see and the gate that reacts to them, the runs the lease pinger finds lost and the
executor that ends them, the slots that free and the shared stream that says so, the runs the
executor starts and ends and the claim side that learns from them. Each pair meets at a
``Signal`` made first: the sender is built with it, the receiver connects to it when it is
built. The shared stream's credit reads a ``Gauge`` the same way. Nothing is set on a part
after its construction, and nothing is ``None`` in between. ``Wires`` holds one worker's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec

P = ParamSpec("P")


class Signal(Generic[P]):
    """A call whose receivers connect when they are built; calls before then reach nobody."""

    def __init__(self) -> None:
        self._receivers: list[Callable[P, None]] = []

    def connect(self, receiver: Callable[P, None]) -> None:
        self._receivers.append(receiver)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for receiver in self._receivers:
            receiver(*args, **kwargs)


class Gauge:
    """A number read by one part and measured by another, built later (``0`` until then)."""

    def __init__(self) -> None:
        self._measure: Callable[[], int] = lambda: 0

    def measure_with(self, measure: Callable[[], int]) -> None:
        self._measure = measure

    def __call__(self) -> int:
        return self._measure()


@dataclass(frozen=True)
class Wires:
    """Every meeting point of one worker's parts, made before any part (``assembly.build``)."""

    freed: Signal[[]] = field(default_factory=Signal)
    """A run left the in-flight ledger: the shared stream may tell its relay it has room."""
    limit_changed: Signal[[str]] = field(default_factory=Signal)
    """A limit document changed (finding's event): a slot may have freed (the gate)."""
    limit_set: Signal[[str]] = field(default_factory=Signal)
    """A name's limit was set, changed or cleared: the gate reads it again."""
    limit_applied: Signal[[str]] = field(default_factory=Signal)
    """The gate applied a changed limit: the runs in flight are counted towards it."""
    stream_opened: Signal[[]] = field(default_factory=Signal)
    """An own stream opened afresh, or the relay said ``OPEN``: the gate reads every limit
    again."""
    group_freed: Signal[[str, str]] = field(default_factory=Signal)
    """A run of a group ended for good: its sequence's lock may be free (the gate)."""
    schedules_changed: Signal[[]] = field(default_factory=Signal)
    """A schedule changed (finding's event): the scheduler wakes."""
    lost: Signal[[str, dict[str, Any] | None]] = field(default_factory=Signal)
    """The pinger found a run's task another's: the executor stops the run."""
    slot_lost: Signal[[str, str]] = field(default_factory=Signal)
    """... or a limit's slot of the run another run's."""
    run_started: Signal[[str]] = field(default_factory=Signal)
    """The executor started a run of this key: it leaves the claim queue."""
    run_ended: Signal[[float]] = field(default_factory=Signal)
    """A run's handler ran this many seconds: the claim side learns whether to claim ahead."""
    unopened: Signal[[]] = field(default_factory=Signal)
    """A run met an encrypted task this worker cannot decrypt: its claims skip those it gave
    back (``ClaimCalls.met_unopened``)."""
    capacity: Gauge = field(default_factory=Gauge)
    """How many more runs the claimer would take: the shared stream's credit."""
