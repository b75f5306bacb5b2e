"""How mtask says times and counts to a person (pure): a span of time (``21 s``, ``3 min``), a
moment relative to now (``in 3 min``, ``2 h ago``), a date (UTC) and a counted noun
(``1 line``, ``2 lines``). The task page, ``mtask get`` and the reasons of ``mtask.explain.states``
say them the same way."""

from __future__ import annotations

import datetime as dt

from mtask.steps import NEVER


def span(seconds: float) -> str:
    """A length of time, rounded to what a person reads: ``800 ms``, ``21 s``, ``3 min``,
    ``2.5 h``, ``4 d``."""
    seconds = abs(seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 100:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} d"


def relative(at: dt.datetime | None, now: dt.datetime) -> str:
    """``in 3 min`` or ``3 min ago`` (``now``: the server's time); ``-`` for no time, ``never``
    for a wait without a deadline."""
    if at is None:
        return "-"
    if at.year >= NEVER.year:
        return "never"
    seconds = (at - now).total_seconds()
    if abs(seconds) < 0.5:
        return "now"
    return f"in {span(seconds)}" if seconds > 0 else f"{span(seconds)} ago"


def when(at: dt.datetime | None) -> str:
    """A date as the pages and the reasons print it: ``2026-11-28 03:12:17`` (UTC)."""
    return at.strftime("%Y-%m-%d %H:%M:%S") if at is not None else "-"


def plural(count: int, noun: str, many: str | None = None) -> str:
    """``1 line``, ``2 lines``, ``1 failed try``, ``3 failed tries`` (``many``: an irregular
    plural)."""
    return f"{count} {noun if count == 1 else (many or noun + 's')}"
