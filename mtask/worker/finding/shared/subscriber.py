"""A worker's side of the shared stream (``--stream shared``): relay holder or subscriber.

Each worker reads the relay's lease of its tasks collection (``store.relays``); if nobody holds
it, it tries to take it, and the winner holds the relay (``relay.Relay``) and subscribes to it
in memory. The others subscribe through MongoDB (``mailbox``): each makes an inbox, says hello
to the relay, and tails its inbox. While the relay hands it its tasks (*dispatched*), a
worker finds no work itself: it queues what it is handed (``Placement.hand``) and tells the
relay what became of a key and its credit when the relay's stream does not show them (it is
the ``ClaimReports``: ``reporter``). The claim, the run and the outcome are as with an own
stream.

A worker finds its own work (its ``Finder``, with an own stream and its sweep) while it has no
relay to follow: before its relay's first frame (``FIRST_FRAME``), when the relay's lease goes
stale (dead, frozen, cut off: read every ``LOOK_EVERY`` seconds without a recent frame, sooner
once the relay is late, renewed within ``STALE_AFTER``) until another relay holds the lease or
it takes the lease itself, and for good where it cannot make an inbox (no right to make a
capped collection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from pymongo.errors import PyMongoError

from mtask import driver
from mtask.clock import Clock
from mtask.errors import StorageError
from mtask.store import relays
from mtask.worker.claiming.queue import ClaimQueue
from mtask.worker.finding.finder import Finder
from mtask.worker.finding.protocols import ClaimsBack
from mtask.worker.finding.scan import Sweep, TopUp
from mtask.worker.finding.shared.holder import RelayHolder
from mtask.worker.finding.shared.relay import SUBSCRIBER_BUFFER, Relay
from mtask.worker.finding.shared.reporter import Reporter
from mtask.worker.finding.shared.subscription import (
    LOOK_EVERY,
    InboxSubscription,
    NoInbox,
    RelaySilent,
    relay_alive,
)
from mtask.worker.finding.shared.wire import apply_report
from mtask.worker.finding.stream import OwnStream

log = logging.getLogger(__name__)

FIRST_FRAME = 1.0
"""Seconds a subscriber waits for its relay's first frame before it finds work itself."""


class SharedStream:
    """A worker's source of work when it shares the cluster's stream."""

    name = "stream"

    def __init__(
        self,
        driver: driver.AsyncDriver,
        clock: Clock,
        worker_id: str,
        finder: Finder,
        capacity: Callable[[], int],
        *,
        claims: ClaimsBack | None = None,
        new_queue: Callable[[], ClaimQueue] = ClaimQueue,
        buffer: int = SUBSCRIBER_BUFFER,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.worker_id = worker_id
        self.finder = finder
        self.capacity = capacity
        """How many more tasks this worker can take now."""
        self.claims = claims
        """This worker's claims (a relay of this process, or this worker's own stream while
        it finds its work alone, waits for the one a change led to before its next read)."""
        self.buffer = buffer
        tasks = driver.collections["tasks"]
        self.database, self.tasks = tasks.database, tasks.name
        self.holder = RelayHolder(
            driver,
            clock,
            worker_id,
            buffer=buffer,
            new_queue=new_queue,
            sweep_interval=finder.scanner.sweep_interval,
        )
        self.dispatched = False
        """The relay hands this worker its tasks: it finds none itself, and says what it
        claims, holds and finishes."""
        self.connections = 0
        self.fallback = False
        self.left_silent = 0
        self.reports = Reporter(capacity, self._scope_names)
        """This worker's ``ClaimReports``: said only while the relay hands it its tasks."""
        self._send: Callable[[dict[str, Any]], None] | None = None
        """How to reach the relay followed now."""
        self._heard = False
        self._alone: asyncio.Task[None] | None = None
        self._own = False
        self._runner: asyncio.Task[Any] | None = None
        self._broken: BaseException | None = None
        """What broke finding work alone: ``run`` raises it (the worker stops, supervised)."""

    def state(self) -> dict[str, Any]:
        """For the heartbeat: what this side of the shared stream does, and the relay's
        counters if this worker holds it."""
        mode = "own" if self.fallback else "dispatched" if self.dispatched else "alone"
        state: dict[str, Any] = {
            "mode": mode,
            "connections": self.connections,
            "left_silent": self.left_silent,
        }
        if (relay := self.holder.state()) is not None:
            state["relay"] = relay
        return state

    @property
    def relay(self) -> Relay | None:
        """The relay this worker's process holds or held last."""
        return self.holder.relay

    def leads(self) -> bool:
        """Whether this worker runs the cluster's own duties (the flow sweep): it holds the
        relay now, or it follows its own stream for good (it may not make an inbox, so it
        never subscribes, nor takes the lease again), as a worker of ``--stream own`` does."""
        return self.fallback or self.holder.holds()

    def ranks(self) -> bool:
        """Whether this worker finds its own work now (the relay hands it none), so that its
        claims are staggered by its peers: only then does its heartbeat read them."""
        return not self.dispatched

    # -- finding work alone ----------------------------------------------------------------------

    def slot_freed(self) -> None:
        """A slot may have freed: say the credit if the relay cannot count it (while
        dispatched; a success's event gives the relay the slot back)."""
        self.reports.check()

    def _dispatch(self) -> None:
        """From now on the relay hands this worker its tasks: what it found alone goes."""
        if not self.dispatched and self._send is not None:
            self._stop_alone()
            self.dispatched = True
            self.finder.placement.clear()
            self.finder.ready.set()
            self.reports.resume()

    def _find_alone(self, own_stream: bool) -> None:
        """Find work with the sweep, and an own stream unless the relay passes the events."""
        self.dispatched = False
        self.reports.pause()
        if self._alone is not None and not self._alone.done() and self._own == own_stream:
            return  # already so
        self.finder.others.control()  # the heartbeat reads the peers (the stagger), pauses now
        self._stop_alone()
        self._own = own_stream
        self._alone = asyncio.create_task(self._run_alone(own_stream), name="mtask-alone")
        self._alone.add_done_callback(self._alone_done)

    def _alone_done(self, task: asyncio.Task[None]) -> None:
        """Finding work alone ends only when stopped: anything else stops ``run`` with it."""
        if task.cancelled() or task.exception() is None or self._runner is None:
            return
        self._broken = task.exception()
        self._runner.cancel()

    async def _run_alone(self, own_stream: bool) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(Sweep.of(self.finder.scanner).run())
            group.create_task(TopUp(self.finder.scanner).run())
            if own_stream:
                own = OwnStream(self.database, self.tasks, self.worker_id, self.finder, self.claims)
                group.create_task(own.run())

    def _stop_alone(self) -> None:
        if self._alone is not None:
            self._alone.cancel()
            self._alone = None

    # -- following the relay ---------------------------------------------------------------------

    async def run(self) -> None:
        self._runner = asyncio.current_task()
        try:
            while True:
                try:
                    await self._follow_relay()
                except RelaySilent as silent:
                    await self._left(silent.relay_id, str(silent))
                except (StorageError, PyMongoError) as exc:
                    log.warning("shared change stream: %s; trying again", exc)
                    await asyncio.sleep(random.uniform(0.5, 1.0))
                await asyncio.sleep(random.uniform(0.01, 0.1))
        except asyncio.CancelledError:
            if self._broken is not None:
                raise RuntimeError("finding work alone failed") from self._broken
            raise
        finally:
            self._stop_alone()
            await self.holder.stop()

    async def _follow_relay(self) -> None:
        """Subscribe to the relay that holds the lease (taking it first if nobody holds it)
        until it goes."""
        relay_id = await self._relay_id()
        if relay_id is None:
            await asyncio.sleep(random.uniform(0.1, 0.3))  # the lease is changing hands
            return
        relay = Relay.local.get(relay_id)
        if relay is not None and relay.loop is asyncio.get_running_loop():
            local = relay.attach(self.worker_id, self._scope_names(), self.capacity(), self.claims)
            self.connections += 1
            looks = asyncio.create_task(self._looks(), name="mtask-relay-looks")
            try:
                report = lambda m: apply_report(relay.dispatcher, local, m)  # noqa: E731
                await self._consume(local.next, report)
            finally:
                looks.cancel()
                relay.remove(local)
            return
        await self._subscribe(relay_id)

    def _scope_names(self) -> list[str]:
        return list(self.finder.placement.scope.names)

    async def _relay_id(self) -> str | None:
        """The relay holding the lease now, after taking the lease if it has run out."""
        if (relay := await self.holder.take_if_free()) is not None:
            return relay.id
        return await self.driver.run(relays.holder(self.tasks))

    async def _subscribe(self, relay_id: str) -> None:
        """Say hello to the relay ``relay_id`` and take its frames from an inbox of our own."""
        sub = InboxSubscription(self.driver, relay_id, self.worker_id, self._look)
        try:
            await sub.open(
                self.clock,
                {
                    "worker_id": self.worker_id,
                    "names": self._scope_names(),
                    "free": self.capacity(),
                },
            )
            self.connections += 1
            self._heard = False
            first = asyncio.get_running_loop().call_later(FIRST_FRAME, self._no_first_frame)
            try:
                await self._consume(sub.next_frame, sub.send, sub.watch)
            finally:
                first.cancel()
        except NoInbox as exc:
            await self._fall_back(str(exc))
        except PyMongoError as exc:
            log.info("shared change stream subscription lost (%s); subscribing again", exc)
        finally:
            await sub.close()

    def _look(self) -> None:
        self.reports.look()  # credit is never stuck, handed keys never unacknowledged

    async def _looks(self) -> None:
        """The relay's own worker looks as a subscriber in another process does at each look
        at the lease (it has no lease to watch)."""
        while True:
            await asyncio.sleep(LOOK_EVERY)
            self._look()

    def _no_first_frame(self) -> None:
        """A relay that does not answer a hello within ``FIRST_FRAME`` seconds may be dead (its
        lease runs on for a while): find work alone until it answers."""
        if not self._heard and not self.dispatched and self._alone is None:
            self._find_alone(own_stream=True)

    async def _left(self, relay_id: str, why: str) -> None:
        """The relay ``relay_id`` went: find work alone until another relay holds the lease
        (this worker takes it once it has run out), or that one renews it again."""
        self.left_silent += 1
        log.warning("left the relay (%s); finding work with an own stream meanwhile", why)
        self._find_alone(own_stream=True)
        while True:
            await asyncio.sleep(LOOK_EVERY)
            try:
                await self.holder.take_if_free()
                holder = await self.driver.run(relays.holder(self.tasks))
                if holder is not None and holder != relay_id:
                    return  # another relay (perhaps this worker's): subscribe to it
                if holder == relay_id and await relay_alive(self.driver, self.tasks, relay_id):
                    return  # it came back (it was frozen, or cut off, for a while)
            except StorageError:
                continue

    async def _consume(
        self,
        next_frame: Callable[[], Awaitable[Mapping[str, Any] | None]],
        send: Callable[[dict[str, Any]], None],
        watch: asyncio.Task[None] | None = None,
    ) -> None:
        self._send = send
        self.reports.connect(send, self._scope_names())
        try:
            async for frame in _frames(next_frame, watch):
                self._heard = True
                await self._on_frame(frame)
        finally:
            self._send = None
            self.dispatched = False  # said of this relay's keys: the next one scans anew
            self.reports.disconnect()

    async def _on_frame(self, frame: Mapping[str, Any]) -> None:
        """One frame from the relay (``wire``)."""
        relay = frame.get("relay")
        if relay == "open" and self.dispatched:
            self.reports.sync()  # its stream (re)opened, perhaps past events: counts agree
        if "d" in frame or relay == "open":
            self._dispatch()
        if "d" in frame:
            now = self.clock.now()
            self.reports.received(len(frame["d"]))
            for key, name, priority, timeout, group in frame["d"]:
                if not self.finder.placement.hand(key, name, priority, timeout, now, group):
                    self.reports.missed(key)  # it runs it already, for another worker
        elif relay == "own":  # alone with the relay: its events follow, find work yourself
            self._find_alone(own_stream=False)
            await self.finder.opened()
        elif relay is None:  # a task's event (alone), or a control, limit or schedule's
            self.finder.on_change(frame)
            if not self.dispatched:
                await asyncio.sleep(0)  # let a woken claimer send its claim first
                await self.finder.settle()

    async def _fall_back(self, why: str) -> None:
        log.warning("cannot share the change stream (%s); using an own one", why)
        self.fallback = True
        self._find_alone(own_stream=True)
        await asyncio.Event().wait()  # alone for good (until cancelled)


async def _frames(
    next_frame: Callable[[], Awaitable[Mapping[str, Any] | None]],
    watch: asyncio.Task[None] | None,
) -> AsyncIterator[Mapping[str, Any]]:
    """The frames until the relay lets go (``None``); a lease watch that ends raises here."""
    while True:
        if watch is None:
            frame = await next_frame()
        else:
            reading = asyncio.ensure_future(next_frame())
            try:
                await asyncio.wait({reading, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not reading.done():  # the watch ended, or this was cancelled
                    reading.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await reading
            if watch.done():
                watch.result()  # RelaySilent (or what broke the watch)
            frame = reading.result()
        if frame is None:
            return
        yield frame


__all__ = ["SharedStream"]
