"""The worker: claims tasks, runs their handlers, records outcomes.

``Worker`` is a supervisor. Its parts are built once, in one place (``assembly.build``), and
held (``Worker.parts``); it reaches MongoDB, starts the
lease pinger thread and its side services, runs the ``Claimer``'s main loop until it is told
to stop, drains, and shuts down. The parts (see docs/worker.md, "The worker package"):

- the four wings, each building its own parts: finding work (``finding/``: the ``Finder`` and
  its sweep, fed by an ``OwnStream`` or the ``SharedStream``, whose relay is
  ``finding/shared/relay.py``); claiming (``claiming/``: the ``Claimer``'s main loop and claim
  path, River's producer, the ``LimitGate``); running (``running/``: the ``Executor``, one run
  from claim to outcome, the ``LeasePinger`` and the ``OutcomeRecorder``); reacting
  (``reacting/``: triggers and waits on data);
- below them: the ``ClaimQueue`` (claim_queue.py), which finding fills and claiming pops;
  ``InFlight`` (inflight.py), the runs in flight and the keys being claimed; the signals the
  parts meet at (wiring.py);
- ``Presence`` (presence.py): heartbeat, pause/resume, remote stop, peers (``Assignment``);
- the cluster's periodic chores (``maintenance/``: ``FlowSweep``, ``Scheduler``).

Lifecycle ``ready → running → stopping → stopped``. Side services are supervised: if one dies,
the worker stops at once and ``run()`` raises ``WorkerCrashed``, instead of living on
half-alive. Stopping has two steps: ``stop()`` stops claiming and lets runs in flight finish
within ``grace`` seconds; then (or at once with ``stop(immediate=True)``) the rest are
cancelled and their runs marked RELEASED, so another worker takes them at once without
spending a retry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any

from pymongo.errors import PyMongoError

from mtask import driver, store
from mtask.clock import Clock, ServerClock
from mtask.errors import MtaskError, StorageError, WorkerCrashed
from mtask.registry import Registry
from mtask.security import roles
from mtask.store import controls as control
from mtask.store import roles as store_roles
from mtask.worker import assembly
from mtask.worker.config import WorkerConfig, default_worker_id
from mtask.worker.presence import WorkerState
from mtask.worker.running.invoke import run_in_thread
from mtask.worker.stats import WorkerStats
from mtask.worker.worker_events import Event

__all__ = ["Worker", "WorkerConfig", "WorkerCrashed", "WorkerState", "WorkerStats"]

log = logging.getLogger(__name__)

DRAIN_WRITE_TIMEOUT = 30.0
"""How long, after its drain, a stopping worker waits in all on MongoDB and on its parts: its
last outcomes written, its side services ended, its slots given back, its document removed,
its clients closed. A wait still going then is given up (MongoDB out of reach: the outcomes
not written run out with their leases)."""
IMMEDIATE_STOP_TIMEOUT = 5.0
"""The same once the stop is immediate (a second signal): those waits end at most this long
after it, or after the drain if that ends later."""


async def together(*steps: Awaitable[Any]) -> None:
    """Await ``steps`` at once; the first to fail cancels the others (awaited), and its error
    is raised as it is (not in an ``ExceptionGroup``: the start-up's retry reads it)."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
    # every error read (a second one left unread is logged with its traceback when collected:
    # a worker whose role lacks two privileges at start-up printed one), the first raised
    errors = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
    if errors:
        raise errors[0]


def _connected(ping: asyncio.Future[Any]) -> None:
    if not ping.cancelled() and (exc := ping.exception()) is not None:
        log.debug("the lease pinger's client could not connect yet: %s", exc)


class Worker:
    """Run the handlers of ``registry``; the keyword arguments are ``WorkerConfig``'s."""

    def __init__(
        self, registry: Registry, *, config: WorkerConfig | None = None, **options: Any
    ) -> None:
        self.config = config or WorkerConfig(**options)
        self.names = self.config.chosen_names(registry)
        self.registry = registry
        self.worker_id = self.config.worker_id or default_worker_id()
        self.concurrency = self.config.concurrency
        self.grace = self.config.grace
        self.state: WorkerState = "ready"
        """Written by ``run`` and ``stop`` on the event loop's thread."""
        self.stats = WorkerStats()
        self.clock: Clock = self.config.clock or ServerClock()
        # A ServerClock (ours or an injected one) is calibrated here; other clocks are trusted.
        self._server_clock = self.clock if isinstance(self.clock, ServerClock) else None
        self._stop_now = asyncio.Event()
        self._stop_by: float | None = None
        """When (``time.monotonic``) the waits of stopping after the drain end, once it ended."""
        self._stop_now_at: float | None = None
        self._side: list[asyncio.Task[None]] = []
        self._side_cancelled = False
        """Set once stopping cancels the side services (``_shutdown``)."""
        self._crash: BaseException | None = None
        self._registered = False
        self._role_read = False
        """Whether the start-up read the user's privileges (once, beside its first attempt
        to reach MongoDB that got that far)."""
        """The worker's document was written (startup reached MongoDB): deregister on exit."""
        self._pinger_ready: asyncio.Future[Any] | None = None
        """The pinger's client's first ping, under way from the start-up on."""
        self.parts = assembly.build(
            self.config,
            registry,
            names=self.names,
            worker_id=self.worker_id,
            clock=self.clock,
            server_clock=self._server_clock,
            stats=self.stats,
            lifecycle=self,
        )

    # -- the public surface ---------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.parts.inflight)

    def stop(self, immediate: bool = False) -> None:
        """Stop claiming and drain within ``grace``; ``immediate`` cancels and releases now."""
        if self.state in ("ready", "running"):
            self.state = "stopping"
            self.parts.emit(Event.STOPPING, immediate=immediate)
        if immediate and not self._stop_now.is_set():
            self._stop_now_at = time.monotonic()
            self._stop_now.set()
        self.parts.wake.set()

    def _servers(self) -> str:
        """Which MongoDB this worker uses, as its first log line says: the servers its client
        found (``host:port``, or a Unix socket's path), never a password."""
        found = self.parts.aclient.topology_description.server_descriptions()
        return ",".join(
            f"{h}:{p}" if p and not str(h).endswith(".sock") else str(h) for h, p in found
        )

    async def run(self) -> None:
        """Run until stopped. Raises ``WorkerCrashed`` if a part of the worker died."""
        if self.state != "ready":
            raise MtaskError(f"a worker runs once; this one is {self.state}")
        self.state = "running"
        try:
            await self._startup()
            self._connect_pinger()
            if self.parts.process_pool is not None and self.config.pool == "process":
                await self.parts.process_pool.start(
                    self.concurrency
                )  # warm, before the first claim
            self.parts.pinger.start(asyncio.get_running_loop())
            self._supervise()
            self.parts.emit(
                Event.STARTED,
                names=self.names,
                concurrency=self.concurrency,
                mongodb=self._servers(),
                database=self.config.database,
            )
            await self.parts.claimer.run()
            await self._drain()
        finally:
            await self._shutdown()
        if self._crash is not None:
            raise WorkerCrashed(
                f"worker stopped because a part of it died: {self._crash!r}"
            ) from self._crash

    # -- startup and supervision ----------------------------------------------------------------

    async def _startup(self) -> None:
        """Reach MongoDB, retrying transient errors for up to ``startup_timeout`` seconds."""
        backoff = 0.5
        timeout = self.config.startup_timeout
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                # the privileges read beside the rest: a word in the log, which no claim waits
                # for (one round trip fewer before the first claim)
                await together(self._reach(), self._say_what_the_role_lacks())
                return
            except (StorageError, PyMongoError) as exc:
                error = exc if isinstance(exc, StorageError) else driver.storage_error(exc)
                if self.state != "running" or not error.transient:
                    raise error from exc
                if asyncio.get_running_loop().time() + backoff > deadline:
                    raise StorageError(
                        f"gave up after {timeout:g}s: {error}", transient=True
                    ) from exc
                log.warning(
                    "cannot reach MongoDB yet, retrying in %.1fs: %s",
                    backoff,
                    error,
                    extra={"worker_id": self.worker_id},
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10)

    async def _reach(self) -> None:
        """What the first claim needs, at once where nothing orders it: the clock
        calibrated and then the first heartbeat, which takes the clock's time and reads the
        paused names, and the limits read (which settles what a changed limit left, by the
        clock); beside them the indexes made (not a time decision; the claim waits for them: a
        group's lock is a unique index). The lease pinger's own client connects after, on a
        daemon thread (``_connect_pinger``)."""
        await together(self._calibrated_beat(), self.parts.driver.run(store.ensure_indexes()))

    async def _say_what_the_role_lacks(self) -> None:
        """Once: the privileges its part needs (``security.roles``) that its user lacks. It
        runs without them as far as it can: without its change stream it finds new work only
        by its sweep."""
        if self._role_read:  # said at an attempt before, which failed elsewhere
            return
        config = self.config
        try:
            status = await self.parts.driver.run(store_roles.connection_status())
        except StorageError as exc:  # a server (or proxy) that will not say: nothing to say
            log.debug("cannot read the user's privileges: %s", exc)
            return
        self._role_read = True
        part = "worker" if config.stream == "own" else "relay"
        if lacks := roles.lacking(part, status, config.database, config.collection):
            log.error(
                "the user's role lacks what a worker with --stream %s needs: %s; without its "
                "change stream it finds new work only by its sweep, every %gs (mtask collection "
                "roles; docs/deploy.md)",
                config.stream,
                "; ".join(lacks),
                config.sweep_interval,
                extra={"worker_id": self.worker_id},
            )

    async def _calibrated_beat(self) -> None:
        if self._server_clock is not None:
            await self._server_clock.calibrate_async(self.parts.adb)
        await together(self._beat(), self.parts.gate.refresh())

    async def _beat(self) -> None:
        await self.parts.presence.beat()
        self._registered = True

    def _connect_pinger(self) -> None:
        """The pinger's client connects now, on a thread, so that a claimed run's first ping
        (a ping interval after its claim) does not wait for a connection; the first claim does
        not wait for it either (its threads, measured, held the start-up's event loop back by
        tens of ms on a busy machine). Its failure is the pinger's to meet, at its pings."""
        command = self.parts.sclient.admin.command
        ping = asyncio.ensure_future(run_in_thread(command, "ping", name="mtask-pinger-connect"))
        ping.add_done_callback(_connected)
        self._pinger_ready = ping

    def _supervise(self) -> None:
        for service in self.parts.services:
            task = asyncio.create_task(service.run(), name=f"mtask-{service.name}")
            task.add_done_callback(self._side_done)
            self._side.append(task)

    def _side_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._crash is not None:
            return
        exc = task.exception()
        if self._side_cancelled:
            # told to end by ``_shutdown``: an error instead of the cancel (the driver's async
            # lock, cancelled with MongoDB gone, raises its own), or a return, is no part dying
            if exc is not None:
                log.warning("stopping: %s ended with %r", task.get_name(), exc)
            return
        self._crash = exc or RuntimeError(f"{task.get_name()} ended unexpectedly")
        log.error(
            "%s died: %r; stopping the worker",
            task.get_name(),
            self._crash,
            extra={"service": task.get_name()},
        )
        self.stop(immediate=True)

    # -- stopping -------------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Step one of stopping: let the runs in flight finish within ``grace`` (or until an
        immediate stop); step two: cancel and release the rest; then let their outcomes land."""
        await self.parts.executor.drain(self.grace, self._stop_now)
        self._stop_by = time.monotonic() + DRAIN_WRITE_TIMEOUT
        if self._crash is None:
            await self._bounded(self.parts.recorder.all_written.wait(), "the last outcomes")

    async def _bounded(self, call: Awaitable[Any], what: str) -> None:
        """Await ``call``, a step of stopping, until the waits of stopping end (``_stop_by``,
        sooner once the stop is immediate); then cancel it, log it and go on."""
        if self._stop_by is None:  # stopped before the drain (startup failed): from now
            self._stop_by = time.monotonic() + DRAIN_WRITE_TIMEOUT
        task = asyncio.ensure_future(call)
        now_waiter = asyncio.ensure_future(self._stop_now.wait())
        try:
            while not task.done():
                end = self._stop_by
                if self._stop_now_at is not None:
                    after = max(self._stop_now_at, self._stop_by - DRAIN_WRITE_TIMEOUT)
                    end = min(end, after + IMMEDIATE_STOP_TIMEOUT)
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                waiting = [task] if now_waiter.done() else [task, now_waiter]
                await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            now_waiter.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # none to see it
            log.warning(
                "stopping: gave up waiting for %s (MongoDB out of reach?)",
                what,
                extra={"worker_id": self.worker_id},
            )
        elif not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("stopping: %s failed: %s", what, exc, extra={"worker_id": self.worker_id})

    async def _shutdown(self) -> None:
        self._side_cancelled = True
        for task in self._side:
            task.cancel()
        if self._side:
            ended = asyncio.gather(*self._side, return_exceptions=True)
            await self._bounded(ended, "the side services to end")
        # slots kept for a handover no run will take
        given_back = self.parts.releases.flush(keep=False)
        await self._bounded(given_back, "the limit slots to be given back")
        # a ping on its way to a MongoDB out of reach holds the pinger's thread until its
        # socket times out: its stop waits on a thread of its own, left to end on its own
        stopping = run_in_thread(self.parts.pinger.stop, name="mtask-stop-pinger")
        await self._bounded(stopping, "the lease pinger to stop")
        if self.parts.process_pool is not None:
            await self.parts.process_pool.close()
        if self._registered:
            deregister = self.parts.driver.run(control.deregister(self.worker_id))
            await self._bounded(deregister, "the worker's document to be removed")
        # a client's close may wait on MongoDB (its cursors killed, its sessions ended); the
        # sync one's blocks its caller: on a thread of its own, left to run on if it must
        closing = asyncio.gather(
            self.parts.aclient.close(),
            run_in_thread(self.parts.sclient.close, name="mtask-close"),
        )
        await self._bounded(closing, "the MongoDB clients to close")
        self.state = "stopped"
        self.parts.emit(Event.STOPPED, stats=self.stats)
