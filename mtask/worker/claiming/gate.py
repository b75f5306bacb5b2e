"""The worker's side of the cluster-wide limits (``mtask.limits.rules``, ``mtask.limits.slots``).

The gate holds the names' limit documents: a name's is read again at once when its change
event says its limit was set, changed or cleared (``limit_set``), and all of them every
``interval`` whatever happens, which bounds a lost event. A limit that changed wakes the keys
that wait for its slots and is passed on (``applied``: the runs in flight count towards it,
``recount.Recount``). The gate splits the keys popped between the claimer's two strategies
(``partition``), takes the slots and tokens of a batch of runs before they are claimed
(``store_slots.take``), remembers the keys a limit held back and puts them back in the claim queue
when a slot may have freed (a change event on its slot's document: a name's or a group's) or
when the next token is due (at the latest after ``BLOCKED_AT_MOST``: ``held_back.HeldBack``).
The slots of ended runs
go back through ``releases.SlotReleases``, which asks the gate for the keys that wait for a
lock. It never decides a limit itself: the slot documents' atomic updates do, on the server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from mtask.clock import Clock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.limits import rules as limits
from mtask.limits import slots
from mtask.store import limits as store_limits
from mtask.store import slots as store_slots
from mtask.worker.claim_queue import GroupWeights
from mtask.worker.claiming.held_back import HeldBack
from mtask.worker.finding.protocols import QueueSink
from mtask.worker.service import PeriodicService, event_or_timeout, first_set
from mtask.worker.wiring import Signal

log = logging.getLogger(__name__)

REFRESH_SECONDS = 5.0
DEFAULT_SLOT_LEASE_MS = 30_000
MADE_KEPT = 100_000


class Partition(NamedTuple):
    """Keys popped for a claim, split between the claimer's two strategies."""

    plain: list[str]
    """Claimed by one plain claim (``PlainClaims``)."""
    limited: list[str]
    """Of names under a cluster-wide limit: claimed after their slots (``LimitedClaims``)."""
    names: list[str]
    """The names a plain claim may take a task of: those under no limit."""


class LimitGate(PeriodicService):
    """Also the side service that reads the limits: a name's at once on its change event, all
    of them every ``interval``."""

    name: ClassVar[str] = "limits"
    failure: ClassVar[str] = "cannot read the limits, retrying"
    run_first: ClassVar[bool] = True
    interval = REFRESH_SECONDS

    def __init__(
        self,
        driver: AsyncDriver,
        worker_id: str,
        clock: Clock,
        sink: QueueSink,
        interval: float = REFRESH_SECONDS,
        changes: Signal[[str]] | None = None,
        freed: Signal[[str, str]] | None = None,
        limit_set: Signal[[str]] | None = None,
        applied: Callable[[str], None] = lambda name: None,
        reopened: Signal[[]] | None = None,
        ready: asyncio.Event | None = None,
        weights: GroupWeights | None = None,
        uses: Mapping[str, Sequence[str]] | None = None,
        units: Mapping[str, int] | None = None,
    ) -> None:
        self.interval = interval
        """Seconds between two reads of all the limits whatever happens (a change's event
        has the name's read at once: this bounds a lost one)."""
        self.driver = driver
        self.worker_id = worker_id
        self.clock = clock
        self.sink = sink
        if changes is not None:
            changes.connect(self.on_change)  # a slot's change event, from the finding parts
        if limit_set is not None:
            limit_set.connect(self.limit_set)  # a name's limit set, changed or cleared
        if reopened is not None:
            reopened.connect(self.read_all)  # the worker's stream opened afresh
        self.ready = ready
        """Set once the worker's events begin (its first scan, or its relay's first frame): a
        change between the gate's first read and then reached no stream of this worker, so
        all the limits are read once more then."""
        self.before_ready = ready is not None
        self.applied = applied
        """Told the name of each limit that changed, once this worker uses the new one."""
        self.limited: dict[str, dict[str, Any]] = {}
        """The documents of the limited names, as last read."""
        self.restricting: set[str] = set()
        """The names of ``limited`` whose document limits something (``limits.restricts``):
        one that holds only its groups' weights has its tasks claimed plainly."""
        self.weights = weights
        """Where the groups' weights go (the claim queue's turns), if anywhere."""
        self.declared: dict[str, tuple[str, ...]] = {
            name: tuple(limits.resource_slot(r) for r in resources)
            for name, resources in (uses or {}).items()
            if resources
        }
        """The slots of the shared resources each name's handler declares it ``uses``."""
        self.uses: dict[str, tuple[str, ...]] = dict(self.declared)
        """The slots of the shared resources each name's runs take: those its handler declares,
        and those whose document lists it (``limits.RESOURCE_USERS``), as last read."""
        self.units: dict[str, int] = dict(units or {})
        """The units of each limit each name's runs take (its handler's ``units``; 1 if not
        here)."""
        self.held = HeldBack(sink, clock, self.limited)
        """The keys a limit holds back, each back in the claim queue when its slot may have
        freed."""
        if freed is not None:
            freed.connect(self.held.group_freed)  # a group's run ended for good (finding)
        self.made: set[str] = set()
        """Groups' slot documents seen to exist (``store_slots.take`` does not make them again)."""
        self.malformed: dict[str, str] = {}
        """What was said of each limit document written by hand otherwise than the take
        reads it (``_say_problems``)."""
        self.refreshed = asyncio.Event()
        """Set after each read of all the limits."""
        self.stale: set[str] = set()
        """Names whose limit's change event came: read at once (``read_stale``)."""
        self.stale_now = asyncio.Event()
        self.read_all_at = 0.0
        """When (monotonic) all the limits are read next."""

    def is_limited(self, name: str | None) -> bool:
        return name in self.restricting

    def partition(self, keys: list[str], names: list[str]) -> Partition:
        """Which of ``keys`` are claimed after their slots (their names are limited, as far as
        this worker knows) and which plainly, for the names under no limit (so a plain claim
        never takes a limited task, even one whose name this worker no longer knows)."""
        restricting = self.restricting
        if not restricting:
            return Partition(keys, [], names)
        limited = [k for k in keys if (m := self.sink.known(k)) and m.name in restricting]
        held = set(limited)
        plain = [k for k in keys if k not in held]
        return Partition(plain, limited, [n for n in names if n not in restricting])

    async def refresh(self) -> None:
        """Read every name's limit; apply those that changed (a lost event, a first read)."""
        self.read_all_at = time.monotonic() + self.interval
        stale, self.stale = self.stale, set()
        try:
            docs = await self.driver.run(store_limits.all_limits())
        except StorageError:
            self.stale |= stale
            raise
        found = {str(d["_id"]): d for d in docs}
        for name in set(self.limited) | set(found):
            self._apply(name, found.get(name))
        self.refreshed.set()
        await self._settle(found)

    async def _settle(self, docs: dict[str, dict[str, Any]]) -> None:
        """Settle the names whose groups became sequences a while ago (``limits.SLOT_RUNS``),
        if their slots hold no run any more: their heads are read without the slots then."""
        now = self.clock.now()
        for name, doc in docs.items():
            since = limits.slot_runs(doc)
            if since is None or now - since < limits.SETTLE_AFTER:
                continue
            try:
                await self.driver.run(store_limits.settle_slot_runs(name, since, now))
            except StorageError as exc:
                log.warning("cannot settle the groups' slots of %r: %s", name, exc)
                return

    async def read_stale(self) -> None:
        """Read the limits of the names whose change event came, and apply them."""
        names, self.stale = self.stale, set()
        try:
            docs = await self.driver.run(store_limits.limits_of(sorted(names)))
        except StorageError:
            self.stale |= names  # read with the next event, or all of them at the latest
            raise
        found = {str(d["_id"]): d for d in docs}
        for name in names:
            self._apply(name, found.get(name))

    def _apply(self, name: str, doc: dict[str, Any] | None) -> None:
        """``doc`` (``None``: no limit) is ``name``'s limit from now on. If it changed, the keys
        that wait for the name's slots are tried again (as many as each allows now), and
        ``applied`` is told."""
        old = self.limited.pop(name, None)
        self.restricting.discard(name)
        if doc is not None:
            self.limited[name] = doc
            if limits.restricts(doc) and not limits.is_resource(name):
                self.restricting.add(name)
        if limits.is_resource(name) or self.uses.get(name):
            self._restrict_users(reread=limits.is_resource(name))
        if self.weights is not None:
            self.weights.set(name, limits.weights(doc) if doc is not None else {})
        if limits.same_limit(old, doc):
            return
        self._say_problems(name, doc)
        self.held.limit_changed(name)
        self.applied(name)

    def _say_problems(self, name: str, doc: dict[str, Any] | None) -> None:
        """Warn of what in a limit written by hand the take reads otherwise than it says
        (``limits.problems``), once for each new reading of it."""
        said = "; ".join(limits.problems(doc)) if doc is not None else ""
        if said and self.malformed.get(name) != said:
            label = limits.slot_label(name)
            log.warning(
                "the limit document %r, written by hand: %s", label, said, extra={"limit": label}
            )
        if said:
            self.malformed[name] = said
        else:
            self.malformed.pop(name, None)

    def _restrict_users(self, reread: bool) -> None:
        """The names that take a shared resource's slot with a limit are claimed after their
        slots (a resource's change, or a name's, decides it again; ``reread``: a resource's
        document changed, so ``uses`` is read again, in place: the plans read it)."""
        before = set(self.uses)
        if reread:
            self.uses.clear()
            self.uses.update(limits.resource_users(self.declared, self.limited))
        for name in before | set(self.uses):
            own = self.limited.get(name)
            if any(
                limits.restricts(self.limited.get(r) or {}) for r in self.uses.get(name, ())
            ) or (own is not None and limits.restricts(own)):
                self.restricting.add(name)
            else:
                self.restricting.discard(name)

    def apply(self, name: str, doc: dict[str, Any]) -> None:
        """``doc`` is ``name``'s limit document as this worker just wrote it (a back-off's
        hold): used at once, before its event comes."""
        self._apply(name, doc)

    def limit_set(self, name: str) -> None:
        """``name``'s limit was set, changed or cleared (its change event): read it now."""
        self.stale.add(name)
        self.stale_now.set()

    def read_all(self) -> None:
        """Read every limit now (events before now may not have been heard)."""
        self.read_all_at = 0.0
        self.stale_now.set()

    async def wait(self) -> None:
        timeout = max(0.0, self.read_all_at - time.monotonic())
        if self.before_ready and self.ready is not None:
            await first_set((self.stale_now, self.ready), timeout)
            if self.ready.is_set():
                self.before_ready = False
                self.read_all_at = 0.0
        else:
            await event_or_timeout(self.stale_now, timeout)
        self.stale_now.clear()

    async def run_once(self) -> None:
        if time.monotonic() >= self.read_all_at:
            await self.refresh()
        elif self.stale:
            await self.read_stale()

    async def take(
        self, requests: list[slots.Request], now: dt.datetime
    ) -> list[slots.Taken] | None:
        """Slots and tokens for these runs, or why not; ``None`` if MongoDB could not say."""
        try:
            if len(self.made) > MADE_KEPT:
                self.made.clear()  # bounded: a group's document is upserted again, once
            # a sequence's running task, on a worker that may not have counted it in yet
            count_in = slots.lock_runs_of(requests, self.limited, now)
            return await self.driver.run(
                store_slots.take(requests, self.worker_id, now, self.made, count_in)
            )
        except StorageError as exc:
            log.warning(
                "cannot take %d limit slot(s), retrying shortly: %s",
                len(requests),
                exc,
                extra={"slots": len(requests)},
            )
            return None

    def block(self, slot: str, key: str, until: dt.datetime | None, now: dt.datetime) -> None:
        """``key`` waits for ``slot`` (``HeldBack.block``)."""
        self.held.block(slot, key, until, now)

    def on_change(self, slot: str) -> None:
        """The limit document ``slot`` changed (a slot freed): the keys that wait for it are
        tried again — as many as it allows at once, first blocked first (the others wait for
        the next change: a group's backlog is not woken whole for every slot it frees), or all
        of them if it limits only a rate. A name's document of a name not known as limited is
        read (a limit whose event did not say so)."""
        if slot not in self.limited and not limits.is_group_slot(slot):
            self.limit_set(slot)
        self.held.wake(slot)

    def retry_now(self, keys: list[str]) -> None:
        """``SlotReleases``' waits: ``HeldBack.retry_now``."""
        self.held.retry_now(keys)

    def waiting_for_lock(self, slot: str, most: int) -> list[str]:
        """``SlotReleases``' waits: ``HeldBack.waiting_for_lock``."""
        return self.held.waiting_for_lock(slot, most)
