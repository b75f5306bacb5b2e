"""The two late-bound objects the worker's parts are wired with, made before either end.

Three pairs of parts would otherwise need each other at construction: the limit events the
finding parts see and the gate that reacts to them, the runs the lease pinger finds lost and
the executor that ends them, the slots that free and the shared stream that says so. Each pair
meets at a ``Signal`` made first: the sender is built with it, the receiver connects to it
when it is built. The shared stream's credit reads a ``Gauge`` the same way. Nothing is set on
a part after its construction, and nothing is ``None`` in between.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, ParamSpec

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
