"""One change stream and one claim queue for every worker of a tasks collection, on any host
(``--stream shared``): the relay.

With a stream and a queue per worker, mongod scanned every write once per stream and every
worker queued every task, so several raced for each: the server's CPU and the claim attempts
per task grew with the number of workers and hosts (bench W9, W9H). Here one worker process
holds the *relay*, chosen by a lease in MongoDB (``lease``, ``store.relays``: taken and renewed
on the server's clock): the one change stream, the claim queue of every subscriber's names
(``HostQueue``) and its ``Dispatcher``, which hands each due task to one subscriber with
credit, its own worker included. Relay and subscribers talk through MongoDB alone (``mailbox``,
``wire``). What it does with its stream is its mode (``mode.RelayMode``: starting, alone with
its own worker, handing out).

- Events are hints, the claim decides, the sweep bounds a lost wake-up. The relay's queue
  rescans each time its stream (re)opens and every sweep; a subscriber that says hello gets
  ``OPEN`` and from then on its tasks from the relay.
- The relay's stream carries its subscribers' claims and successes (their ``last_write``
  tags): the dispatcher reads them, and the subscribers do not report them. While the relay
  is alone with its own worker, its stream leaves that worker's out, as an own stream does; the
  stream is reopened with the other filter when that changes, resuming after its last event
  (``Position.switch``: no rescan). Until the reopen (one getMore at most) the old filter still
  leaves out the own worker's claims and successes: a key handed to it meanwhile waits out its
  hand-over, and a short count of its successes is synced (``credit``).
- The change events of ``controls``, ``limits`` and ``schedules`` go to every subscriber; those
  of a group's slot document, and the end of a run of a group (``wire.group_freed``), only to
  the subscribers that keep a key of the group back (``waiters``).
- A slow subscriber never blocks the relay (``channels``: bounded, then dropped). A subscriber
  that leaves handed keys unacknowledged is let go (``credit.SILENT_SUBSCRIBER``); its keys
  come back.
- *Standby.* While it has subscribers in other processes, the relay has one of them watch its
  lease (``standby``): it asks one (``wire.STANDBY``) whenever nobody holds the post, and
  renews its lease often enough for the standby to take it over within a second of its death,
  freeze or cut (``lease``).
- A relay that starts (its lease taken, or taken over) writes into every inbox it does not
  serve a frame naming it (``wire.taken``): their subscribers, followers of a relay that is
  gone, say hello to it at once, from the same inbox (no collection made or dropped: a
  takeover costs a frame and a hello a subscriber). A relay that cannot renew its lease for
  ``LEASE_TTL - RENEW_EVERY`` seconds stops, and so does one that finds it another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

from mtask.errors import StorageError
from mtask.follow import events
from mtask.limits.rules import group_slot, is_group_slot
from mtask.worker.finding.changes import event_key, lock_freed
from mtask.worker.finding.protocols import ClaimsBack
from mtask.worker.finding.shared import mailbox, wire
from mtask.worker.finding.shared.channels import InboxChannel, LocalChannel, SubscriberChannel
from mtask.worker.finding.shared.dispatch import Dispatcher
from mtask.worker.finding.shared.far import LAST_FRAME, FarSubscribers
from mtask.worker.finding.shared.group_waiters import GroupWaiters
from mtask.worker.finding.shared.host_queue import HostQueue
from mtask.worker.finding.shared.lease import LeaseLost, RelayLease
from mtask.worker.finding.shared.mode import RelayMode, mode_for
from mtask.worker.finding.stream import OTHER_COLLECTIONS, follow, stream_pipeline

log = logging.getLogger(__name__)

SUBSCRIBER_BUFFER = 4 * 1024 * 1024
"""Bytes the relay buffers for one subscriber before it drops it."""


class Relay:
    """The change stream and claim queue of one tasks collection, for every subscriber."""

    local: dict[str, Relay] = {}
    """The relays held in this process, by id: a worker on the same event loop subscribes to
    its relay directly (``LocalChannel``)."""

    def __init__(
        self,
        database: Any,
        mail: Any,
        tasks: str,
        owner: str,
        buffer: int,
        dispatcher: Dispatcher,
        host: HostQueue,
        lease: RelayLease,
        waiters: GroupWaiters,
    ) -> None:
        self.database = database
        """mtask's database: the relay's change stream follows it."""
        self.mail = mail
        """The inbox database (``driver.inbox_database``): the inboxes and the reports."""
        self.tasks = tasks
        self.owner = owner
        """The worker id of the worker whose process holds the relay."""
        self.lease = lease
        self.id = lease.id
        """This relay's id: the lease names it, subscribers address their reports to it."""
        self.buffer = buffer
        self.dispatcher = dispatcher
        self.host = host
        """The dispatcher's host queue: the relay stream's ``Inbox`` while it hands out."""
        self.waiters = waiters
        """Who keeps a key of a group back (the dispatcher's, from their reports)."""
        self.mode = RelayMode.STARTING
        self._alone_with: LocalChannel | None = None
        """The relay's own worker while ``mode`` is ``ALONE``."""
        self.subscribers: dict[SubscriberChannel, str] = {}
        """Every subscriber's channel and worker id."""
        self.far = FarSubscribers(
            mail,
            tasks,
            buffer,
            lease,
            dispatcher,
            add=self._add,
            remove=self.remove,
            drop=self.drop,
            worker_of=self.subscribers.get,
        )
        """The subscribers in other processes, through MongoDB: hellos, reports, the lease."""
        self.inboxes = self.far.inboxes
        """The subscribers in other processes, by subscription (reports name it)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.position = events.Position(fresh_when_lost=True)
        self.excluded: tuple[str, ...] = ()
        """The workers whose claims and successes the stream in use leaves out: the relay's
        own worker while it is alone with it, else none."""
        self.dropped = 0
        self.restarts = 0

    @property
    def direct(self) -> LocalChannel | None:
        """The relay's own worker, while the relay is alone with it (it gets the task events)."""
        return self._alone_with

    def start(self) -> asyncio.Task[None]:
        """Run the relay in a task of its own, this loop's local relay meanwhile."""
        self.loop = asyncio.get_running_loop()
        Relay.local[self.id] = self
        return self.loop.create_task(self.run(), name="mtask-relay")

    async def run(self) -> None:
        """Move the subscribers of the relay before it, follow the stream, hand out tasks,
        sweep, read the subscribers' reports and keep the lease until cancelled or the lease is
        lost; then let the lease go and every subscriber with it."""
        database, mail, tasks = self.database, self.mail, self.tasks
        served = lambda: {c.inbox for c in self.inboxes.values()}  # noqa: E731
        try:
            async with asyncio.TaskGroup() as group:
                taken = {"f": wire.taken(self.id)}
                group.create_task(mailbox.tell_others(mail, tasks, served, taken))
                group.create_task(self.dispatcher.run(), name="mtask-dispatch")
                group.create_task(self.host.sweep.run(), name="mtask-host-sweep")
                group.create_task(self.far.keep_lease(), name="mtask-relay-lease")
                reports = mailbox.read_reports(mail, tasks, self.id, self._on_report)
                group.create_task(reports, name="mtask-relay-reports")
                await follow(database, self._pipeline, self, self.position)
        except* LeaseLost as lost:
            log.warning("the relay stops: %s", lost.exceptions[0])
        finally:
            self.mode, self._alone_with = RelayMode.STOPPED, None
            self.host.stop()
            if Relay.local.get(self.id) is self:
                del Relay.local[self.id]
            for subscriber in list(self.subscribers):
                subscriber.close()
            self.subscribers.clear()
            self.inboxes.clear()
            with contextlib.suppress(StorageError, asyncio.CancelledError):  # else it runs out
                await asyncio.shield(self.lease.release())

    # -- subscribers ------------------------------------------------------------------------

    def attach(
        self, worker_id: str, names: list[str], free: int, claims: ClaimsBack | None = None
    ) -> LocalChannel:
        """Subscribe a worker of this process and event loop (``claims``: its claims)."""
        local = LocalChannel(self.buffer, self.drop, claims)
        self._add(local, worker_id, names, free)
        return local

    def _add(self, channel: SubscriberChannel, worker_id: str, names: list[str], free: int) -> None:
        handing = self.mode is RelayMode.HANDING
        self.subscribers[channel] = worker_id
        near = isinstance(channel, LocalChannel)
        self.dispatcher.add(channel, worker_id, names, free, near=near)
        self._note_change()
        if handing and self.mode is RelayMode.HANDING:
            channel.send(wire.OPEN)  # (a relay that began to hand out told everyone)
            self.host.catch_up()  # new names: their tasks are read at once

    def remove(self, channel: SubscriberChannel) -> None:
        if self.subscribers.pop(channel, None) is not None:
            self.dispatcher.remove(channel)
            self._note_change()
        if isinstance(channel, InboxChannel) and self.inboxes.get(channel.subscription) is channel:
            del self.inboxes[channel.subscription]  # once (a writer that failed is closed too)
            if self.loop is not None:
                drop = mailbox.drop(self.mail, channel.inbox, LAST_FRAME)
                self.loop.create_task(drop, name="mtask-drop-inbox")
        channel.close()

    def drop(self, channel: SubscriberChannel) -> None:
        """A subscriber past its buffer: it goes (it says hello again)."""
        worker_id = self.subscribers.get(channel)
        if worker_id is not None and not channel.closing():
            self.dropped += 1
            log.warning("dropped a slow subscriber of the shared change stream: %s", worker_id)
        self.remove(channel)

    def _note_change(self) -> None:
        """The subscribers changed: the stream's filter, and the mode, follow."""
        if self.excluded != self._excluded():
            self.position.switch()  # the other filter, from the next event on
        if self.mode in (RelayMode.STARTING, RelayMode.STOPPED):
            return  # its stream's opening decides; or it is no more
        mode = mode_for(self.subscribers, self.owner)
        alone_with = next(iter(self.subscribers)) if mode is RelayMode.ALONE else None
        if mode is not self.mode or alone_with is not self._alone_with:
            self._enter(mode)

    def _excluded(self) -> tuple[str, ...]:
        alone = mode_for(self.subscribers, self.owner) is RelayMode.ALONE
        return (self.owner,) if alone else ()

    def _enter(self, mode: RelayMode) -> None:
        """Enter ``mode`` (or enter it again, its stream reopened): ``mode``'s transitions."""
        alone_with = next(iter(self.subscribers)) if mode is RelayMode.ALONE else None
        if self._alone_with is not None and alone_with is not self._alone_with:
            self._alone_with.first.forget()  # what it was handed is no longer waited for
        self.mode = mode
        self._alone_with = alone_with if isinstance(alone_with, LocalChannel) else None
        if self._alone_with is not None:  # the relay's work is its own worker's
            self.dispatcher.clear()
            self.host.idle()
            self._alone_with.send(wire.OWN)  # it scans, as after an own stream's (re)open
        elif mode is RelayMode.HANDING:  # the host queue scans and hands out
            self.host.activate()
            self.broadcast(wire.OPEN)

    def broadcast(self, doc: Mapping[str, Any]) -> None:
        """Queue ``doc`` for every subscriber."""
        for channel in list(self.subscribers):
            if channel.closing():
                self.drop(channel)
            else:
                channel.send(doc)

    def _tell_waiters(self, slot: str, doc: Mapping[str, Any]) -> None:
        """``doc`` to the subscribers that keep a key of the group ``slot`` back, once."""
        waiters = self.waiters.pop(slot)
        for channel in [c for c in self.subscribers if c in waiters]:
            channel.send(doc)

    # -- what subscribers in other processes say (FarSubscribers) -----------------------------

    def _on_report(self, doc: Mapping[str, Any]) -> None:
        self.far.on_report(doc)

    def let_go_of_the_silent(self, now_mono: float) -> None:
        self.far.let_go_of_the_silent(now_mono)

    # -- the stream (the relay is its Inbox) ------------------------------------------------

    def _pipeline(self) -> list[dict[str, Any]]:
        self.excluded = self._excluded()
        return stream_pipeline(self.tasks, self.excluded)

    async def opened(self) -> None:
        mode = mode_for(self.subscribers, self.owner)
        if mode is RelayMode.HANDING:
            await self.host.opened()  # the relay's queue scans: nothing slips between
        self._enter(mode)

    def on_change(self, change: Mapping[str, Any]) -> None:
        ns = change.get("ns")
        collection = ns.get("coll") if isinstance(ns, Mapping) else None
        slot = event_key(change) if collection == "limits" else None
        if collection in OTHER_COLLECTIONS:
            if self._alone_with is None and isinstance(slot, str) and is_group_slot(slot):
                self._tell_waiters(slot, change)  # a group's slot changes twice a run
            else:
                self.broadcast(change)
        elif self._alone_with is not None:  # ALONE: its worker finds its work from them
            self._alone_with.hand(change)
        else:
            key = event_key(change)
            meta = self.host.known(key) if isinstance(key, str) else None
            if (freed := lock_freed(change, meta)) is not None:  # a run of a sequence ended
                self._tell_waiters(group_slot(*freed), wire.group_freed(*freed))
            self.dispatcher.on_change(change)

    async def settle(self) -> None:
        if self._alone_with is None:
            await self.host.settle()
        elif not self.position.buffered:
            # ALONE: the next read waits for the claim the last change led to (at most
            # CLAIM_WAIT), so that the claim is sent first; not between changes it has read
            # already, which its worker claims together.
            await self._alone_with.settled()

    def restarted(self) -> None:
        self.restarts += 1

    def state(self) -> dict[str, Any]:
        """The relay's counters, for its worker's heartbeat."""
        mode = {"mode": self.mode.value, "direct": self.mode is RelayMode.ALONE}
        counts = {"dropped": self.dropped, "restarts": self.restarts}
        standby = {"appointed": self.far.appointments.asked, **self.lease.state()}
        return {**self.dispatcher.stats(), **mode, **counts, **standby}
