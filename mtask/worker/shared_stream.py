"""A worker's side of the shared stream (``--stream shared``): relay or subscriber.

Each worker process reads the relay's lease of its tasks collection (``store.relays``); if
nobody holds it, it tries to take it, and the winner holds the relay (``stream_relay.Relay``)
and subscribes to it in memory. The others subscribe through MongoDB (``mailbox``): each makes
an inbox, says hello to the relay, and tails its inbox. A subscriber then finds no work itself:
the relay hands it tasks due now (``Watcher.place_dispatched``), and it tells the relay how many
more it can take (``free``, ``got``: its credit), and what it claimed, holds back or finished
(the relay's stream leaves those writes out), could not claim, or found gone. Everything else
about a task — the claim, the run, the outcome — is as with an own stream.

- A relay that says nothing for ``SILENT`` seconds (dead, frozen, cut off, or gone for another)
  is left: if the lease names another relay, the subscriber subscribes to that one; otherwise
  it follows its own stream until the lease names a relay again, or has run out and it takes
  the lease itself.
- Where the relay cannot be reached through MongoDB at all (no right to make a capped
  collection), the worker follows its own stream for good, with a warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pymongo.errors import OperationFailure, PyMongoError

from mtask.errors import StorageError
from mtask.store import relays
from mtask.worker import mailbox
from mtask.worker.dispatch import Dispatcher
from mtask.worker.relay_wire import BYE, KEEPALIVE, PROTOCOL
from mtask.worker.stream import OwnStream
from mtask.worker.stream_relay import SUBSCRIBER_BUFFER, Relay
from mtask.worker.watcher import Watcher

log = logging.getLogger(__name__)

SILENT = 6.0
"""Seconds without a frame from the relay (it ticks every ``dispatch.TICK``) before a
subscriber leaves it."""
FIRST_FRAME = 1.0
"""Seconds a subscriber waits for its relay's first frame before it finds work itself."""
LOOK_EVERY = 2.0
"""Seconds between two reads of the lease while a worker finds its own work."""
UNAUTHORIZED = 13


class RelaySilent(Exception):
    """The relay said nothing for ``SILENT`` seconds."""


class SharedStream:
    """A watcher's change source when it shares the cluster's stream: relay or subscriber."""

    def __init__(self, buffer: int | None = None) -> None:
        self.buffer = buffer
        self.capacity: Callable[[], int] = lambda: 0
        """How many more tasks this worker can take now (set by the worker's assembly)."""
        self.relay: Relay | None = None
        self._relay_task: asyncio.Task[None] | None = None
        self._subscribed_to: str | None = None
        """The relay this worker subscribed to last."""
        self._reported = 0.0
        """When (event loop time) this worker last reported to its relay."""
        self.connections = 0
        self.fallback = False
        self.left_silent = 0
        self._watcher: Watcher | None = None
        self._send: Callable[[dict[str, Any]], None] | None = None
        self._got = 0
        self._names: list[str] | None = None
        self._said: dict[str, list[Any]] = {}
        """What to tell the relay in the next report, by field (``relay_wire``)."""
        self._flush: asyncio.Handle | None = None
        self._free: int | None = None
        """The ``free`` last told: a tick from the relay makes it say a changed one."""

    # -- what the worker tells the relay --------------------------------------------------------

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
        self._said.setdefault(field, []).append(item)
        self.report_soon()

    def report_soon(self) -> None:
        """Say it once this turn of the event loop is over (one frame for all of it); only
        while the relay hands this worker its tasks."""
        dispatched = self._watcher is not None and self._watcher.dispatched
        if dispatched and self._send is not None and self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._report)

    def _report(self) -> None:
        self._flush = None
        if self._send is None or self._watcher is None:
            return
        self._free = max(0, self.capacity())
        message: dict[str, Any] = {"free": self._free, "got": self._got}
        names = list(self._watcher.names)
        if names != self._names:
            message["names"] = self._names = names
        message.update(self._said)
        self._said = {}
        self._reported = asyncio.get_running_loop().time()
        self._send(message)

    def state(self) -> dict[str, Any]:
        """For the heartbeat: what this worker's side of the shared stream is doing, and the
        relay's counters if it holds the relay."""
        dispatched = self._watcher is not None and self._watcher.dispatched
        state: dict[str, Any] = {
            "mode": "own" if self.fallback else "dispatched" if dispatched else "alone",
            "connections": self.connections,
            "left_silent": self.left_silent,
        }
        relay = self.relay
        if relay is not None and self._relay_task is not None and not self._relay_task.done():
            state["relay"] = {
                **relay.dispatcher.stats(),
                "direct": relay.direct is not None,
                "dropped": relay.dropped,
            }
        return state

    def leads(self) -> bool:
        """Whether this worker holds the relay now (it runs the cluster's own duties)."""
        return self._relay_task is not None and not self._relay_task.done()

    # -- following the relay --------------------------------------------------------------------

    async def run(self, watcher: Watcher) -> None:
        self._watcher = watcher
        try:
            while True:
                try:
                    await self._follow_relay(watcher)
                except RelaySilent as silent:
                    await self._left(watcher, str(silent))
                except (StorageError, PyMongoError) as exc:
                    log.warning("shared change stream: %s; trying again", exc)
                    await asyncio.sleep(random.uniform(0.5, 1.0))
                await asyncio.sleep(random.uniform(0.01, 0.1))
        finally:
            if self._relay_task is not None:
                self._relay_task.cancel()
                await asyncio.gather(self._relay_task, return_exceptions=True)

    async def _follow_relay(self, watcher: Watcher) -> None:
        """Subscribe to the relay that holds the lease (taking it first if nobody holds it)
        until it goes."""
        relay_id = await self._relay_id(watcher)
        if relay_id is None:
            await asyncio.sleep(random.uniform(0.1, 0.3))  # the lease is changing hands
            return
        self._subscribed_to = relay_id
        relay = Relay.local.get(relay_id)
        if relay is not None and relay.loop is asyncio.get_running_loop():
            await self._consume_local(relay, watcher)
            return
        await self._subscribe(relay_id, watcher)

    async def _relay_id(self, watcher: Watcher) -> str | None:
        """The relay holding the lease now, after taking the lease if it has run out."""
        await self._ensure_relay(watcher)
        if self.relay is not None and self._relay_task is not None and not self._relay_task.done():
            return self.relay.id
        return await watcher.driver.run(relays.holder(watcher.driver.collections["tasks"].name))

    async def _subscribe(self, relay_id: str, watcher: Watcher) -> None:
        """Say hello to the relay ``relay_id`` and take its frames from an inbox of our own."""
        tasks = watcher.driver.collections["tasks"]
        database = tasks.database
        subscription = f"{watcher.worker_id}/{uuid.uuid4().hex[:12]}"
        name = mailbox.inbox_name(tasks.name, subscription)
        try:
            inbox = await mailbox.ensure_capped(
                database, name, mailbox.INBOX_BYTES, at=watcher.clock.now()
            )
        except OperationFailure as exc:
            if exc.code == UNAUTHORIZED:
                await self._fall_back(watcher, f"cannot make an inbox: {exc}")
            raise
        reports = database[mailbox.reports_name(tasks.name)]
        failed: list[Exception] = []
        out = mailbox.Writer(reports, failed.append)

        def send(message: dict[str, Any]) -> None:
            out.put({"to": relay_id, "from": subscription, "f": message})

        hello = {"hello": PROTOCOL, "worker_id": watcher.worker_id, "inbox": name}
        send({**hello, "names": watcher.names, "free": self.capacity()})
        self.connections += 1
        frames = mailbox.tail(inbox)
        heard = asyncio.Event()
        meanwhile = asyncio.create_task(self._own_until(heard, watcher), name="mtask-own-until")

        async def next_frame() -> Mapping[str, Any] | None:
            if failed:
                raise failed[0]
            try:
                doc = await anext(frames)
            except StopAsyncIteration:
                return None  # the relay let us go (and dropped the inbox)
            heard.set()
            frame = doc.get("f")
            return frame if isinstance(frame, Mapping) else {}

        try:
            await self._consume(next_frame, send, watcher, SILENT)
        except PyMongoError as exc:
            log.info("shared change stream subscription lost (%s); subscribing again", exc)
        finally:
            meanwhile.cancel()
            await asyncio.gather(meanwhile, return_exceptions=True)
            await frames.aclose()
            send(dict(BYE))
            await out.drain()
            out.close()

    async def _own_until(self, heard: asyncio.Event, watcher: Watcher) -> None:
        """A relay that does not answer a hello within ``FIRST_FRAME`` seconds may be dead (its
        lease runs on for a while): until it answers, find work with an own stream, so that a
        worker started after its relay died claims on time."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(FIRST_FRAME):
                await heard.wait()
                return
        if watcher.dispatched:
            return
        own = asyncio.create_task(OwnStream().run(watcher), name="mtask-own-stream")
        try:
            await heard.wait()
        finally:
            own.cancel()
            await asyncio.gather(own, return_exceptions=True)

    async def _left(self, watcher: Watcher, why: str) -> None:
        """The relay went silent: follow the lease's next relay, or an own stream until there
        is one (or the lease has run out: the loop then takes it)."""
        self.left_silent += 1
        silent = self._subscribed_to
        tasks = watcher.driver.collections["tasks"].name
        try:
            holder = await watcher.driver.run(relays.holder(tasks))
        except StorageError:
            holder = silent  # MongoDB away too: find work alone until it says more
        if holder is not None and holder != silent:
            return  # another relay holds the lease now: subscribe to it
        log.warning(
            "the relay said nothing for %gs (%s); finding work with an own stream", SILENT, why
        )
        watcher.to_own()
        own = asyncio.create_task(OwnStream().run(watcher), name="mtask-own-stream")
        try:
            while True:
                await asyncio.sleep(LOOK_EVERY)
                if own.done():
                    own.result()  # an own stream that ends is a bug: raise it
                try:
                    holder = await watcher.driver.run(relays.holder(tasks))
                except StorageError:
                    continue
                if holder != silent:
                    return  # a new relay, or none (the loop takes the lease)
        finally:
            own.cancel()
            await asyncio.gather(own, return_exceptions=True)

    async def _consume_local(self, relay: Relay, watcher: Watcher) -> None:
        """Subscribe to the relay of this event loop directly; until it goes or drops us."""
        local = relay.attach(watcher.worker_id, watcher.names, self.capacity())
        self.connections += 1
        try:
            await self._consume(local.next, lambda m: relay.report(local, m), watcher, None)
        finally:
            relay.remove(local)

    async def _consume(
        self,
        next_frame: Callable[[], Awaitable[Mapping[str, Any] | None]],
        send: Callable[[dict[str, Any]], None],
        watcher: Watcher,
        silent: float | None,
    ) -> None:
        self._send, self._got, self._names = send, 0, list(watcher.names)
        self._said = {}  # said of an earlier relay's keys: this one scans for itself
        try:
            while True:
                try:
                    async with asyncio.timeout(silent):
                        doc = await next_frame()
                except TimeoutError:
                    raise RelaySilent from None
                if doc is None:
                    return
                await self._on_frame(doc, watcher)
        finally:
            self._send = None
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None

    async def _on_frame(self, doc: Mapping[str, Any], watcher: Watcher) -> None:
        """One frame from the relay (``relay_wire``)."""
        relay = doc.get("relay")
        if ("d" in doc or relay == "open") and not watcher.dispatched:
            watcher.to_dispatch()  # what it found itself goes: the relay has it
            self.report_soon()
        if "d" in doc:
            for key, name, priority, timeout in doc["d"]:
                watcher.place_dispatched(key, name, priority, timeout)
            self._got += len(doc["d"])
            self.report_soon()
        elif relay == "own":  # alone with the relay: find work yourself
            watcher.to_own()
            await watcher.opened()
        elif relay == "tick":
            quiet = asyncio.get_running_loop().time() - self._reported >= KEEPALIVE
            if watcher.dispatched and (quiet or max(0, self.capacity()) != self._free):
                self.report_soon()  # the relay hears from us; and credit is never stuck
        elif relay is None:  # a task's event (alone), or a control, limit or schedule's
            watcher.on_change(doc)
            if not watcher.dispatched:
                await asyncio.sleep(0)  # let a woken claimer send its claim first
                await watcher.settle()

    async def _fall_back(self, watcher: Watcher, why: str) -> None:
        log.warning("cannot share the change stream (%s); using an own one", why)
        self.fallback = True
        watcher.to_own()
        await OwnStream().run(watcher)
        raise AssertionError("unreachable: a stream is followed until cancelled")

    async def _ensure_relay(self, watcher: Watcher) -> None:
        """Hold the relay if the lease has run out (or this process holds it already)."""
        task = self._relay_task
        if task is not None and task.done() and not task.cancelled():
            task.result()  # a relay that died of anything but its lease or a cancel: raise it
        if task is not None and not task.done():
            return
        tasks = watcher.driver.collections["tasks"]
        buffer = SUBSCRIBER_BUFFER if self.buffer is None else self.buffer
        dispatcher = Dispatcher.build(
            watcher.driver,
            watcher.worker_id,
            watcher.clock,
            watcher.assignment,
            watcher.sweep_interval,
            watcher.stagger.total_seconds() * 1000,
            watcher.queue.max_size,
        )
        relay = await Relay.acquire(
            watcher.driver, tasks.database, tasks.name, watcher.worker_id, buffer, dispatcher
        )
        if relay is not None:
            log.info("this worker holds the relay of the shared change stream")

            def restarted() -> None:
                watcher.stream_restarts += 1

            self.relay = relay
            self._relay_task = asyncio.create_task(
                relay.run(watcher.driver, restarted), name="mtask-relay"
            )


__all__ = ["SharedStream"]
