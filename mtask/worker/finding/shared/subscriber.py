"""A worker's side of the shared stream (``--stream shared``): relay holder or subscriber.

Each worker reads the relay's lease of its tasks collection (``store.relays``); if nobody holds
it, it tries to take it, and the winner holds the relay (``relay.Relay``) and subscribes to it
in memory. The others subscribe through MongoDB (``mailbox``): each makes an inbox, says hello
to the relay, and tails its inbox. While the relay hands it its tasks, a worker finds no work
itself: it queues what it is handed (``Placement.hand``) and tells the relay what became of a
key and its credit when the relay's stream does not show them (it is the ``ClaimReports``:
``reporter``). The claim, the run and the outcome are as with an own stream. One subscriber in
another process stands by for the relay when asked (``standby``): it takes the lease over as
soon as the relay goes silent.

What the worker finds its work by is one named state (``SubscriberState``)::

                            OPEN, or keys handed
       BETWEEN ───────────────────────────────────────────▶ DISPATCHED
        │  ▲  ▲ ◀─────────── the subscription ends ─────────  │  ▲
        │  │  │                                              OWN │  │ OPEN, keys
        │  │  └───────────── the subscription ends ────────┐   ▼  │
        │  │                                               RELAY_EVENTS
        │  │ (OWN, OPEN: as from BETWEEN)
        │  └──────────────────────────────────┐
        └─ no first frame within FIRST_FRAME, ─▶ OWN_STREAM
           or the relay went silent (a look)

- ``BETWEEN``: between two relays (starting, or its relay went): it claims what it was handed
  and finds nothing new, until the relay's first frame (or ``FIRST_FRAME`` without one).
- ``OWN_STREAM``: it finds its own work, with an own stream and its sweep: no relay answers, or
  the relay's lease went stale (dead, frozen, cut off: read every ``LOOK_EVERY`` seconds without
  a recent frame) and no standby took it over, until another relay holds the lease or it takes
  the lease itself. A subscription that ends leaves it so.
- ``RELAY_EVENTS``: the relay's own worker, its only subscriber: the relay passes it the task
  events (``wire.OWN``) and it finds its own work from them, with its sweep.
- ``DISPATCHED``: the relay hands it its tasks; it says what no event shows (``Reporter``).
- ``FOR_GOOD``: it may not make an inbox (no right to make a capped collection): an own stream
  for good, and the cluster's own duties, as a worker of ``--stream own``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

from pymongo.errors import PyMongoError

from mtask import driver
from mtask.clock import Clock
from mtask.errors import StorageError
from mtask.store import relays
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding.finder import Finder
from mtask.worker.finding.protocols import ClaimsBack
from mtask.worker.finding.shared import wire
from mtask.worker.finding.shared.alone import FindingAlone
from mtask.worker.finding.shared.frames import RelayFrames
from mtask.worker.finding.shared.holder import RelayHolder
from mtask.worker.finding.shared.relay import SUBSCRIBER_BUFFER, Relay
from mtask.worker.finding.shared.reporter import Reporter
from mtask.worker.finding.shared.subscriber_state import SubscriberState
from mtask.worker.finding.shared.subscription import (
    LOOK_EVERY,
    InboxSubscription,
    NoInbox,
    RelaySilent,
    next_relay,
)

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
        self.state = SubscriberState.BETWEEN
        """What this worker finds its work by now (``SubscriberState``)."""
        self.connections = 0
        self.left_silent = 0
        """Relays this worker left because they went silent (or whose successor moved it)."""
        self.reports = Reporter(capacity, self._scope_names)
        """This worker's ``ClaimReports``: said only while the relay hands it its tasks."""
        self.alone = FindingAlone(finder, self.database, self.tasks, worker_id, claims, self._broke)
        """Finding work alone (``OWN_STREAM``, ``RELAY_EVENTS``, ``FOR_GOOD``)."""
        self.frames = RelayFrames(
            finder, self.holder, self.reports, clock, lambda: self.state, self._enter
        )
        """What the relay says, frame by frame."""
        self._runner: asyncio.Task[Any] | None = None
        self._broken: BaseException | None = None
        """What broke finding work alone: ``run`` raises it (the worker stops, supervised)."""

    def heartbeat(self) -> dict[str, Any]:
        """For the heartbeat: what this side of the shared stream does, and the relay's
        counters if this worker holds it."""
        doc: dict[str, Any] = {
            "mode": self.state.mode,
            "connections": self.connections,
            "left_silent": self.left_silent,
            "took_over": self.holder.took_over,
        }
        if (relay := self.holder.state()) is not None:
            doc["relay"] = relay
        return doc

    @property
    def relay(self) -> Relay | None:
        """The relay this worker's process holds or held last."""
        return self.holder.relay

    def leads(self) -> bool:
        """Whether this worker runs the cluster's own duties (the flow sweep): it holds the
        relay now, or it follows its own stream for good (it may not make an inbox, so it
        never subscribes, nor takes the lease again), as a worker of ``--stream own`` does."""
        return self.state is SubscriberState.FOR_GOOD or self.holder.holds()

    @property
    def dispatched(self) -> bool:
        return self.state is SubscriberState.DISPATCHED

    def ranks(self) -> bool:
        """Whether this worker finds its own work now (the relay hands it none), so that its
        claims are staggered by its peers: only then does its heartbeat read them."""
        return not self.dispatched

    def slot_freed(self) -> None:
        """A slot may have freed: say the credit if the relay cannot count it (while
        dispatched; a success's event gives the relay the slot back)."""
        self.reports.check()

    # -- the state and its transitions -----------------------------------------------------------

    def _enter(self, state: SubscriberState) -> None:
        """Enter ``state`` (the transitions of ``SubscriberState``)."""
        was, self.state = self.state, state
        if state is SubscriberState.DISPATCHED:
            if was is not state:  # what it found alone goes; what it said it keeps stays
                self.alone.stop()  # (a relay forgets the keys said held)
                self.finder.placement.clear(keep=self.reports.kept)
                self.finder.ready.set()
                self.reports.resume()
            return
        self.reports.pause()
        if state is SubscriberState.BETWEEN:
            self.alone.stop()
        else:
            self.alone.start(own_stream=state is not SubscriberState.RELAY_EVENTS)

    def _broke(self, exc: BaseException) -> None:
        """Finding work alone ended by itself (a bug): ``run`` stops with it."""
        self._broken = exc
        if self._runner is not None:
            self._runner.cancel()

    # -- following the relay ---------------------------------------------------------------------

    async def run(self) -> None:
        self._runner = asyncio.current_task()
        relay_id: str | None = None
        try:
            while True:
                try:
                    relay_id = await self._follow_relay(relay_id)
                except RelaySilent as silent:
                    relay_id = await self._left(silent.relay_id, str(silent))
                except (StorageError, PyMongoError) as exc:
                    log.warning("shared change stream: %s; trying again", exc)
                    await asyncio.sleep(random.uniform(0.5, 1.0))
                if relay_id is None:
                    await asyncio.sleep(random.uniform(0.01, 0.1))
        except asyncio.CancelledError:
            if self._broken is not None:
                raise RuntimeError("finding work alone failed") from self._broken
            raise
        finally:
            self.alone.stop()
            await self.holder.stop()

    async def _follow_relay(self, relay_id: str | None) -> str | None:
        """Subscribe to ``relay_id``, or to the relay that holds the lease (taking it first if
        nobody holds it), until it goes; returns the relay that took its place, if it said."""
        relay_id = relay_id or await self._relay_id()
        if relay_id is None:
            await asyncio.sleep(random.uniform(0.1, 0.3))  # the lease is changing hands
            return None
        relay = Relay.local.get(relay_id)
        if relay is not None and relay.loop is asyncio.get_running_loop():
            local = relay.attach(self.worker_id, self._scope_names(), self.capacity(), self.claims)
            self.connections += 1
            looks = asyncio.create_task(self._looks(), name="mtask-relay-looks")
            try:
                report = lambda m: wire.apply_report(relay.dispatcher, local, m)  # noqa: E731
                await self.frames.consume(local.next, report, lambda: relay_id)
            finally:
                looks.cancel()
                relay.remove(local)
            return None
        return await self._subscribe(relay_id)

    def _scope_names(self) -> list[str]:
        return list(self.finder.placement.scope.names)

    async def _relay_id(self) -> str | None:
        """The relay holding the lease now, after taking the lease if it has run out."""
        if (relay := await self.holder.take_if_free()) is not None:
            return relay.id
        return await self.driver.run(relays.holder(self.tasks))

    async def _subscribe(self, relay_id: str) -> str | None:
        """Say hello to the relay ``relay_id`` and take its frames from an inbox of our own;
        returns the relay that took its place, if it said (``wire.taken``)."""
        sub = InboxSubscription(
            self.driver,
            relay_id,
            self.worker_id,
            self.reports.look,
            hello=self._hello,
            on_moved=lambda by: self._moved(by, sub.send),
        )
        try:
            await sub.open(self.clock)
            self.connections += 1
            first = asyncio.get_running_loop().call_later(FIRST_FRAME, self._no_first_frame)
            try:
                following = lambda: sub.relay_id  # noqa: E731 (another, once one took over)
                await self.frames.consume(sub.next_frame, sub.send, following, sub.watch, first)
            finally:
                first.cancel()
        except NoInbox as exc:
            await self._fall_back(str(exc))
        except PyMongoError as exc:
            log.info("shared change stream subscription lost (%s); subscribing again", exc)
        finally:
            await sub.close()
        if sub.taken_by is not None:
            self.left_silent += 1  # its relay went: another took the lease, and said so
        return sub.taken_by

    def _hello(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "names": self._scope_names(), "free": self.capacity()}

    def _moved(self, relay_id: str, send: Callable[[dict[str, Any]], None]) -> bool:
        """The relay ``relay_id`` took the lease from the one followed (``wire.taken``): follow
        it from the same inbox (its ``OPEN`` dispatches this worker anew), unless this process
        holds it (then the subscription ends, and the worker follows it in memory)."""
        relay = Relay.local.get(relay_id)
        if relay is not None and relay.loop is asyncio.get_running_loop():
            return False
        self.left_silent += 1  # its relay went: another took the lease, and said so
        if self.state in (SubscriberState.DISPATCHED, SubscriberState.RELAY_EVENTS):
            self._enter(SubscriberState.BETWEEN)
        self.reports.connect(send, self._scope_names())  # counts afresh, as the relay's
        return True

    async def _looks(self) -> None:
        """The relay's own worker looks as a subscriber in another process does at each look
        at the lease (it has no lease to watch)."""
        while True:
            await asyncio.sleep(LOOK_EVERY)
            self.reports.look()  # credit is never stuck, handed keys never unacknowledged

    def _no_first_frame(self) -> None:
        """A relay that does not answer a hello within ``FIRST_FRAME`` seconds may be dead (its
        lease runs on for a while): find work alone until it answers."""
        if self.state is SubscriberState.BETWEEN:
            self._enter(SubscriberState.OWN_STREAM)

    async def _left(self, relay_id: str, why: str) -> str:
        """The relay ``relay_id`` went silent: follow the relay that holds the lease now, if
        another does; else find work alone until another relay holds it (this worker takes it
        once it has run out, or took it over as the standby), or that one renews it again."""
        self.left_silent += 1
        self.holder.taken_over.clear()
        with contextlib.suppress(StorageError):
            holder = await self.driver.run(relays.holder(self.tasks))
            if holder is not None and holder != relay_id:
                return holder  # taken over already
        log.warning("left the relay (%s); finding work with an own stream meanwhile", why)
        self._enter(SubscriberState.OWN_STREAM)
        return await next_relay(self.driver, self.holder, relay_id)

    async def _on_frame(self, frame: Mapping[str, Any], relay_id: str) -> None:
        await self.frames.on_frame(frame, relay_id)

    async def _fall_back(self, why: str) -> None:
        log.warning("cannot share the change stream (%s); using an own one", why)
        self._enter(SubscriberState.FOR_GOOD)
        await asyncio.Event().wait()  # alone for good (until cancelled)


__all__ = ["SharedStream", "SubscriberState"]
