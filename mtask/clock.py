"""Server time. Every time decision in mtask uses the MongoDB server's clock.

``ServerClock`` asks the server for its time (``hello.localTime``), corrects by half the round
trip, and from then on returns ``server time at calibration + monotonic time elapsed``. The host's
wall clock is never read, so a host whose clock is off by minutes, or jumps, decides exactly as a
correct one does. Calibrate again from time to time to follow the server's own clock adjustments:
a worker does when its calibration is ``KEEP_BEST`` old, when the server's time its heartbeat
wrote disagrees with the calibration's, and when a heartbeat came back in under half the
calibration's round trip (``needs_calibration``), so a stepped server clock is followed within a
beat at no extra round trip; the heartbeat's time is weighed as a sample too (``offer``).

A calibration's error is up to half its round trip, and a round trip taken while the host is
loaded (many workers starting at once) is long and lopsided: the reply waits for a CPU, so the
estimate falls behind the server, and a worker behind the server misses the claims of tasks due
just now. So a calibration replaces the one in use only if its round trip was no longer (the
most precise measure wins), or the one in use is older than ``KEEP_BEST``, or the two disagree
by more than both their errors together (the server's clock was stepped).

Tests inject ``FixedClock`` (or any object with ``now()``) into the store.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

UTC = dt.UTC


class Clock(Protocol):
    def now(self) -> dt.datetime: ...


def _truncate_ms(value: dt.datetime) -> dt.datetime:
    """BSON dates hold milliseconds; keep Python values comparable with stored ones."""
    return value.replace(microsecond=value.microsecond // 1000 * 1000)


Sample = tuple[float, float, Mapping[str, Any]]

KEEP_BEST = 300.0
"""Seconds a calibration with the shortest round trip is kept over later, longer ones."""
HALF_MS = dt.timedelta(microseconds=500)
"""``localTime`` holds whole milliseconds: the server's time was up to 1 ms later."""


def _faster(best: Sample | None, sample: Sample) -> Sample:
    if best is None or sample[1] - sample[0] < best[1] - best[0]:
        return sample
    return best


class ServerClock:
    """Server time as ``offset + monotonic``; ``calibrate*`` measures the offset."""

    def __init__(
        self, monotonic: Callable[[], float] = time.monotonic, *, samples: int = 3
    ) -> None:
        self.monotonic = monotonic
        self.samples = samples
        """Round trips a calibration takes, the fastest kept (1: a command line's, which reads
        the time to show it and ends; a worker's claims decide by it: 3)."""
        """The monotonic clock the calibration runs on (a round trip to check is timed by it)."""
        # (server time, monotonic time) read together: one attribute, so a thread calling
        # now() while another calibrates never sees half of an update.
        self._anchor: tuple[dt.datetime, float] | None = None
        self.rtt = float("inf")
        """The round trip of the calibration in use, in seconds."""

    @property
    def calibrated(self) -> bool:
        return self._anchor is not None

    def _agrees(self, before: float, after: float, server_time: dt.datetime) -> bool:
        """Whether ``server_time``, read by the server within the round trip ``before`` →
        ``after``, agrees with the calibration in use within both their errors."""
        if server_time.tzinfo is None:
            server_time = server_time.replace(tzinfo=UTC)
        old = self._anchor
        if old is None:
            return False
        # read somewhere inside the round trip; assume the middle, and the middle of its
        # millisecond (the offset is good to half a millisecond plus rtt/2)
        rtt = after - before
        apart = abs((server_time + HALF_MS - old[0]).total_seconds() - (before + rtt / 2 - old[1]))
        return apart <= (rtt + self.rtt) / 2 + 0.001

    def _apply(self, before: float, after: float, reply: Mapping[str, Any]) -> None:
        server_time = reply["localTime"]
        if server_time.tzinfo is None:
            server_time = server_time.replace(tzinfo=UTC)
        rtt = after - before
        old = self._anchor
        # less precise than the one in use, which is recent enough: kept, unless the two
        # disagree by more than both errors together (the server's clock was stepped, or
        # another member with another clock became primary)
        recent = old is not None and rtt > self.rtt and after - old[1] < KEEP_BEST
        if recent and self._agrees(before, after, server_time):
            return
        self._anchor, self.rtt = (server_time + HALF_MS, before + rtt / 2), rtt

    def due(self) -> bool:
        """Whether to calibrate again: never calibrated, or ``KEEP_BEST`` ago (to follow the
        server's clock adjustments)."""
        anchor = self._anchor
        return anchor is None or self.monotonic() - anchor[1] >= KEEP_BEST

    def needs_calibration(self, before: float, after: float, server_time: Any) -> bool:
        """Whether to calibrate again, given the server's time read within ``before`` →
        ``after`` by this clock (a heartbeat's ``$currentDate``; anything else: not read):
        ``due``; a round trip under half the calibration's (a quieter moment than the one it
        was measured in, as after a start on a loaded host: a calibration now is more
        precise, and the most precise is kept); or a time that disagrees."""
        if self.due() or after - before < self.rtt / 2:
            return True
        return isinstance(server_time, dt.datetime) and not self._agrees(before, after, server_time)

    def offer(self, before: float, after: float, server_time: Any) -> None:
        """A server time read within ``before`` → ``after`` anyway (a heartbeat's), weighed as
        a calibration's sample is: kept if it is the more precise (so a calibration that came
        back slower than the beat does not leave the beat asking for another)."""
        if isinstance(server_time, dt.datetime):
            self._apply(before, after, {"localTime": server_time})

    def calibrate(self, db: Any, samples: int | None = None) -> None:
        """Measure the offset with a sync ``Database`` (the fastest of ``samples`` trips)."""
        best: tuple[float, float, Mapping[str, Any]] | None = None
        for _ in range(samples or self.samples):
            before = self.monotonic()
            reply = db.command("hello")
            best = _faster(best, (before, self.monotonic(), reply))
        self._apply(*best)  # type: ignore[misc]

    async def calibrate_async(self, db: Any, samples: int | None = None) -> None:
        """Measure the offset with an async ``AsyncDatabase`` (the fastest of ``samples``)."""
        best: tuple[float, float, Mapping[str, Any]] | None = None
        for _ in range(samples or self.samples):
            before = self.monotonic()
            reply = await db.command("hello")
            best = _faster(best, (before, self.monotonic(), reply))
        self._apply(*best)  # type: ignore[misc]

    def now(self) -> dt.datetime:
        anchor = self._anchor
        if anchor is None:
            raise RuntimeError("ServerClock.now() before calibrate()")
        base, base_mono = anchor
        return _truncate_ms(base + dt.timedelta(seconds=self.monotonic() - base_mono))


class FixedClock:
    """A clock for tests: returns ``value`` until moved with ``advance``/``set``."""

    def __init__(self, value: dt.datetime) -> None:
        self.value = _truncate_ms(value)

    def now(self) -> dt.datetime:
        return self.value

    def advance(self, **delta: float) -> dt.datetime:
        self.value = _truncate_ms(self.value + dt.timedelta(**delta))
        return self.value

    def set(self, value: dt.datetime) -> None:
        self.value = _truncate_ms(value)
