"""A worker's own finding of work: its placement and scanner, fed by a source of events.

``Finder`` is the ``Inbox`` its source calls (an own stream, or the relay's events passed on)
and the ``QueueSink`` of its claimer, gate and recorder. Events of the other watched
collections go to the parts that care (``Others``). ``ReportingSink`` is the sink of a worker
that shares the stream: the same, and each outcome of a handed key told to the relay
(``ClaimReports``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mtask.errors import StorageError
from mtask.worker.finding.changes import apply_task_change, event_key, limit_set, lock_freed
from mtask.worker.finding.placement import TaskMeta
from mtask.worker.finding.protocols import ClaimReports
from mtask.worker.finding.scan import Scanner, due_by

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Others:
    """Who hears of a change in the database's other watched collections."""

    control: Callable[[], None] = lambda: None
    """A name was paused or resumed, or the worker began to find its own work: either way the
    heartbeat beats at once and reads the paused names (and, when the worker ranks by them,
    its peers)."""
    limit: Callable[[str], None] = lambda name: None
    """A limit document changed: a slot (a name's, a group's) may have freed."""
    limit_set: Callable[[str], None] = lambda name: None
    """A name's limit was set, changed or cleared (``changes.limit_set``): the claim side reads
    it again (``LimitGate.limit_set``)."""
    group_freed: Callable[[str, str], None] = lambda name, group: None
    """A run of the group ``(name, group)`` ended for good: its sequence's lock may be free
    (the claim side decides what that means: ``LimitGate.group_freed``)."""
    schedule: Callable[[], None] = lambda: None
    """A schedule was added, changed, resumed, or advanced by a peer."""
    opened: Callable[[], None] = lambda: None
    """This worker's own stream opened afresh (first, or its history lost), or its relay said
    ``OPEN`` (a subscription begun or begun again, its relay's stream reopened): what changed
    before was not heard, so the limits are read again (``LimitGate.read_all``)."""


@dataclass
class Requeued:
    """What ``Finder.requeue`` found: kept for later here, due but another's, finished."""

    held: list[str]
    missed: list[str]
    gone: list[str]


class Finder:
    """One worker's placement and scanner, as an ``Inbox`` and as a ``QueueSink``."""

    def __init__(self, scanner: Scanner, others: Others = Others()) -> None:
        self.scanner = scanner
        self.placement = scanner.placement
        self.others = others
        self.ready = asyncio.Event()
        """Set once the first scan is done (or the relay hands out this worker's tasks)."""
        self.restarts = 0
        """Restarts of the change stream this worker's events come from."""

    # -- Inbox ---------------------------------------------------------------------------------

    async def opened(self) -> None:
        self.others.opened()
        await self.scanner.rescan()
        self.ready.set()

    def on_change(self, change: Mapping[str, Any]) -> None:
        ns = change.get("ns")
        collection = ns.get("coll") if isinstance(ns, Mapping) else None
        if collection == "controls":
            self.others.control()
        elif collection == "schedules":
            self.others.schedule()
        elif collection == "limits":
            if (name := limit_set(change)) is not None:
                self.others.limit_set(name)
            elif isinstance(key := event_key(change), str):
                self.others.limit(key)
        else:
            key = event_key(change)
            meta = self.placement.meta.get(key) if isinstance(key, str) else None
            freed = lock_freed(change, meta)
            apply_task_change(self.scanner, change)
            if freed is not None:  # another worker's run of a sequence ended
                self.others.group_freed(*freed)

    async def settle(self) -> None:
        await self.scanner.settle()

    def restarted(self) -> None:
        self.restarts += 1

    # -- QueueSink -----------------------------------------------------------------------------

    def requeue_at(self, key: str, when: dt.datetime) -> None:
        self.placement.move_known(key, when)

    async def requeue(self, keys: list[str], later_than: dt.datetime | None = None) -> None:
        await self.requeue_found(keys, later_than)

    async def requeue_found(
        self, keys: list[str], later_than: dt.datetime | None = None
    ) -> Requeued | None:
        """``requeue``, saying what it found (``None``: MongoDB did not answer; the sweep
        brings them back).

        A key due by ``later_than`` (when the claim that missed it was sent) is someone else's,
        or not this worker's to run, and is left to the next event or the sweep; unless its
        claim time changed while the claim was on its way (an event heard then is not queued):
        then it is queued as its document says now, for one more claim."""
        changed = {key for key in keys if self.placement.changed_while_busy(key)}
        try:
            docs = await self.scanner.read(keys)
        except StorageError as exc:
            log.warning("cannot re-read tasks to requeue them: %s", exc, extra={"keys": len(keys)})
            return None
        found = Requeued([], [], [])
        gone = set(keys)
        for doc in docs:
            key = doc.get("_id")
            if isinstance(doc.get("next_claim_at"), dt.datetime):
                gone.discard(key)
            malformed = doc.get("well_formed") is False
            if malformed or not due_by(doc, later_than) or key in changed:
                self.scanner.place_safely(doc)  # a malformed one is noted for quarantine
                if key in self.placement.meta:
                    found.held.append(key)
                    continue
                if malformed or key not in changed:
                    continue
            if isinstance(key, str) and key not in gone:
                found.missed.append(key)  # due, and not this worker's to take
        found.gone = sorted(gone)
        return found

    def request_rescan(self) -> None:
        self.scanner.request_rescan()

    def request_top_up(self) -> None:
        self.scanner.request_top_up()

    def succeeded(self, key: str) -> None:
        self.scanner.touch(key)  # a rescan that read it before now must not bring it back
        self.placement.forget(key)

    def claimed(self, doc: Mapping[str, Any]) -> None:
        """Nothing to do: the stream's own filter leaves this worker's claims out."""

    def ignore(self, key: Any) -> None:
        if isinstance(key, str):
            self.placement.ignore(key)

    def known(self, key: str) -> TaskMeta | None:
        return self.placement.known(key)

    def timeouts(self, keys: list[str]) -> dict[str, int]:
        return self.placement.timeouts(keys)


class ReportingSink:
    """The ``QueueSink`` of a worker that shares the stream: its ``Finder``, and what became
    of each key told to the relay (the subscriber says it only while the relay hands this
    worker its tasks)."""

    def __init__(self, finder: Finder, reports: ClaimReports) -> None:
        self.finder = finder
        self.reports = reports

    def requeue_at(self, key: str, when: dt.datetime) -> None:
        if self.finder.placement.move_known(key, when):
            self.reports.held(key)  # this worker keeps it: the relay does not hand it on

    async def requeue(self, keys: list[str], later_than: dt.datetime | None = None) -> None:
        found = await self.finder.requeue_found(keys, later_than)
        if found is None:
            return
        for key in found.held:
            self.reports.held(key)  # this worker claims it when it is due
        for key in found.missed:
            self.reports.missed(key)  # due, and not ours to take: the relay hands it on
        for key in found.gone:
            self.reports.gone(key)  # finished or deleted: the relay lets it go

    def request_rescan(self) -> None:
        self.finder.request_rescan()

    def request_top_up(self) -> None:
        self.finder.request_top_up()

    def succeeded(self, key: str) -> None:
        self.finder.succeeded(key)
        self.reports.succeeded(key)

    def claimed(self, doc: Mapping[str, Any]) -> None:
        self.reports.claimed(doc["_id"], doc.get("next_claim_at"))

    def ignore(self, key: Any) -> None:
        self.finder.ignore(key)

    def known(self, key: str) -> TaskMeta | None:
        return self.finder.known(key)

    def timeouts(self, keys: list[str]) -> dict[str, int]:
        return self.finder.timeouts(keys)
