"""``ServerClock`` without MongoDB: the most precise calibration wins, for a while."""

from __future__ import annotations

import datetime as dt
from typing import Any

from mtask.clock import KEEP_BEST, ServerClock

T0 = dt.datetime(2046, 3, 1, 12, 0, tzinfo=dt.UTC)


class Hello:
    """A server whose time is ``T0 + real time``, read ``at`` into each round trip."""

    def __init__(self, mono: list[float]) -> None:
        self.mono = mono
        self.trips: list[tuple[float, float]] = []  # (round trip, when the server reads)
        self.offset = 0.0

    def command(self, name: str) -> dict[str, Any]:
        rtt, at = self.trips.pop(0)
        self.mono[0] += at
        local = T0 + dt.timedelta(seconds=self.mono[0] + self.offset)
        self.mono[0] += rtt - at
        return {"localTime": local.replace(microsecond=local.microsecond // 1000 * 1000)}


def test_a_longer_round_trip_does_not_replace_a_recent_precise_one() -> None:
    mono = [100.0]
    clock = ServerClock(lambda: mono[0])
    server = Hello(mono)
    server.trips = [(0.002, 0.001)]  # 2 ms, read in the middle
    clock.calibrate(server, samples=1)
    truth = lambda: T0 + dt.timedelta(seconds=mono[0])  # noqa: E731
    assert abs((clock.now() - truth()).total_seconds()) <= 0.0015
    mono[0] += 10
    server.trips = [(0.080, 0.001)]  # a loaded host: the reply waited 79 ms for a CPU
    clock.calibrate(server, samples=1)
    assert abs((clock.now() - truth()).total_seconds()) <= 0.0015  # kept the precise one
    assert round(clock.rtt, 6) == 0.002
    mono[0] += KEEP_BEST
    server.trips = [(0.010, 0.005)]  # the precise one is old now: the next one replaces it
    clock.calibrate(server, samples=1)
    assert round(clock.rtt, 6) == 0.010 and abs((clock.now() - truth()).total_seconds()) <= 0.0015


def test_an_even_more_precise_calibration_replaces_the_one_in_use() -> None:
    mono = [5.0]
    clock = ServerClock(lambda: mono[0])
    server = Hello(mono)
    server.trips = [(0.060, 0.005)]  # started on a loaded host: the reply waited, 25 ms behind
    clock.calibrate(server, samples=1)
    truth = lambda: T0 + dt.timedelta(seconds=mono[0])  # noqa: E731
    assert (truth() - clock.now()).total_seconds() > 0.02
    mono[0] += 4
    server.trips = [(0.001, 0.0005)]
    clock.calibrate(server, samples=1)
    assert abs((clock.now() - truth()).total_seconds()) <= 0.0015


def test_a_step_of_the_servers_clock_is_followed_at_once() -> None:
    mono = [50.0]
    clock = ServerClock(lambda: mono[0])
    server = Hello(mono)
    server.trips = [(0.002, 0.001)]
    clock.calibrate(server, samples=1)
    mono[0] += 10
    server.trips = [(0.020, 0.010)]
    clock.calibrate(server, samples=1)
    assert round(clock.rtt, 6) == 0.002  # no step: the precise one stays
    server.offset = 2.0  # the server's clock is stepped 2 s ahead (another primary, NTP)
    mono[0] += 10
    server.trips = [(0.020, 0.010)]
    clock.calibrate(server, samples=1)
    truth = T0 + dt.timedelta(seconds=mono[0] + 2.0)
    assert abs((clock.now() - truth).total_seconds()) <= 0.011


def test_a_heartbeats_server_time_asks_for_a_calibration_only_when_it_disagrees_or_is_old() -> None:
    mono = [10.0]
    clock = ServerClock(lambda: mono[0])
    assert clock.needs_calibration(10.0, 10.001, T0)  # never calibrated
    server = Hello(mono)
    server.trips = [(0.002, 0.001)]
    clock.calibrate(server, samples=1)
    mono[0] += 30

    def beat(rtt: float, at: float, offset: float = 0.0) -> bool:
        """A heartbeat of round trip ``rtt`` whose write reads the server's clock ``at`` into
        it (``$currentDate``: whole milliseconds), ``offset`` seconds off the true time."""
        before = mono[0]
        local = T0 + dt.timedelta(seconds=before + at + offset)
        mono[0] += rtt
        written = local.replace(microsecond=local.microsecond // 1000 * 1000)
        return clock.needs_calibration(before, mono[0], written)

    assert not beat(0.004, 0.001)  # agrees: no round trip spent
    assert not beat(0.030, 0.029)  # lopsided but within its own error
    assert beat(0.004, 0.002, offset=0.5)  # the server's clock was stepped
    assert beat(0.004, 0.002, offset=-0.01)  # or slewed past both errors
    assert not clock.needs_calibration(mono[0], mono[0] + 0.003, None)  # no time read
    mono[0] = 10.0 + KEEP_BEST
    assert clock.needs_calibration(mono[0], mono[0] + 0.001, None)  # old: calibrate again
    server.trips = [(0.040, 0.001)]  # a start on a loaded host: 40 ms, lopsided
    clock.calibrate(server, samples=1)
    assert not beat(0.030, 0.015)
    assert beat(0.012, 0.006)  # a quieter moment than the calibration's: a better one now
    # a beat's own sample, offered, is kept if it is the more precise: a calibration that came
    # back slower than the beat does not leave the next beats asking for another
    before = mono[0]
    local = T0 + dt.timedelta(seconds=before + 0.006)
    mono[0] += 0.012
    clock.offer(before, mono[0], local.replace(microsecond=local.microsecond // 1000 * 1000))
    assert round(clock.rtt, 6) == 0.012
    assert not beat(0.012, 0.006)
    assert abs((clock.now() - (T0 + dt.timedelta(seconds=mono[0]))).total_seconds()) <= 0.007


def test_a_calibration_takes_the_clocks_samples_the_fastest_kept() -> None:
    """Three round trips by default (a worker's claims decide by the clock), one for a
    clock made with ``samples=1`` (a command line's, which only shows times)."""
    mono = [100.0]
    server = Hello(mono)
    server.trips = [(0.030, 0.029), (0.002, 0.001), (0.040, 0.001)]
    clock = ServerClock(lambda: mono[0])
    clock.calibrate(server)
    assert server.trips == [] and round(clock.rtt, 6) == 0.002
    once = ServerClock(lambda: mono[0], samples=1)
    server.trips = [(0.030, 0.029), (0.002, 0.001)]
    once.calibrate(server)
    assert server.trips == [(0.002, 0.001)] and round(once.rtt, 6) == 0.030
