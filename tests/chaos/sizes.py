"""How big each chaos scenario is: moderate in CI, big with ``--chaos-long``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Size:
    """How big each scenario is: moderate in CI, big with ``--chaos-long``."""

    tasks: int
    kill_rounds: int
    restarts: int
    failovers: int
    stream_kills: int
    publishers: int


MODERATE = Size(tasks=300, kill_rounds=5, restarts=1, failovers=1, stream_kills=3, publishers=4)
LONG = Size(tasks=3000, kill_rounds=25, restarts=3, failovers=3, stream_kills=15, publishers=8)
