"""Finding work: a change stream, a scan, and a periodic sweep.

The stream (``stream.py``: the worker's own, or the host's shared one, ``stream_relay.py``)
is opened before the first scan, so nothing slips between them. Events move tasks
in the claim queue; they are hints, the claim decides. The stream's resume token is kept and
the stream resumed after errors; when history is lost (or any error leaves a possible gap) the
watcher scans again. A sweep rescans every ``sweep_interval`` seconds whatever happens, so a
lost event delays a task by at most one sweep: no lost wake-ups.

Stampede control: when several idle workers see the same new task, each places it at
``claim time + rank * stagger``, where ``rank`` is its place in a rendezvous hash of the task's
key over the live workers that handle the name. The first-ranked worker claims at once; the
others try only if it did not (it was busy), so one task costs about one claim attempt.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar, NamedTuple, Protocol

from mtask import driver, store
from mtask.clock import Clock
from mtask.errors import StorageError
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.presence import Assignment
from mtask.worker.service import PeriodicService, event_or_timeout
from mtask.worker.setaside import SetAside, count, task_key
from mtask.worker.stream import ChangeSource, OwnStream

log = logging.getLogger(__name__)

STRANDED_OPEN_EVERY = 10
"""Every this many rescans (and the first), the sweep also reads every open document for those
no claim can reach (``store.complete.STRANDED_OPEN``); the cheap part runs on every rescan."""


def rendezvous_rank(key: str, worker_id: str, peers: Collection[str]) -> int:
    """This worker's place (0 = first) among ``peers`` for ``key``; 0 if it is not a peer."""
    if len(peers) <= 1 or worker_id not in peers:
        return 0

    def weight(peer: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{peer}".encode(), digest_size=8).digest()

    mine = weight(worker_id)
    return sum(1 for peer in peers if peer != worker_id and weight(peer) < mine)


class TaskMeta(NamedTuple):
    """What the watcher remembers of an open task it queued."""

    name: str
    priority: int
    specific: bool
    """The task names this worker in ``specific_worker_ids``."""
    worker_timeout_ms: int | None


class QueueSink(Protocol):
    """The watcher as the ``Claimer``, the ``LimitGate`` and the ``OutcomeRecorder`` see it:
    where tasks go back into the claim queue, and what is known of a queued task."""

    def place_safely(self, doc: Mapping[str, Any]) -> None: ...

    def requeue_at(self, key: str, when: dt.datetime) -> None: ...

    async def requeue(self, keys: list[str], later_than: dt.datetime | None = None) -> None: ...

    def request_rescan(self) -> None: ...

    def succeeded(self, key: str) -> None: ...

    def claimed(self, doc: Mapping[str, Any]) -> None: ...

    def ignore(self, key: Any) -> None: ...

    def known(self, key: str) -> TaskMeta | None: ...

    def timeouts(self, keys: list[str]) -> dict[str, int]: ...


class Watcher:
    def __init__(
        self,
        driver: driver.AsyncDriver,
        *,
        worker_id: str,
        queue: ClaimQueue,
        clock: Clock,
        wake: Callable[[], None],
        in_flight: Callable[[str], bool],
        on_control: Callable[[], None] = lambda: None,
        on_limit: Callable[[str], None] = lambda name: None,
        on_schedule: Callable[[], None] = lambda: None,
        sweep_interval: float = 30.0,
        stagger_ms: float = 25.0,
        page_size: int = 1000,
        assignment: Assignment | None = None,
        source: ChangeSource | None = None,
    ) -> None:
        self.driver = driver
        self.source: ChangeSource = source or OwnStream()
        self.worker_id = worker_id
        self.queue = queue
        self.clock = clock
        self.wake = wake
        self.in_flight = in_flight
        self.on_control = on_control
        self.on_limit = on_limit
        self.on_schedule = on_schedule
        self.sweep_interval = sweep_interval
        self.stagger = dt.timedelta(milliseconds=stagger_ms)
        self.page_size = page_size
        self.assignment = assignment or Assignment(())
        """The names to queue and their peers, kept up to date by ``Presence``."""
        self.ready = asyncio.Event()
        self.meta: dict[str, TaskMeta] = {}
        """The open tasks this watcher knows."""
        self.unknown: set[str] = set()
        self.malformed = SetAside()
        """Keys (of any type) of malformed documents seen, to be marked invalid by
        ``quarantine``."""
        self._ignored: set[str] = set()
        """Keys of documents that could not even be marked invalid: never queued again."""
        self._touched: set[str] | None = None
        self.rescan_requested = asyncio.Event()
        self._scanning = asyncio.Lock()
        self.dispatched = False
        """The host's relay hands this worker its tasks (``stream_relay``, dispatch): events
        and scans place nothing, and what this worker claims, holds and finishes is told to
        the relay, whose stream leaves those writes out."""
        self.rescans = 0
        self.stream_restarts = 0
        """Restarts of the change stream this watcher's events come from (when it is held in
        this process: its own, or the host's shared one when this worker is the relay)."""

    @property
    def names(self) -> list[str]:
        """The names whose tasks are queued (this worker's, except the paused ones)."""
        return self.assignment.active

    @names.setter
    def names(self, names: list[str]) -> None:
        """For a watcher used on its own (tests): queue these names."""
        self.assignment = Assignment(tuple(names))

    @property
    def scan_ids(self) -> str | tuple[str, ...]:
        """Whose tasks a scan reads (``specific_worker_ids``): this worker's."""
        return self.worker_id

    # -- placing tasks in the queue -------------------------------------------------------------

    def place(self, doc: Mapping[str, Any]) -> None:
        """Put a task in the queue from its document (an insert event, a scan, a lookup)."""
        key = doc["_id"]
        claim_at = doc.get("next_claim_at")
        name = doc.get("name")
        options = doc.get("options") or {}
        specific = options.get("specific_worker_ids") or []
        if not isinstance(specific, list):
            raise TypeError("options.specific_worker_ids is not a list")  # malformed
        if name not in self.names or not self.may_run(key, specific) or key in self._ignored:
            self.forget(key)
            return
        priority = options.get("priority", 0)
        if len(self.meta) >= 4 * self.queue.max_size:
            self.meta.clear()  # bounded memory; unknown keys are looked up again
        timeout = options.get("worker_timeout_ms")
        self.meta[key] = TaskMeta(
            name,
            priority if isinstance(priority, int) else 0,
            bool(specific),
            timeout if isinstance(timeout, int) else None,
        )
        self._move(key, claim_at)

    def may_run(self, key: str, specific: list[Any]) -> bool:
        """Whether a task whose ``specific_worker_ids`` are ``specific`` is this worker's."""
        return not specific or self.worker_id in specific

    def rank(self, key: str, name: str) -> int:
        """This worker's place among the live workers of ``name`` for ``key`` (stampede
        control: the task is queued ``rank * stagger`` after its claim time)."""
        return rendezvous_rank(key, self.worker_id, self.assignment.peers.get(name, ()))

    def timeouts(self, keys: list[str]) -> dict[str, int]:
        """The tasks' worker_timeout_ms as last seen (hints for the claim shortcut)."""
        found = {k: self.meta[k].worker_timeout_ms for k in keys if k in self.meta}
        return {k: t for k, t in found.items() if t is not None}

    def known(self, key: str) -> TaskMeta | None:
        return self.meta.get(key)

    def ignore(self, key: Any) -> None:
        """Never queue ``key`` again (its document cannot even be marked invalid)."""
        self._ignored.add(key)
        self.forget(key)

    async def requeue(self, keys: list[str], later_than: dt.datetime | None = None) -> None:
        """Put tasks back in the claim queue from their current documents (for when no change
        event will: a claim that missed, an outcome that could not be written). With
        ``later_than``, only those not claimable by then: a key a claim missed although it was
        due has been taken by another worker, or may not run here, and an event or the sweep
        brings it back when that changes."""
        try:
            docs = await self.driver.run(store.placements(keys))
        except StorageError as exc:  # the sweep brings them back
            log.warning("cannot re-read tasks to requeue them: %s", exc, extra={"keys": len(keys)})
            return
        gone = set(keys)
        for doc in docs:
            key = doc.get("_id")
            if isinstance(doc.get("next_claim_at"), dt.datetime):
                gone.discard(key)
            if doc.get("well_formed") is False or not due_by(doc, later_than):
                self.place_safely(doc)  # a malformed one is noted for quarantine
                if self.dispatched and key in self.meta:
                    self.source.held(key)  # this worker claims it when it is due
            elif self.dispatched and isinstance(key, str) and key not in gone:
                self.source.missed(key)  # due, and not ours to take: the relay hands it on
        if self.dispatched:
            for key in gone:  # finished or deleted: the relay's queue lets it go
                self.source.gone(key)

    def requeue_at(self, key: str, when: dt.datetime) -> None:
        """Put a known task back in the queue at ``when`` (a limit held it back)."""
        if key in self.meta:
            self._move(key, when)
            if self.dispatched:
                self.source.held(key)  # this worker keeps it: the relay does not hand it on

    def forget(self, key: str) -> None:
        self.queue.discard(key)
        self.meta.pop(key, None)

    def succeeded(self, key: str) -> None:
        """This worker recorded a success of ``key``: its stream skips that event, so forget
        the task here (a rescan that read it before then must not bring it back)."""
        if self._touched is not None:
            self._touched.add(key)
        self.forget(key)
        if self.dispatched:
            self.source.succeeded(key)

    def claimed(self, doc: Mapping[str, Any]) -> None:
        """This worker claimed the task of ``doc`` (its stream skips that event too)."""
        if self.dispatched:
            self.source.claimed(doc["_id"], doc.get("next_claim_at"))

    def place_dispatched(self, key: str, name: str, priority: int, timeout: int | None) -> None:
        """The relay handed this worker ``key``, due now (its claim decides)."""
        if key in self._ignored:
            return
        if self.in_flight(key):  # it runs it already: for another worker (concurrency > 1)
            self.source.missed(key)
            return
        self.meta[key] = TaskMeta(name, priority, False, timeout)
        self.queue.push(key, self.clock.now(), priority)
        self.wake()

    def to_dispatch(self) -> None:
        """From now on the relay hands this worker its tasks: what its own stream or scans
        queued goes (the relay has it too)."""
        self.dispatched = True
        self.queue.clear()
        self.meta.clear()
        self.ready.set()

    def to_own(self) -> None:
        """Back to finding work itself (its own stream: the relay is gone or silent)."""
        self.dispatched = False

    def _move(self, key: str, claim_at: Any) -> None:
        """A known task's claim time changed (``None``: it finished)."""
        if not isinstance(claim_at, dt.datetime):
            self.forget(key)
            return
        if self.in_flight(key):
            self.queue.discard(key)
            return
        name, priority, specific, _ = self.meta[key]
        self.queue.push(key, claim_at + self.rank(key, name) * self.stagger, priority, specific)
        self.wake()

    def on_change(self, change: Mapping[str, Any]) -> None:
        """Apply one event, supervised: an error while applying it is about that one document
        (any service may write any shape), so it is logged with the document's key, the
        document is noted for ``quarantine`` and the worker goes on."""
        try:
            self._apply(change)
        except Exception:
            key = _event_key(change)
            log.exception("could not apply a change event for task %r; marking it invalid", key)
            count("event")
            if key is not None:
                self.malformed.add(key)

    def _apply(self, change: Mapping[str, Any]) -> None:
        """One event. The stream carries no looked-up documents: an insert has its document,
        an update only the new ``next_claim_at``, which is enough for a task this watcher
        already knows; an unknown one is looked up (``unknown``). A key that is not a string
        is never queued: its document is noted for ``quarantine``."""
        collection = change.get("ns", {}).get("coll")
        if collection in ("controls", "schedules", "limits"):
            self._on_other(collection, change.get("documentKey", {}).get("_id"))
            return
        raw = change.get("documentKey", {}).get("_id")
        if raw is None:
            return
        key = task_key(raw)
        if key is None:
            if change.get("operationType") != "delete":
                self.malformed.add(raw)
            return
        if self._touched is not None:
            self._touched.add(key)
        doc = change.get("fullDocument")
        if doc is not None:
            self.place_safely(doc)
        elif change.get("operationType") != "update":
            self.forget(key)  # a delete (a replace carries its document)
        else:
            claim_at = (
                change.get("updateDescription", {}).get("updatedFields", {}).get("next_claim_at")
            )
            if key in self.meta:
                self._move(key, claim_at)
            elif claim_at is None:
                self.forget(key)
            elif not self.in_flight(key):
                self.unknown.add(key)

    def _on_other(self, collection: str, key: Any) -> None:
        """An event on the database's other watched collections."""
        if collection == "controls":
            self.on_control()  # a name was paused or resumed
        elif collection == "schedules":
            self.on_schedule()  # added, changed, resumed, or advanced by a peer
        elif isinstance(key, str):
            self.on_limit(key)  # a slot may have freed, or the limit changed

    async def _look_up_unknown(self) -> None:
        keys, self.unknown = list(self.unknown), set()
        for doc in await self.driver.run(store.placements(keys)):
            self.place_safely(doc)

    def place_safely(self, doc: Mapping[str, Any]) -> None:
        """``place``, or for a malformed document (inserted by hand), note it for
        ``quarantine`` and go on."""
        # a claim cannot match it (store.placements), or (hook, issue 14) a publisher's
        # status-less document to complete, or one with an unknown option: quarantine settles it
        key = doc.get("_id")
        if task_key(key) is None or doc.get("well_formed") is False or not store.placeable(doc):
            if key is not None:
                self.malformed.add(key)
            return
        try:
            self.place(doc)
        except (AttributeError, KeyError, TypeError, ValueError):
            self.malformed.add(key)

    async def quarantine(self) -> None:
        """Mark the malformed documents noted so far ``invalid`` (with the reason), so that
        no worker tries them again; log each once."""
        keys = self.malformed.take()
        for key in keys:
            if task_key(key) is not None:
                self.forget(key)
        try:
            marked = await self.driver.run(store.quarantine(keys, self.clock.now()))
        except StorageError as exc:
            if not exc.document:
                raise
            marked = await self._quarantine_one_by_one(keys)
        if marked:
            log.warning(
                "marked %d malformed task document(s) invalid (see their invalid_reason): %s",
                marked,
                ", ".join(repr(k) for k in keys[:10]),
            )

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
                    self._ignored.add(known)
        return marked

    # -- scanning -----------------------------------------------------------------------------

    async def rescan(self) -> int:
        """Page through every open task for our names, soonest first, until the queue is full.
        Rescans run one at a time: the stream's reopen may ask for one while the sweep's runs,
        and a scan's state (``_touched``, the cleared queue) is its own. A worker the relay
        dispatches to has nothing to scan: the relay's host queue scans for the host."""
        if self.dispatched:
            return 0
        async with self._scanning:
            return await self._rescan()

    async def _rescan(self) -> int:
        self.rescans += 1
        self._touched = set()
        self.queue.clear()
        found = 0
        after: tuple[dt.datetime, str] | None = None
        try:
            while self.names and len(self.queue) < self.queue.max_size:
                page = await self.driver.run(
                    store.scan(self.names, self.scan_ids, self.page_size, after)
                )
                for doc in page:
                    if self.queue.full:  # the rest is later than everything kept
                        self.queue.note_overflow(doc["next_claim_at"])
                        break
                    if doc.get("_id") not in self._touched:  # the scan reads string keys
                        self.place_safely(doc)
                found += len(page)
                if len(page) < self.page_size:
                    break
                after = (page[-1]["next_claim_at"], page[-1]["_id"])
            else:
                if self.names and after is not None:  # full: tasks after `after` were not read
                    self.queue.note_overflow(after[0])
        finally:
            self._touched = None
        # hook (issue 14): documents no claim can reach and no event may bring back (no status,
        # an unknown one, open without a claim time): quarantine completes or marks them
        stranded = await self.driver.run(
            store.stranded(open_too=self.rescans % STRANDED_OPEN_EVERY == 1)
        )
        if stranded:
            marked: int = await self.driver.run(store.quarantine(stranded, self.clock.now()))
            if marked:
                log.warning("marked %d stranded task document(s) invalid (invalid_reason)", marked)
        if self.malformed:
            await self.quarantine()
        self.wake()
        return found

    def request_rescan(self) -> None:
        self.rescan_requested.set()

    # -- what a change source calls ------------------------------------------------------------

    async def opened(self) -> None:
        """The source's stream is (re)open: everything from now on comes as events, so scan
        for what came before (or while it was closed)."""
        await self.rescan()
        self.ready.set()

    async def settle(self) -> None:
        """After an event (or a quiet moment): look up the unknown, quarantine the malformed."""
        if self.unknown:
            await self._look_up_unknown()
        if self.malformed:
            await self.quarantine()

    async def run_stream(self) -> None:
        """Follow the source of change events (``OwnStream`` unless one was given)."""
        await self.source.run(self)


def _event_key(change: Mapping[str, Any]) -> Any:
    """The document key of a change event of any shape, or ``None``."""
    key = change.get("documentKey")
    return key.get("_id") if isinstance(key, Mapping) else None


def due_by(doc: Mapping[str, Any], when: dt.datetime | None) -> bool:
    """True when the task was claimable at ``when`` (never, without a ``when``)."""
    claim_at = doc.get("next_claim_at")
    return when is not None and not (isinstance(claim_at, dt.datetime) and claim_at > when)


class Sweep(PeriodicService):
    """Rescan every ``sweep_interval`` seconds, and on request (a full queue ran out of due
    tasks, a name was resumed) at most once every ``min_gap`` seconds."""

    name: ClassVar[str] = "sweep"
    failure: ClassVar[str] = "sweep failed, will retry"

    def __init__(self, watcher: Watcher, min_gap: float = 0.5) -> None:
        self.watcher = watcher
        self.interval = watcher.sweep_interval
        self.min_gap = min_gap
        self._last: float | None = None

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        if self._last is None:
            self._last = loop.time()
        await event_or_timeout(self.watcher.rescan_requested, self.interval)
        await asyncio.sleep(max(0.0, self._last + self.min_gap - loop.time()))
        self.watcher.rescan_requested.clear()
        self._last = loop.time()

    async def run_once(self) -> None:
        await self.watcher.rescan()
