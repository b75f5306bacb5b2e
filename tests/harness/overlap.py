"""How many runs overlapped: the most at once among (start, end) spans."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def peak(runs: Iterable[Sequence[Any]]) -> int:
    """The most runs at once among (start, end) pairs (times, or numbers of one clock); a run
    ending at the instant another starts is not counted with it (an end sorts before a start
    at the same instant)."""
    runs = list(runs)
    points = sorted([(s, 1) for s, _ in runs] + [(e, -1) for _, e in runs])
    running = most = 0
    for _, step in points:
        running += step
        most = max(most, running)
    return most
