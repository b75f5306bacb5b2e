"""A test clock that skips time, on the real server: ``TimeSkippingEnv``.

Every time decision in mtask is made on the MongoDB server's clock (``$$NOW``, and the workers'
and clients' ``ServerClock``, calibrated from ``hello.localTime``). So the environment moves the
server's clock and nothing else: it starts its own embedded mongod under libfaketime, whose
offset it reads from a file (``FAKETIME_TIMESTAMP_FILE``, read again once a second:
``FAKETIME_CACHE_DURATION``; its monotonic clocks stay real: ``FAKETIME_DONT_FAKE_MONOTONIC``,
so its elections and timeouts run on real time). ``skip`` writes a larger offset, waits until
the server's clock shows it, calibrates the client's and each worker's clock at once (a worker
would within a beat: its heartbeat's ``$currentDate`` disagrees with its clock), and then wakes
each worker's claimer and scheduler with the hints a publish and a schedule's change give, so
what became due is taken now rather than when their host-side timers end. Delays, sleeps,
retries, snoozes, leases, deadlines, schedules and debounce windows are all dates compared with
the server's time; none has a path of its own for tests (docs/design.md, "The time rule").

The offset only grows: ``skip`` refuses a negative or unknown amount, so the clock never runs
backward. ``wait`` (and ``run_until``) skip automatically: whenever nothing is running and
nothing is due (``store.queries.quiet_until``), twice ``SETTLE`` apart, time jumps to the
soonest due time (a task's ``next_claim_at``, a schedule's ``next_tick_at``). A due task held
back by a back-off or a full limit counts as not due: then time jumps to the soonest end of what
holds the due tasks, if sooner (``store.queries.held_due_ends``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import glob
import math
import os
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from pymongo import AsyncMongoClient

from mtask.client import AsyncTaskClient
from mtask.clock import ServerClock
from mtask.driver import AsyncDriver, collections
from mtask.embedded import EmbeddedMongo
from mtask.errors import ConfigError
from mtask.models import Task
from mtask.registry import Registry
from mtask.store.queries import quiet_until
from mtask.worker import Worker

T = TypeVar("T")

LIBFAKETIME_GLOBS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)
"""Where libfaketime's preload library is installed (Debian and Ubuntu, a source build). Linux
only: mongod is started with ``LD_PRELOAD``."""
SETTLE = 0.1
"""Seconds between the two looks that must both find nothing to do before an automatic skip
(a run that just ended may publish its follow-ups, its children, right after its outcome)."""
STOP_WITHIN = 1.0
"""Seconds a server in a temporary directory has to shut down before it is killed."""
FOLLOW_WITHIN = 20.0
"""Seconds the server and each worker have to show a skipped clock before ``skip`` fails."""


def find_libfaketime() -> Path:
    """libfaketime's preload library: ``MTASK_LIBFAKETIME``, else where packages put it;
    ``ConfigError`` naming it when it is not there."""
    override = os.environ.get("MTASK_LIBFAKETIME")
    if override:
        if Path(override).is_file():
            return Path(override)
        raise ConfigError(f"MTASK_LIBFAKETIME={override} is not a file (libfaketime.so.1)")
    for pattern in LIBFAKETIME_GLOBS:
        for found in sorted(glob.glob(pattern)):
            return Path(found)
    raise ConfigError(
        "libfaketime is not installed: TimeSkippingEnv runs MongoDB under it to skip time "
        "(Linux only; Debian/Ubuntu: apt-get install libfaketime; or set MTASK_LIBFAKETIME to "
        "its libfaketime.so.1)"
    )


def _seconds(by: float | dt.timedelta) -> float:
    seconds = by.total_seconds() if isinstance(by, dt.timedelta) else float(by)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"skip moves time forward only: {by!r} is not a duration of 0 or more")
    return seconds


class TimeSkippingEnv:
    """The embedded MongoDB on a clock that ``skip`` moves forward, ``workers`` workers of
    ``registry`` in this event loop, and ``client`` (an ``AsyncTaskClient``) on that clock::

        async with TimeSkippingEnv(registry) as env:
            await env.client.publish("remind", "r-1", {}, delay=dt.timedelta(days=30))
            task = await env.wait("r-1")  # skips the 30 days, in seconds

    ``worker_options`` go to each ``Worker`` (``concurrency``, ``heartbeat_interval``…);
    ``data_dir`` keeps the server's files (a temporary directory by default)."""

    def __init__(
        self,
        registry: Registry,
        *,
        workers: int = 1,
        database: str = "mtask",
        data_dir: str | os.PathLike[str] | None = None,
        **worker_options: Any,
    ) -> None:
        self.registry = registry
        self.database = database
        self.worker_count = workers
        self.worker_options = {"heartbeat_interval": 0.2, **worker_options}
        self._data_dir = data_dir
        self._temporary = data_dir is None
        self._stack = contextlib.AsyncExitStack()
        self.offset = 0.0
        """Seconds the server's clock is ahead of real time: the sum of the skips."""
        self.clock = ServerClock()
        """The client's clock, calibrated again after each skip."""
        self.workers: list[Worker] = []
        self._runs: list[asyncio.Task[None]] = []

    # -- starting and stopping ------------------------------------------------------------

    async def __aenter__(self) -> TimeSkippingEnv:
        library = find_libfaketime()
        try:
            await self._start(library)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stack.aclose()

    def _prepare(self) -> Path:
        """The data directory (a temporary one unless given), with the offset file at 0."""
        if self._data_dir is None:
            home = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="mtask-skip-"))
            self._data_dir = home
        data_dir = Path(self._data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self._offset_file = data_dir / "faketime.rc"
        self._write_offset()
        return data_dir

    async def _start(self, library: Path) -> None:
        data_dir = self._prepare()
        server = EmbeddedMongo(
            data_dir,
            environment={
                "LD_PRELOAD": str(library),
                "FAKETIME_TIMESTAMP_FILE": str(self._offset_file),
                "FAKETIME_CACHE_DURATION": "1",
                "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            },
        )
        self.uri = await asyncio.to_thread(server.start)
        # a server of its own in a temporary directory needs no clean shutdown: killed after
        # STOP_WITHIN seconds (its files are removed next)
        stop_within = STOP_WITHIN if self._temporary else 30.0
        self._stack.push_async_callback(asyncio.to_thread, server.stop, stop_within)
        self._mongo: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(self.uri, tz_aware=True)
        self._stack.push_async_callback(self._mongo.close)
        db = self._mongo[self.database]
        self._driver = AsyncDriver(collections(db, "tasks"))
        await self.clock.calibrate_async(db)
        self.client = AsyncTaskClient(self.uri, database=self.database, clock=self.clock)
        self._stack.push_async_callback(self.client.close)
        self._stack.push_async_callback(self._stop_workers)
        for _ in range(self.worker_count):
            await self.start_worker()

    async def start_worker(self, **options: Any) -> Worker:
        """One more worker of the registry (``options``: over the environment's), running
        until the environment ends; returned once it is ready to claim."""
        worker = Worker(
            self.registry,
            uri=self.uri,
            database=self.database,
            **{**self.worker_options, **options},
        )
        run = asyncio.create_task(worker.run())
        self.workers.append(worker)
        self._runs.append(run)
        while not worker.parts.finding.finder.ready.is_set():
            if run.done():
                run.result()  # its error
            await asyncio.sleep(0.01)
        return worker

    async def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.stop(immediate=True)
        if self._runs:
            await asyncio.gather(*self._runs)

    def _write_offset(self) -> None:
        tmp = self._offset_file.with_suffix(".tmp")
        tmp.write_text(f"+{self.offset:.3f}s\n")
        tmp.replace(self._offset_file)  # never read half written

    # -- time -----------------------------------------------------------------------------

    async def now(self) -> dt.datetime:
        """The server's time now (``hello.localTime``)."""
        reply = await self._mongo.admin.command("hello")
        when: dt.datetime = reply["localTime"]
        return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)

    async def skip(self, by: float | dt.timedelta) -> dt.datetime:
        """Move the server's clock ``by`` (seconds or a timedelta, 0 or more) forward, and
        return once the server, the client and every worker read a time at least that much
        later than before, and the workers were woken to claim what became due. Returns the
        server's time then."""
        seconds = _seconds(by)
        target = await self.now() + dt.timedelta(seconds=seconds)
        self.offset += seconds
        self._write_offset()
        await self._until(lambda: self._server_at(target), "the server's clock")
        await self.clock.calibrate_async(self._mongo[self.database])
        for worker in self.workers:
            await self._follow(worker, target)
        return await self.now()

    async def _follow(self, worker: Worker, target: dt.datetime) -> None:
        """``worker``'s clock at ``target`` or later, then its claimer and scheduler woken as
        a publish and a schedule's change wake them (what became due is taken now, not when
        their host-side timers end). Its clock is calibrated now, as its next heartbeat would
        (the beat's ``$currentDate`` disagrees with the clock: ``ServerClock``)."""
        if isinstance(worker.clock, ServerClock) and worker.clock.calibrated:
            await worker.clock.calibrate_async(worker.parts.adb)
        await self._until(lambda: _reads(worker, target), "a worker's clock")
        worker.parts.scheduler.wake.set()
        worker.parts.wake.set()

    async def _server_at(self, target: dt.datetime) -> bool:
        return await self.now() >= target

    async def _until(self, check: Any, what: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FOLLOW_WITHIN
        while not await check():
            if loop.time() > deadline:
                raise TimeoutError(f"{what} did not show the skipped time in {FOLLOW_WITHIN} s")
            await asyncio.sleep(0.01)

    # -- skipping by itself ---------------------------------------------------------------

    async def skip_if_idle(self) -> bool:
        """Skip to the soonest due time (or end of what holds the due tasks back) if nothing
        is running or claimable, twice ``SETTLE`` apart; whether it skipped."""
        first = await self._idle_until()
        if first is None:
            return False
        await asyncio.sleep(SETTLE)
        again = await self._idle_until()
        if again is None or again[1] != first[1]:
            return False
        now, at = again
        await self.skip(max(0.0, (at - now).total_seconds()))
        return True

    async def _idle_until(self) -> tuple[dt.datetime, dt.datetime] | None:
        if any(len(w.parts.inflight) or w.parts.queue.due(w.clock.now()) for w in self.workers):
            return None
        now = await self.now()
        quiet, at = await self._driver.run(quiet_until(now))
        return (now, at) if quiet and at is not None else None

    async def run_until(self, awaitable: Awaitable[T], *, timeout: float = 120.0) -> T:  # noqa: ASYNC109
        """Await ``awaitable``, skipping time whenever nothing is running or due (the
        automatic mode); ``TimeoutError`` after ``timeout`` seconds of real time."""
        waiter = asyncio.ensure_future(awaitable)
        try:
            async with asyncio.timeout(timeout):
                while not waiter.done():
                    if not await self.skip_if_idle():
                        await asyncio.wait({waiter}, timeout=SETTLE)
                return await waiter
        finally:
            waiter.cancel()

    async def wait(self, key: str, *, timeout: float = 120.0) -> Task:  # noqa: ASYNC109
        """The task ``key`` once it finished (``client.wait``), skipping time meanwhile."""
        return await self.run_until(self.client.wait(key, timeout=timeout), timeout=timeout)


async def _reads(worker: Worker, target: dt.datetime) -> bool:
    return worker.clock.now() >= target
