"""A worker's side of the shared stream (``--stream shared``): relay holder or subscriber.

Each worker reads the relay's lease of its tasks collection (``store.relays``); if nobody holds
it, it tries to take it, and the winner holds the relay (``relay.Relay``) and subscribes to it
in memory. The others subscribe through MongoDB (``mailbox``): each makes an inbox, says hello
to the relay, and tails its inbox. While the relay hands it its tasks (*dispatched*), a
worker finds no work itself: it queues what it is handed (``Placement.hand``) and tells the
relay its credit and what became of each key (it is the ``ClaimReports``). The claim, the run
and the outcome are as with an own stream.

A worker finds its own work (its ``Finder``, with an own stream and its sweep) while it has no
relay to follow: before its relay's first frame (``FIRST_FRAME``), when the relay's lease goes
stale (dead, frozen, cut off: checked every ``LOOK_EVERY`` seconds without a frame, renewed
within ``STALE_AFTER``) until another relay holds the lease or it takes the lease itself, and
for good where it cannot make an inbox (no right to make a capped collection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from pymongo.errors import OperationFailure, PyMongoError

from mtask import driver
from mtask.clock import Clock
from mtask.errors import StorageError
from mtask.store import relays
from mtask.worker.finding.finder import Finder
from mtask.worker.finding.scan import Sweep
from mtask.worker.finding.shared import mailbox
from mtask.worker.finding.shared.dispatch import Dispatcher
from mtask.worker.finding.shared.relay import LEASE_TTL, SUBSCRIBER_BUFFER, Relay
from mtask.worker.finding.shared.wire import BYE, PROTOCOL, apply_report
from mtask.worker.finding.stream import OwnStream

log = logging.getLogger(__name__)

FIRST_FRAME = 1.0
"""Seconds a subscriber waits for its relay's first frame before it finds work itself."""
LOOK_EVERY = 3.0
"""Seconds without a frame between two reads of the relay's lease."""
STALE_AFTER = 5.0
"""A relay that has not renewed its lease for this long (it renews every 2 s) is left."""
UNAUTHORIZED = 13


class RelaySilent(Exception):
    """The relay's lease went stale, or names another relay."""

    def __init__(self, relay_id: str, why: str) -> None:
        super().__init__(why)
        self.relay_id = relay_id


class SharedStream:
    """A worker's source of work when it shares the cluster's stream; its ``ClaimReports``."""

    name = "stream"

    def __init__(
        self,
        driver: driver.AsyncDriver,
        clock: Clock,
        worker_id: str,
        finder: Finder,
        capacity: Callable[[], int],
        *,
        queue_size: int = 10_000,
        buffer: int = SUBSCRIBER_BUFFER,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.worker_id = worker_id
        self.finder = finder
        self.capacity = capacity
        """How many more tasks this worker can take now."""
        self.queue_size = queue_size
        self.buffer = buffer
        tasks = driver.collections["tasks"]
        self.database, self.tasks = tasks.database, tasks.name
        self.relay: Relay | None = None
        self._relay_task: asyncio.Task[None] | None = None
        self.dispatched = False
        """The relay hands this worker its tasks: it finds none itself, and says what it
        claims, holds and finishes."""
        self.connections = 0
        self.fallback = False
        self.left_silent = 0
        self._send: Callable[[dict[str, Any]], None] | None = None
        self._got = 0
        self._names: list[str] | None = None
        self._said: dict[str, list[Any]] = {}
        """What to tell the relay in the next report, by field (``wire``)."""
        self._flush: asyncio.Handle | None = None
        self._free: int | None = None
        self._heard = False
        self._alone: asyncio.Task[None] | None = None
        self._own = False

    # -- ClaimReports: what the worker tells the relay -----------------------------------------

    def claimed(self, key: str, claim_at: Any) -> None:
        self._say("claimed", [key, claim_at])

    def held(self, key: str) -> None:
        self._say("held", key)

    def succeeded(self, key: str) -> None:
        self._say("done", key)

    def missed(self, key: str) -> None:
        self._say("missed", key)

    def gone(self, key: str) -> None:
        self._say("gone", key)

    def _say(self, field: str, item: Any) -> None:
        if self.dispatched:
            self._said.setdefault(field, []).append(item)
            self.report_soon()

    def report_soon(self) -> None:
        """Report once this turn of the event loop is over (one frame for all of it); only
        while the relay hands this worker its tasks."""
        if self.dispatched and self._send is not None and self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._report)

    def _report(self) -> None:
        self._flush = None
        if self._send is None:
            return
        self._free = max(0, self.capacity())
        message: dict[str, Any] = {"free": self._free, "got": self._got}
        names = list(self.finder.placement.scope.names)
        if names != self._names:
            message["names"] = self._names = names
        message.update(self._said)
        self._said = {}
        self._send(message)

    def state(self) -> dict[str, Any]:
        """For the heartbeat: what this side of the shared stream does, and the relay's
        counters if this worker holds it."""
        mode = "own" if self.fallback else "dispatched" if self.dispatched else "alone"
        state: dict[str, Any] = {
            "mode": mode,
            "connections": self.connections,
            "left_silent": self.left_silent,
        }
        if self.relay is not None and self.leads():
            state["relay"] = {
                **self.relay.dispatcher.stats(),
                "direct": self.relay.direct is not None,
                "dropped": self.relay.dropped,
                "restarts": self.relay.restarts,
            }
        return state

    def leads(self) -> bool:
        """Whether this worker holds the relay now (it runs the cluster's own duties)."""
        return self._relay_task is not None and not self._relay_task.done()

    # -- finding work alone ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """From now on the relay hands this worker its tasks: what it found alone goes."""
        if not self.dispatched:
            self._stop_alone()
            self.dispatched = True
            self.finder.placement.clear()
            self.finder.ready.set()
            self.report_soon()

    def _find_alone(self, own_stream: bool) -> None:
        """Find work with the sweep, and an own stream unless the relay passes the events."""
        self.dispatched = False
        if self._alone is not None and not self._alone.done() and self._own == own_stream:
            return  # already so
        self._stop_alone()
        self._own = own_stream
        self._alone = asyncio.create_task(self._run_alone(own_stream), name="mtask-alone")

    async def _run_alone(self, own_stream: bool) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(Sweep.of(self.finder.scanner).run())
            if own_stream:
                own = OwnStream(self.database, self.tasks, self.worker_id, self.finder)
                group.create_task(own.run())

    def _stop_alone(self) -> None:
        if self._alone is not None:
            self._alone.cancel()
            self._alone = None

    # -- following the relay ---------------------------------------------------------------------

    async def run(self) -> None:
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
        finally:
            self._stop_alone()
            if self._relay_task is not None:
                self._relay_task.cancel()
                await asyncio.gather(self._relay_task, return_exceptions=True)

    async def _follow_relay(self) -> None:
        """Subscribe to the relay that holds the lease (taking it first if nobody holds it)
        until it goes."""
        relay_id = await self._relay_id()
        if relay_id is None:
            await asyncio.sleep(random.uniform(0.1, 0.3))  # the lease is changing hands
            return
        relay = Relay.local.get(relay_id)
        if relay is not None and relay.loop is asyncio.get_running_loop():
            local = relay.attach(self.worker_id, self._scope_names(), self.capacity())
            self.connections += 1
            try:
                report = lambda m: apply_report(relay.dispatcher, local, m)  # noqa: E731
                await self._consume(local.next, report)
            finally:
                relay.remove(local)
            return
        await self._subscribe(relay_id)

    def _scope_names(self) -> list[str]:
        return list(self.finder.placement.scope.names)

    async def _relay_id(self) -> str | None:
        """The relay holding the lease now, after taking the lease if it has run out."""
        await self._ensure_relay()
        if self.relay is not None and self.leads():
            return self.relay.id
        return await self.driver.run(relays.holder(self.tasks))

    async def _subscribe(self, relay_id: str) -> None:
        """Say hello to the relay ``relay_id`` and take its frames from an inbox of our own."""
        subscription = f"{self.worker_id}/{uuid.uuid4().hex[:12]}"
        name = mailbox.inbox_name(self.tasks, subscription)
        try:
            inbox = await mailbox.ensure_capped(
                self.database, name, mailbox.INBOX_BYTES, at=self.clock.now()
            )
        except OperationFailure as exc:
            if exc.code == UNAUTHORIZED:
                await self._fall_back(f"cannot make an inbox: {exc}")
            raise
        failed: list[Exception] = []
        out = mailbox.Writer(self.database[mailbox.reports_name(self.tasks)], failed.append)

        def send(message: dict[str, Any]) -> None:
            out.put({"to": relay_id, "from": subscription, "f": message})

        hello = {"hello": PROTOCOL, "worker_id": self.worker_id, "inbox": name}
        send({**hello, "names": self._scope_names(), "free": self.capacity()})
        self.connections += 1
        frames = mailbox.tail(inbox)
        self._heard = False
        first = asyncio.get_running_loop().call_later(FIRST_FRAME, self._no_first_frame)

        async def next_frame() -> Mapping[str, Any] | None:
            if failed:
                raise failed[0]
            try:
                doc = await anext(frames)
            except StopAsyncIteration:
                return None  # the relay let us go (and dropped the inbox)
            frame = doc.get("f")
            return frame if isinstance(frame, Mapping) else {}

        watch = asyncio.create_task(self._watch_lease(relay_id), name="mtask-relay-lease-watch")
        try:
            await self._consume(next_frame, send, watch)
        except PyMongoError as exc:
            log.info("shared change stream subscription lost (%s); subscribing again", exc)
        finally:
            first.cancel()
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await frames.aclose()
            send(dict(BYE))
            await out.drain()
            out.close()

    def _no_first_frame(self) -> None:
        """A relay that does not answer a hello within ``FIRST_FRAME`` seconds may be dead (its
        lease runs on for a while): find work alone until it answers."""
        if not self._heard and not self.dispatched and self._alone is None:
            self._find_alone(own_stream=True)

    async def _watch_lease(self, relay_id: str) -> None:
        """Every ``LOOK_EVERY`` seconds without a frame, read the lease: a relay that stopped
        renewing it, or lost it, is left (``RelaySilent``). Also says a changed credit."""
        while True:
            self._heard = False
            await asyncio.sleep(LOOK_EVERY)
            if self.dispatched and max(0, self.capacity()) != self._free:
                self.report_soon()  # credit is never stuck
            if self._heard:
                continue
            try:
                alive = await self.driver.run(
                    relays.alive(
                        self.tasks, relay_id, int(STALE_AFTER * 1000), int(LEASE_TTL * 1000)
                    )
                )
            except StorageError as exc:
                raise RelaySilent(relay_id, f"cannot read the lease: {exc}") from exc
            if not alive:
                raise RelaySilent(relay_id, "its lease went stale or changed hands")

    async def _left(self, relay_id: str, why: str) -> None:
        """The relay ``relay_id`` went: find work alone until another relay holds the lease
        (this worker takes it once it has run out), or that one renews it again."""
        self.left_silent += 1
        log.warning("left the relay (%s); finding work with an own stream meanwhile", why)
        self._find_alone(own_stream=True)
        stale, ttl = int(STALE_AFTER * 1000), int(LEASE_TTL * 1000)
        while True:
            await asyncio.sleep(LOOK_EVERY)
            try:
                await self._ensure_relay()
                holder = await self.driver.run(relays.holder(self.tasks))
                if holder is not None and holder != relay_id:
                    return  # another relay (perhaps this worker's): subscribe to it
                if holder == relay_id and await self.driver.run(
                    relays.alive(self.tasks, relay_id, stale, ttl)
                ):
                    return  # it came back (it was frozen, or cut off, for a while)
            except StorageError:
                continue

    async def _consume(
        self,
        next_frame: Callable[[], Awaitable[Mapping[str, Any] | None]],
        send: Callable[[dict[str, Any]], None],
        watch: asyncio.Task[None] | None = None,
    ) -> None:
        self._send, self._got, self._names = send, 0, self._scope_names()
        self._said = {}  # said of an earlier relay's keys: this one scans for itself
        try:
            async for frame in _frames(next_frame, watch):
                self._heard = True
                await self._on_frame(frame)
        finally:
            self._send = None
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None

    async def _on_frame(self, frame: Mapping[str, Any]) -> None:
        """One frame from the relay (``wire``)."""
        relay = frame.get("relay")
        if "d" in frame or relay == "open":
            self._dispatch()
        if "d" in frame:
            now = self.clock.now()
            for key, name, priority, timeout in frame["d"]:
                if not self.finder.placement.hand(key, name, priority, timeout, now):
                    self.missed(key)  # it runs it already, for another worker
            self._got += len(frame["d"])
            self.report_soon()
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

    async def _ensure_relay(self) -> None:
        """Hold the relay if the lease has run out (or this process holds it already)."""
        task = self._relay_task
        if task is not None and task.done() and not task.cancelled():
            task.result()  # a relay that died of anything but its lease or a cancel: raise it
        if task is not None and not task.done():
            return
        dispatcher = Dispatcher.build(
            self.driver,
            self.clock,
            queue_size=self.queue_size,
            sweep_interval=self.finder.scanner.sweep_interval,
        )
        relay = await Relay.acquire(
            self.driver, self.database, self.tasks, self.worker_id, self.buffer, dispatcher
        )
        if relay is not None:
            log.info("this worker holds the relay of the shared change stream")
            self.relay = relay
            self._relay_task = asyncio.create_task(relay.run(self.driver), name="mtask-relay")


async def _frames(
    next_frame: Callable[[], Awaitable[Mapping[str, Any] | None]],
    watch: asyncio.Task[None] | None,
) -> AsyncIterator[Mapping[str, Any]]:
    """The frames until the relay lets go (``None``); a lease watch that ends raises here."""
    while True:
        if watch is None:
            frame = await next_frame()
            if frame is None:
                return
            yield frame
            continue
        reading = asyncio.ensure_future(next_frame())
        await asyncio.wait({reading, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done() and not reading.done():
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await reading
            watch.result()  # RelaySilent (or what broke the watch)
        frame = await reading
        if frame is None:
            return
        yield frame


__all__ = ["SharedStream"]
