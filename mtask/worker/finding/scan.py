"""Reading tasks from their documents: the scan, the sweep, the top-up, lookups and quarantine.

The scan pages through every open task of the scope's names, soonest first, until the claim
queue is full; it runs when a stream (re)opens (nothing slips between: the stream is open
first) and every ``sweep_interval`` seconds whatever happens (``Sweep``), so a lost event
delays a task by at most one sweep: no lost wake-ups. A queue that left tasks out is topped up
from the first of them once half of it is gone (``TopUp``). An update event of a task nobody here
knows is looked up (``unknown``); a malformed document (any service may write any shape) is
noted (``malformed``) and marked ``invalid`` with its reason (``quarantine``).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, ClassVar

from mtask import driver, store
from mtask.clock import Clock
from mtask.errors import StorageError
from mtask.worker.finding.placement import Placement
from mtask.worker.finding.setaside import SetAside, count, task_key
from mtask.worker.service import PeriodicService, event_or_timeout

log = logging.getLogger(__name__)

STRANDED_OPEN_EVERY = 10
"""Every this many searches for stranded documents (and the first), the search also reads every
open document for those no claim can reach (``store.complete.stranded_open``)."""
PAGE_MOST = 20_000
"""The most one find of a rescan reads (a bound on the list it makes; the default queue holds
10,000 tasks, so one find fills it)."""
TOP_UP_BATCH = 1_000
"""Documents a reply of a top-up's find carries, and placed between two turns of the event
loop: the claims go on while half a queue is read and placed."""


def due_by(doc: Mapping[str, Any], when: dt.datetime | None) -> bool:
    """True when the task was claimable at ``when`` (never, without a ``when``)."""
    claim_at = doc.get("next_claim_at")
    return when is not None and not (isinstance(claim_at, dt.datetime) and claim_at > when)


class Scanner:
    """Scans, lookups and quarantine for one ``Placement``."""

    def __init__(
        self,
        driver: driver.AsyncDriver,
        placement: Placement,
        clock: Clock,
        *,
        sweep_interval: float = 30.0,
        page_size: int | None = None,
    ) -> None:
        self.driver = driver
        self.placement = placement
        self.clock = clock
        self.sweep_interval = sweep_interval
        self.page_size = page_size
        """The most a page of a rescan reads (``None``: what fills the queue and one more, up
        to ``PAGE_MOST``)."""
        self.malformed = SetAside()
        """Keys (of any type) of malformed documents seen, to be marked invalid."""
        self.unknown: set[str] = set()
        """Keys an update event moved that nobody here knows: looked up by ``settle``."""
        self.rescans = 0
        self.rescan_requested = asyncio.Event()
        self.top_ups = 0
        self.top_up_requested = asyncio.Event()
        self.stranded_searches = 0
        self._stranded_at: dt.datetime | None = None
        """When the last search for stranded documents began."""
        self._touched: set[str] | None = None
        self._scanning = asyncio.Lock()
        self._settling = asyncio.Lock()
        """One quarantine write at a time (``_settle``: the stream's, a scan's, the stranded
        search's): completing a document sets its ``publish_seq`` from the server's time, so
        two writes at once could complete a later-published document of a sequence first."""

    def touch(self, key: str) -> None:
        """An event (or this worker's own write) changed ``key`` while a scan may be reading:
        the scan must not bring back what it read before."""
        if self._touched is not None:
            self._touched.add(key)

    def request_rescan(self) -> None:
        self.rescan_requested.set()

    def request_top_up(self) -> None:
        self.top_up_requested.set()

    def place_safely(self, doc: Mapping[str, Any]) -> None:
        """``place``, or for a malformed document, note it for ``quarantine`` and go on."""
        # a claim cannot match it (store.placements), or (hook) a publisher's
        # status-less document to complete, or one with an unknown option: quarantine settles it
        key = doc.get("_id")
        if task_key(key) is None or doc.get("well_formed") is False or not store.placeable(doc):
            if key is not None:
                self.malformed.add(key)
            return
        try:
            self.placement.place(doc)
        except (AttributeError, KeyError, TypeError, ValueError):
            self.malformed.add(key)

    async def read(self, keys: list[str]) -> list[dict[str, Any]]:
        """The placement fields of ``keys``' current documents (those that exist)."""
        return await self.driver.run(store.placements(keys))

    async def settle(self) -> None:
        """Look up the unknown, quarantine the malformed (after an event, or a quiet wait)."""
        if self.unknown:
            keys, self.unknown = list(self.unknown), set()
            for doc in await self.read(keys):
                self.place_safely(doc)
        if self.malformed:
            await self.quarantine()

    async def quarantine(self) -> None:
        """Mark the malformed documents noted so far ``invalid`` (with the reason), so that
        no worker tries them again; log each once."""
        keys = self.malformed.take()
        if not keys:
            return
        for key in keys:
            if task_key(key) is not None:
                self.placement.forget(key)
        marked = await self._settle(keys)
        if marked:
            log.warning(
                "marked %d malformed task document(s) invalid (see their invalid_reason): %s",
                marked,
                ", ".join(repr(k) for k in keys[:10]),
            )

    async def _settle(self, keys: list[Any]) -> int:
        """Complete or mark ``keys`` (``store.quarantine``), one such write at a time
        (``_settling``: in the order they were asked for), each alone if the server refuses
        one of them; how many were marked invalid."""
        async with self._settling:
            try:
                marked: int = await self.driver.run(store.quarantine(keys, self.clock.now()))
            except StorageError as exc:
                if not exc.document:
                    raise
                marked = await self._quarantine_one_by_one(keys)
            return marked

    async def _quarantine_one_by_one(self, keys: list[Any]) -> int:
        """The server refused to mark one of ``keys``: mark each alone, and let go of the
        ones it refuses (logged, counted), so that they stop nothing else."""
        marked = 0
        for key in keys:
            try:
                marked += await self.driver.run(store.quarantine([key], self.clock.now()))
            except StorageError as exc:
                if not exc.document:
                    raise
                log.warning("cannot mark task %r invalid, letting it go: %s", key, exc)
                count("unmarkable")
                if (known := task_key(key)) is not None:
                    self.placement.ignore(known)
        return marked

    async def rescan(self, requested: bool = False) -> int:
        """Page through every open task of the scope's names, soonest first, until the queue
        is full, then search for stranded documents. Rescans run one at a time: a stream's
        reopen may ask for one while the sweep's runs, and a scan's state (the touched keys,
        the cleared queue) is its own.

        A ``requested`` rescan (a full queue ran out of due tasks, a name was resumed) searches
        for stranded documents only if the last search is ``sweep_interval`` old: that search
        reads every open task, and a backlog larger than the queue asks for a rescan each time
        the queue runs out (a search each time made a drain's cost grow with the backlog's
        square)."""
        async with self._scanning:
            return await self._rescan(requested)

    async def _rescan(self, requested: bool) -> int:
        self.rescans += 1
        scope, queue = self.placement.scope, self.placement.queue
        self._touched = set()
        queue.clear()
        found = 0
        after: tuple[dt.datetime, str] | None = None
        try:
            while scope.names and len(queue) < queue.max_size:
                # One find reads what fills the queue and the first task left out; a page
                # after another (``after``) only if some of what it read was not queued.
                limit = min(queue.max_size - len(queue) + 1, self.page_size or PAGE_MOST)
                page = await self.driver.run(store.scan(list(scope.names), scope.ids, limit, after))
                for doc in page:
                    if not self._place_read(doc):
                        break
                found += len(page)
                if len(page) < limit:
                    break
                last = (page[-1]["next_claim_at"], page[-1]["_id"])
                if last == after:  # read as the page before ended: dates past year 9999, which
                    break  # a worker reads as that year's end, would be read again for ever
                after = last
            else:
                if scope.names and after is not None:  # full: tasks after `after` unread
                    queue.note_overflow(*after)
        finally:
            self._touched = None
        if not requested or self._stranded_due():
            await self._stranded()
        if self.malformed:
            await self.quarantine()
        self.placement.wake()
        return found

    async def top_up(self) -> int:
        """Read on from where a full queue left tasks out (``ClaimQueue.resume``), into what
        half a queue's claims have made room for, without clearing it: a backlog larger than
        the queue is read once, and the claims never wait for a whole queue's read (a rescan
        when the queue ran dry stopped them for about 0.2 s a queue: docs/journal/2026-11.md,
        "A backlog larger than the queue").
        Returns how many documents it read."""
        async with self._scanning:
            scope, queue = self.placement.scope, self.placement.queue
            start = queue.resume
            if start is None or not scope.names or not queue.wants_top_up():
                return 0  # a rescan came first, or the queue is full again
            self.top_ups += 1
            queue.resume = None  # what is left out while this reads is noted afresh
            self._touched = set()
            limit = min(queue.max_size - len(queue) + 1, PAGE_MOST)
            try:
                page = await self.driver.run(
                    store.scan(
                        list(scope.names), scope.ids, limit, start=start, batch_size=TOP_UP_BATCH
                    )
                )
                for i, doc in enumerate(page):
                    if not self._place_read(doc):
                        break
                    if i % TOP_UP_BATCH == TOP_UP_BATCH - 1:
                        await asyncio.sleep(0)  # the claimer's turn
                else:
                    if len(page) == limit:  # tasks after the last one read are unread
                        queue.note_overflow(page[-1]["next_claim_at"], page[-1]["_id"])
            except BaseException:
                queue.note_overflow(*start)  # nothing may be skipped: read from there again
                raise
            finally:
                self._touched = None
        if self.malformed:
            await self.quarantine()
        self.placement.wake()
        return len(page)

    def _place_read(self, doc: Mapping[str, Any]) -> bool:
        """Place a document a scan or a top-up read, unless an event moved its task since the
        read began (the event's view is newer); False, noting it left out, once the queue is
        full (what follows in the page is later than everything kept)."""
        queue = self.placement.queue
        if queue.full:
            queue.note_overflow(doc["next_claim_at"], doc["_id"])
            return False
        if self._touched is None or doc.get("_id") not in self._touched:  # string keys
            self.place_safely(doc)
        return True

    def _stranded_due(self) -> bool:
        last = self._stranded_at
        return last is None or self.clock.now() - last >= dt.timedelta(seconds=self.sweep_interval)

    async def _stranded(self) -> None:
        # hook: documents no claim can reach and no event may bring back (no status,
        # an unknown one, open without a claim time): quarantine completes or marks them
        self._stranded_at = self.clock.now()
        self.stranded_searches += 1
        open_too = self.stranded_searches % STRANDED_OPEN_EVERY == 1
        stranded = await self.driver.run(store.stranded(open_too=open_too))
        if stranded:  # after a quarantine on its way (it may hold earlier keys): _settle
            marked = await self._settle(stranded)
            if marked:
                log.warning("marked %d stranded task document(s) invalid (invalid_reason)", marked)


class TopUp(PeriodicService):
    """A top-up each time the claimer asks for one (``Scanner.top_up``)."""

    name: ClassVar[str] = "top-up"
    failure: ClassVar[str] = "top-up failed; the sweep or a rescan reads the rest"

    def __init__(self, scanner: Scanner) -> None:
        self.scanner = scanner

    async def wait(self) -> None:
        await self.scanner.top_up_requested.wait()
        self.scanner.top_up_requested.clear()

    async def run_once(self) -> None:
        await self.scanner.top_up()


class Sweep(PeriodicService):
    """Rescan every ``interval`` seconds, and on request (a full queue ran out of due
    tasks, a name was resumed) at most once every ``min_gap`` seconds."""

    name: ClassVar[str] = "sweep"
    failure: ClassVar[str] = "sweep failed, will retry"

    def __init__(
        self,
        rescan: Callable[[bool], Awaitable[int]],
        requested: asyncio.Event,
        interval: float,
        min_gap: float = 0.5,
    ) -> None:
        self.rescan = rescan
        self.requested = requested
        self.interval = interval
        self.min_gap = min_gap
        self._last: float | None = None
        self._requested = False
        """Whether the coming rescan was asked for (else the interval passed)."""

    @classmethod
    def of(cls, scanner: Scanner) -> Sweep:
        return cls(scanner.rescan, scanner.rescan_requested, scanner.sweep_interval)

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        if self._last is None:
            self._last = loop.time()
        self._requested = await event_or_timeout(self.requested, self.interval)
        await asyncio.sleep(max(0.0, self._last + self.min_gap - loop.time()))
        self.requested.clear()
        self._last = loop.time()

    async def run_once(self) -> None:
        await self.rescan(self._requested)
