"""The worker's counters (``Worker.stats``): claims, runs and how they ended."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerStats:
    claim_calls: int = 0
    claim_attempts: int = 0
    """Keys tried in claims (for the stampede measure: attempts per claimed task)."""
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    retried: int = 0
    lease_lost: int = 0
    slots_lost: int = 0
    """Runs stopped because a limit's slot they held was taken by another (their task given
    back: RELEASED)."""
    released: int = 0
    cancelled: int = 0
    waiting: int = 0
    continued: int = 0
    snoozed: int = 0
    """Runs whose handler raised ``Snooze``."""
