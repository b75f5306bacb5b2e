"""The relay's subscribers in other processes, on any host (``FarSubscribers``): all of them
through MongoDB (``mailbox``, ``wire``), beside the relay's stream, mode and own worker.

A subscriber in another process says hello in the relay's reports collection and gets an inbox
(``channels.InboxChannel``) of its own; its reports (``held``, ``missed``, ``gone``, credit)
reach the dispatcher (``wire.apply_report``); one whose report makes no sense, whose inbox
cannot be written, or that leaves handed keys unacknowledged is let go (its inbox dropped after
``LAST_FRAME``). While any is there the relay renews its lease often and has one of them stand
by (``standby.Appointments``); now and then it sweeps the inboxes nobody reads (``INBOX_SWEEP``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from mtask.worker.finding.shared import mailbox, wire
from mtask.worker.finding.shared.channels import InboxChannel, SubscriberChannel
from mtask.worker.finding.shared.dispatch import Dispatcher
from mtask.worker.finding.shared.lease import RelayLease
from mtask.worker.finding.shared.standby import Appointments
from mtask.worker.service import event_or_timeout

log = logging.getLogger("mtask.worker.finding.shared.relay")  # the name operators filter on

LAST_FRAME = {"f": wire.LET_GO}
"""Written into an inbox before the relay drops it: it wakes a tail's waiting ``getMore``, and
the subscription ends with it (a drop alone does not wake it)."""

INBOX_SWEEP = 600.0
"""Seconds between two sweeps of inboxes nobody reads (made longer ago than this)."""


class FarSubscribers:
    """The relay's subscribers in other processes: ``add``, ``remove``, ``drop`` and
    ``worker_of`` are the relay's (every subscriber is in its books)."""

    def __init__(
        self,
        database: Any,
        tasks: str,
        buffer: int,
        lease: RelayLease,
        dispatcher: Dispatcher,
        *,
        add: Callable[[SubscriberChannel, str, list[str], int], None],
        remove: Callable[[SubscriberChannel], None],
        drop: Callable[[SubscriberChannel], None],
        worker_of: Callable[[SubscriberChannel], str | None],
    ) -> None:
        self.database = database
        """The inbox database (``driver.inbox_database``), where the inboxes are."""
        self.tasks = tasks
        self.buffer = buffer
        self.lease = lease
        self.dispatcher = dispatcher
        self._add, self._remove, self._drop, self._worker_of = add, remove, drop, worker_of
        self.inboxes: dict[str, InboxChannel] = {}
        """The subscribers in other processes, by subscription (reports name it)."""
        self.appointments = Appointments()
        """Whom to ask to stand by, when nobody does."""
        self._renew_now = asyncio.Event()
        """Set by the first subscriber in another process: a standby is asked at once, after a
        renewal (the lease renewed often from then on: the standby finds it fresh)."""

    async def keep_lease(self) -> None:
        """Renew the lease until it is lost; at each renewal let the silent go, ask a
        standby if nobody stands by, and now and then sweep the inboxes nobody reads."""
        swept = time.monotonic()
        while True:
            await event_or_timeout(self._renew_now, self.lease.every(bool(self.inboxes)))
            self._renew_now.clear()
            renewal = await self.lease.renew(bool(self.inboxes))
            if renewal is None:
                continue  # not answered in time: tried again
            renewed = time.monotonic()
            self.let_go_of_the_silent(renewed)
            if (asked := self.appointments.ask(renewal, list(self.inboxes.values()))) is not None:
                asked.send(wire.STANDBY)
            if renewed - swept >= INBOX_SWEEP:
                swept = renewed
                keep = {inbox.inbox for inbox in self.inboxes.values()}
                before = self.dispatcher.now() - dt.timedelta(seconds=INBOX_SWEEP)
                await mailbox.drop_stale(self.database, self.tasks, keep, before, LAST_FRAME)

    def let_go_of_the_silent(self, now_mono: float) -> None:
        """Subscribers in other processes that left handed keys unacknowledged go."""
        for channel in self.dispatcher.silent(now_mono):
            if isinstance(channel, InboxChannel):
                log.info("subscription %s leaves keys unacknowledged", channel.subscription)
                self._remove(channel)

    def lost(self, channel: InboxChannel, exc: Exception) -> None:
        """A frame could not be written to the subscriber's inbox."""
        log.info("cannot write to a subscriber's inbox (%s); letting it go", exc)
        self._remove(channel)

    def on_report(self, doc: Mapping[str, Any]) -> None:
        subscription, message = doc.get("from"), doc.get("f")
        if not isinstance(subscription, str) or not isinstance(message, Mapping):
            return
        inbox = self.inboxes.get(subscription)
        if message.get("hello") is not None:
            self._hello(subscription, message, inbox)
        elif inbox is None:
            return  # an earlier subscription, let go: its tail ended, it says hello again
        elif message.get("bye"):
            self._remove(inbox)
        else:
            try:
                wire.apply_report(self.dispatcher, inbox, message)
            except (TypeError, ValueError) as exc:
                log.warning("a subscriber's report makes no sense (%s); letting it go", exc)
                self._remove(inbox)

    def _hello(self, subscription: str, hello: Mapping[str, Any], was: InboxChannel | None) -> None:
        parsed = wire.parse_hello(self.tasks, hello)
        if parsed is None:
            return
        for old in [c for c in self.inboxes.values() if self._worker_of(c) == parsed.worker_id]:
            self._remove(old)  # a worker subscribes once: its earlier subscription is gone
        if was is not None:
            self._remove(was)
        channel = InboxChannel(
            self.database[parsed.inbox],
            subscription,
            self.buffer,
            self._drop,
            self.lost,
            self.lease.until_fresh,
        )
        self.inboxes[subscription] = channel
        if len(self.inboxes) == 1 and not self.lease.watched:
            self._renew_now.set()  # somebody could stand by now: ask one without waiting
        self._add(channel, parsed.worker_id, parsed.names, parsed.free)
