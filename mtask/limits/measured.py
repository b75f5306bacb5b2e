"""A shared resource's limit in measured units (docs/flow-control.md#limits-in-tokens): at most
``N`` tokens a window (``set_limit(resource=…, tokens_per=(N, seconds))``), counted as the
runs that use it charge them (``ctx.record_usage``: input + output tokens), since a call's size
is known only once it has returned.

The resource's document holds the limit and the current window::

    {measured_limit: N, measured_window_ms: W, measured_at: date, measured_used: tokens}

Windows are fixed, ``W`` milliseconds long, aligned on the epoch of the server's clock
(``$$NOW``): ``measured_at`` is the start of the window ``measured_used`` counts. A take of the
resource's slot, and each step of a run that holds it, is admitted only while the current
window's count is below ``N`` (a ``measured_at`` of an older window counts nothing): one more
term of the take's filter, the whole filter of a step's admission (``room``; ``admitted``). A
charge adds its tokens to the current window, starting it afresh if the stored one is older
(``charged``): one update. All read the window from ``$$NOW``, never a worker's clock.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtask.driver import Doc
from mtask.errors import InvalidTask

LIMIT = "measured_limit"
WINDOW = "measured_window_ms"
AT = "measured_at"
USED = "measured_used"
FIELDS = (LIMIT, WINDOW, AT, USED)

MAX_TOKENS = 10**15
MAX_WINDOW_S = 31 * 24 * 3600.0
MAX_WINDOW_MS = int(MAX_WINDOW_S * 1000)


def validate(tokens_per: object) -> tuple[int, int]:
    """``tokens_per=(N, seconds)``: ``N`` an integer from 1 to ``MAX_TOKENS``, the window a
    number of seconds above 0 (at least a millisecond) and at most 31 days. Returns ``(N,
    window in milliseconds)``."""
    if not isinstance(tokens_per, tuple | list) or len(tokens_per) != 2:
        raise InvalidTask("must be a pair (tokens, seconds)", field="tokens_per")
    tokens, seconds = tokens_per
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
        raise InvalidTask(
            f"the tokens must be an integer from 1 to {MAX_TOKENS}", field="tokens_per"
        )
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not math.isfinite(seconds)
        or not 0.001 <= seconds <= MAX_WINDOW_S
    ):
        raise InvalidTask(
            "the window must be a number of seconds from 0.001 to 31 days", field="tokens_per"
        )
    return tokens, round(seconds * 1000)


def parse(text: str) -> tuple[int, float]:
    """``"90000/m"``, ``"5000/s"``, ``"2000000/h"`` or ``"500/30"`` (a window of 30 seconds):
    ``(tokens, seconds)``, checked by ``validate``."""
    value, _, unit = text.strip().partition("/")
    unit = unit.strip().lower()
    seconds: float | None = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}.get(unit)
    if seconds is None:
        try:
            seconds = float(unit)
        except ValueError:
            seconds = None
    try:
        tokens = int(value)
    except ValueError:
        tokens = None
    if seconds is None or tokens is None:
        raise InvalidTask(
            f"{text!r} is not a number of tokens a window like 90000/m, 5000/s or 500/30",
            field="tokens_per",
        )
    validate((tokens, seconds))
    return tokens, seconds


def of(doc: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """A document's limit in tokens ``(N, window ms)``, or ``None`` if it sets none (as the
    take reads it: both numbers; a window written by hand out of range is read as the take
    reads it, ``_width``)."""
    if doc is None:
        return None
    limit, window = doc.get(LIMIT), doc.get(WINDOW)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (limit, window)):
        return None
    assert isinstance(limit, int | float) and isinstance(window, int | float)
    width = 1 if window != window else int(max(1, min(window, MAX_WINDOW_MS)))
    if limit != limit:  # NaN: no count is below it
        return 0, width
    return (math.ceil(limit) if math.isfinite(limit) else MAX_TOKENS), width


def _width() -> Doc:
    """The window in milliseconds, as a long: one written by hand below a millisecond (or NaN,
    or no number) is read as one, above 31 days as 31 days (no conversion can fail)."""
    bounded = {"$max": [1, {"$min": [f"${WINDOW}", MAX_WINDOW_MS]}]}
    return {"$toLong": {"$cond": [{"$isNumber": f"${WINDOW}"}, bounded, 1]}}


def _used() -> Doc:
    """The stored window's count (one written by hand that is no number: none)."""
    return {"$cond": [{"$isNumber": f"${USED}"}, f"${USED}", 0]}


def _window_start() -> Doc:
    """The start of the current window, on the server's clock."""
    width = _width()
    return {"$subtract": ["$$NOW", {"$mod": [{"$toLong": "$$NOW"}, width]}]}


def _is_set() -> Doc:
    return {"$and": [{"$isNumber": f"${LIMIT}"}, {"$isNumber": f"${WINDOW}"}]}


def room() -> Doc:
    """The take's term: no limit in tokens, or a window with room (its count below ``N``; a
    stored window older than the current one counts nothing)."""
    return {
        "$or": [
            {"$not": [_is_set()]},
            {"$ne": [f"${AT}", _window_start()]},
            {"$lt": [_used(), f"${LIMIT}"]},
        ]
    }


def charged(tokens: int, taken_at: str) -> list[Doc]:
    """The update of a resource's document charging ``tokens`` to its current window (a
    stored window older than it starts afresh); ``taken_at``: the field the workers' change
    streams leave out (a charge frees no room: nobody waiting needs to hear of it)."""
    start = _window_start()
    used = {
        "$cond": [
            {"$eq": [f"${AT}", start]},
            {"$add": [_used(), tokens]},
            tokens,
        ]
    }
    return [{"$set": {USED: used, AT: start, taken_at: "$$NOW"}}]


def admitted(taken_at: str) -> list[Doc]:
    """The update of a resource's document that admits a step (its filter: ``room``): the
    current window made the stored one (a stored window older than it starts afresh, at
    nothing), so what a reader sees is the window the step is charged to; ``taken_at``: as
    ``charged``'s (an admission frees no room)."""
    start = _window_start()
    used = {"$cond": [{"$eq": [f"${AT}", start]}, _used(), 0]}
    return [{"$set": {USED: used, AT: start, taken_at: "$$NOW"}}]


def window_wait(doc: Mapping[str, Any], now: dt.datetime) -> float | None:
    """Seconds until a resource whose current window is full (as read) has room again: the
    window's end (``None``: no limit in tokens, or room now)."""
    limit = of(doc)
    at, used = doc.get(AT), doc.get(USED)
    if limit is None or not isinstance(at, dt.datetime) or not isinstance(used, int | float):
        return None
    ends = at + dt.timedelta(milliseconds=limit[1])
    if used < limit[0] or ends <= now:
        return None
    return (ends - now).total_seconds()


@dataclass(frozen=True)
class Window:
    """A resource's current window of tokens, as shown (``mtask limits``, the dashboard, why a
    task waits): its limit ``tokens_per`` (N, seconds), the tokens ``charged`` in it, its
    ``start`` and ``end``."""

    limit: int
    seconds: float
    charged: int
    start: dt.datetime
    end: dt.datetime

    @property
    def full(self) -> bool:
        """No take nor step is admitted until ``end``."""
        return self.charged >= self.limit

    def describe(self) -> str:
        said = f"{self.charged} of {self.limit} tokens charged in this {self.seconds:g} s window"
        return said + (f", full until {self.end:%H:%M:%S} UTC" if self.full else "")


def current(doc: Mapping[str, Any] | None, now: dt.datetime) -> Window | None:
    """``doc``'s current window at ``now`` (the server's time), as its take reads it: a
    stored window older than the current one counted nothing of it. ``None``: no limit in
    tokens."""
    limit = of(doc)
    if limit is None:
        return None
    assert doc is not None
    tokens, width = limit
    epoch_ms = math.floor(now.timestamp() * 1000)
    start = dt.datetime.fromtimestamp((epoch_ms - epoch_ms % width) / 1000, dt.UTC)
    at, used = doc.get(AT), doc.get(USED)
    same = isinstance(at, dt.datetime) and at.astimezone(dt.UTC) == start
    charged = int(used) if same and isinstance(used, int | float) and used == used else 0
    return Window(tokens, width / 1000, charged, start, start + dt.timedelta(milliseconds=width))


def slots_of(
    name: str, uses: Mapping[str, tuple[str, ...]], docs: Mapping[str, Mapping[str, Any]]
) -> tuple[str, ...]:
    """The slots of the shared resources with a limit in tokens that ``name``'s runs take
    (``uses``: a worker's ``LimitGate.uses``; ``docs``: its limit documents as last read)."""
    return tuple(s for s in uses.get(name, ()) if of(docs.get(s)) is not None)
