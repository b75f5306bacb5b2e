"""``raise mtask.Snooze(seconds)``: a handler's request to run its task again later without
spending a try of its retry budget (pure).

A snoozed run ends ``SNOOZED``: its task is pending again, claimable ``seconds`` after the
outcome's write on the server's clock (``store.outcomes``), its ``failures`` untouched and its
``snoozes`` counted. ``attempts`` still counts the run (it started); the retry budget
(``max_retries``) counts failures only, so no number of snoozes fails a task. A snooze past
the task's ``deadline`` is cut to it, as a retry's backoff is.
"""

from __future__ import annotations

import datetime as dt

from mtask.vocabulary import MAX_RETRY_DELAY_MS, delay_ms


class Snooze(Exception):
    """Raise from a handler to run the task again in ``seconds`` (a number or a timedelta, from
    0 to 30 days) without spending a retry; ``reason`` is shown with the task."""

    def __init__(self, seconds: float | dt.timedelta, reason: str = "snoozed") -> None:
        super().__init__(seconds, reason)
        self.delay_ms = snooze_delay_ms(seconds)
        self.reason = reason

    @property
    def seconds(self) -> float:
        return self.delay_ms / 1000

    def __str__(self) -> str:
        return f"{self.reason} for {self.seconds:g} s"


def snooze_delay_ms(seconds: object) -> int:
    """A snooze's delay in milliseconds, or ``ValueError`` naming what was given: a number of
    seconds (or a timedelta) from 0 to ``MAX_RETRY_DELAY_MS`` (30 days)."""
    ms = delay_ms(seconds)
    if ms is None:
        raise ValueError(
            f"Snooze needs a number of seconds from 0 to {MAX_RETRY_DELAY_MS // 1000} "
            f"(30 days), not {seconds!r}"
        )
    return ms
