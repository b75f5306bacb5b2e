"""The claim queue: when each known task becomes claimable, and which to try first.

Two stages: ``timers`` orders tasks by claim time; once a task is due it moves to the ready
stage (``Ready``), which chooses which due task goes first:

1. the higher **effective priority**: the task's priority, raised by one for every ``aging``
   its task has waited since its place in line (``place``: the document's ``available_at``,
   when it last became due by publish, retry or wake-up; a lease's end does not move it), so
   low-priority work is not starved for ever (off when ``aging`` is ``None``);
2. tasks that name this worker;
3. **fairness**: the fairness group (a task's name and ``options.group``; every task
   without a group is in one group together) that has been served least since it had due
   work, so a group with a backlog takes turns with a group that has a few tasks instead
   of going first with all of them (round robin); a group that comes back starts level
   with the group served last, not with the credit of its idle time; a group given a
   weight (``GroupWeights``) takes that many turns for one of a group of weight 1;
4. the earlier place in line, so a task whose lease ran out (its worker killed, its run
   timed out) goes ahead of tasks published after it.

The queue is bounded; when full it keeps the soonest tasks and remembers where the first it
dropped sits (``resume``), so the worker reads on from there once half the queue is gone
(``Scanner.top_up``), and rescans if it runs dry all the same. Entries are hints: the claim
decides. Pure and synchronous, so it is property-tested without MongoDB.
"""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
import math
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping
from typing import NamedTuple

Group = Hashable
"""A fairness group: ``(name, group)`` for a task with a group, ``None`` for all others."""


class Entry(NamedTuple):
    claim_at: dt.datetime
    priority: int
    specific: bool
    seq: int
    group: Group = None
    place: dt.datetime | None = None
    """Its place in line (``available_at``); the claim time when not known."""


def effective_priority(
    priority: int, place: dt.datetime, now: dt.datetime, aging: dt.timedelta | None
) -> int:
    """``priority`` plus one for every whole ``aging`` waited since ``place`` (none before it,
    and none when ``aging`` is ``None``)."""
    if aging is None or now <= place:
        return priority
    return priority + math.floor((now - place) / aging)


class GroupWeights:
    """The groups' shares of turns (``set_group_limit(…, weight=…)``, ``limits.weights``) as
    this worker last read them, per name: a group of weight 3 takes three turns for every one
    of a group of weight 1 while both have due tasks. Every group has weight 1 unless given
    another (no name given weights: nothing is looked up)."""

    def __init__(self) -> None:
        self._by_name: dict[str, dict[str, float]] = {}

    def set(self, name: str, weights: Mapping[str, float]) -> None:
        if weights:
            self._by_name[name] = dict(weights)
        else:
            self._by_name.pop(name, None)

    def of(self, group: Group) -> float:
        if not self._by_name or not isinstance(group, tuple) or len(group) != 2:
            return 1.0
        return self._by_name.get(group[0], {}).get(group[1], 1.0)


# (-effective priority, not specific, place, seq, key)
_Item = tuple[int, int, dt.datetime, int, str]


class Ready:
    """The due entries: a heap per fairness group, and the groups in turn (a heap of each
    group's head, with lazy deletion: an item is current while its ``tick`` is the group's).
    While one group alone has due entries (all work without groups, the common case) the turn
    heap is not kept: a pop is one heap pop, as before groups existed."""

    def __init__(
        self, live: Callable[[str, int], bool], weights: GroupWeights | None = None
    ) -> None:
        self._live = live
        self._weights = weights or GroupWeights()
        self._groups: dict[Group, list[_Item]] = {}
        self._served: dict[Group, float] = {}
        """Turns each group has had, each counted ``1 / weight`` (``GroupWeights``)."""
        self._tick: dict[Group, int] = {}
        self._top: list[tuple[int, int, float, dt.datetime, int, Group]] = []
        self._ticks = itertools.count()
        self._level = 0.0
        """How many turns the group served last had had: a group that comes back starts
        there."""

    def add(self, item: _Item, group: Group) -> None:
        heap = self._groups.get(group)
        if heap is None:
            heap = self._groups[group] = []
            self._served[group] = self._level
            if len(self._groups) == 2:  # turns begin: the group that was alone takes its place
                for other, others in self._groups.items():
                    if others:
                        self._announce(other)
        heapq.heappush(heap, item)
        if len(self._groups) > 1 and heap[0] is item:
            self._announce(group)

    def _announce(self, group: Group) -> None:
        """Put ``group``'s current head in the turn heap (its older item goes stale)."""
        head = self._groups[group][0]
        tick = next(self._ticks)
        self._tick[group] = tick
        heapq.heappush(self._top, (head[0], head[1], self._served[group], head[2], tick, group))

    def _settled(self) -> tuple[float, Group] | None:
        """The turn heap's top made current (stale items and dead heads cleaned on the way):
        its group and how many turns that group has had, or ``None`` when nothing is ready."""
        while self._top:
            neg, spec, served, place, tick, group = self._top[0]
            if self._tick.get(group) != tick:
                heapq.heappop(self._top)
                continue
            heap = self._groups[group]
            while heap and not self._live(heap[0][4], heap[0][3]):
                heapq.heappop(heap)
            heapq.heappop(self._top)
            if not heap:
                self._drop(group)
            elif heap[0][:3] != (neg, spec, place):  # its head changed: its turn again
                self._announce(group)
            else:
                heapq.heappush(self._top, (neg, spec, served, place, tick, group))
                return served, group
        return None

    def _alone(self) -> tuple[Group, list[_Item]] | None:
        """The one group with due entries, its dead heads dropped (``None`` if none is)."""
        group, heap = next(iter(self._groups.items()))
        while heap and not self._live(heap[0][4], heap[0][3]):
            heapq.heappop(heap)
        if heap:
            return group, heap
        self._drop(group)
        return None

    def pop(self) -> str | None:
        """The best due key (or ``None``), taken out."""
        if len(self._groups) <= 1:
            alone = self._alone() if self._groups else None
            if alone is None:
                return None
            group, heap = alone
            key = heapq.heappop(heap)[4]
            self._level = served = self._served[group]
            self._served[group] = served + 1 / self._weights.of(group)
            if not heap:
                self._drop(group)
            return key
        settled = self._settled()
        if settled is None:
            return None
        served, group = settled
        heapq.heappop(self._top)
        heap = self._groups[group]
        key = heapq.heappop(heap)[4]
        self._level = served
        self._served[group] = served + 1 / self._weights.of(group)
        if heap:
            self._announce(group)
        else:
            self._drop(group)
        return key

    def _drop(self, group: Group) -> None:
        del self._groups[group], self._served[group]
        self._tick.pop(group, None)
        if len(self._groups) <= 1:  # no turns to take: the turn heap is not kept
            self._top.clear()
            self._tick.clear()

    def live_items(self) -> Iterator[tuple[_Item, Group]]:
        for group, heap in self._groups.items():
            for item in heap:
                if self._live(item[4], item[3]):
                    yield item, group

    def __bool__(self) -> bool:
        """Whether any live entry is ready."""
        if len(self._groups) <= 1:
            return bool(self._groups) and self._alone() is not None
        return self._settled() is not None

    def rebuild(self, items: list[tuple[_Item, Group]]) -> None:
        """Hold ``items`` instead, each group keeping the turns it has had."""
        served, level = self._served, self._level
        self.clear()
        for item, group in items:
            self.add(item, group)
        for group in self._groups:
            self._served[group] = served.get(group, level)
            self._announce(group)
        self._level = level

    def clear(self) -> None:
        self._groups.clear()
        self._served.clear()
        self._tick.clear()
        self._top.clear()
        self._level = 0.0


class ClaimQueue:
    def __init__(
        self,
        max_size: int = 10_000,
        aging: dt.timedelta | None = None,
        weights: GroupWeights | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        if aging is not None and aging <= dt.timedelta(0):
            raise ValueError("aging must be positive")
        self.max_size = max_size
        self.aging = aging
        self.weights = weights or GroupWeights()
        self.entries: dict[str, Entry] = {}
        self._timers: list[tuple[dt.datetime, int, str]] = []
        self._ready = Ready(self._live, self.weights)
        self._aged_at: dt.datetime | None = None
        self._latest: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.resume: tuple[dt.datetime, str] | None = None
        """The first place, in the scan's order (claim time, key), of a task left out because
        the queue was full (or a place before it): every open task not in the queue (nor in
        flight, nor moved by an event since) is at or after it, so a top-up reads on from here
        (``Scanner.top_up``). ``None``: nothing was left out."""

    def like(self) -> ClaimQueue:
        """An empty queue of the same size and aging (the relay's, for every subscriber)."""
        return ClaimQueue(self.max_size, self.aging, self.weights)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def overflowed(self) -> bool:
        """Some task is known but not kept."""
        return self.resume is not None

    @property
    def overflow_at(self) -> dt.datetime | None:
        """The earliest claim time of a task left out because the queue was full: every task
        not in the queue becomes due no earlier than this."""
        return None if self.resume is None else self.resume[0]

    def wants_top_up(self) -> bool:
        """Tasks were left out and half the queue is gone: read on from ``resume`` before it
        runs dry, while the claims go on from what is left."""
        return self.resume is not None and len(self.entries) <= self.max_size // 2

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.max_size

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def push(
        self,
        key: str,
        claim_at: dt.datetime,
        priority: int = 0,
        specific: bool = False,
        *,
        group: Group = None,
        place: dt.datetime | None = None,
    ) -> bool:
        """Add or move ``key``. Returns False when the queue is full and ``key`` is later than
        everything kept (it is dropped and ``overflowed`` set)."""
        if key not in self.entries and len(self.entries) >= self.max_size:
            latest_key = self._latest_key()
            if latest_key is None or self.entries[latest_key].claim_at <= claim_at:
                self.note_overflow(claim_at, key)
                return False
            self.note_overflow(self.entries[latest_key].claim_at, latest_key)
            self.discard(latest_key)
        entry = Entry(claim_at, priority, specific, next(self._seq), group, place)
        self.entries[key] = entry
        heapq.heappush(self._timers, (claim_at, entry.seq, key))
        heapq.heappush(self._latest, (-claim_at.timestamp(), entry.seq, key))
        self._compact_latest()
        return True

    def note_overflow(self, claim_at: dt.datetime, key: str) -> None:
        """The task ``key``, due at ``claim_at``, is known but not kept (or, from a scan, the
        first one read and not kept, or the last one read before those not read)."""
        if self.resume is None or (claim_at, key) < self.resume:
            self.resume = (claim_at, key)

    def needs_refill(self, now: dt.datetime) -> bool:
        """True when tasks left out of a full queue may be due and none kept is: scan again."""
        if not self.overflowed or self.next_due(now) == now:
            return False
        return self.overflow_at is None or self.overflow_at <= now

    def discard(self, key: str) -> None:
        self.entries.pop(key, None)  # heap items of a discarded or moved key are skipped later
        self._compact_latest()

    def _compact_latest(self) -> None:
        """Rebuild the heap of latest claim times once its stale items outnumber the live
        ones (O(1) amortised), after every change to the entries, so that it never holds more
        than ``2 * len(self) + 64`` items: a queue never cleared (a dispatched worker's, which
        never rescans) grew by one item a task while it was read only when the queue was full."""
        if len(self._latest) > 2 * len(self.entries) + 64:
            self._latest = [(-e.claim_at.timestamp(), e.seq, k) for k, e in self.entries.items()]
            heapq.heapify(self._latest)

    def _latest_key(self) -> str | None:
        """The kept key with the latest claim time (O(log n) amortised: a max-heap with lazy
        deletion, rebuilt when stale items outnumber live ones)."""
        self._compact_latest()
        while self._latest:
            _, seq, key = self._latest[0]
            entry = self.entries.get(key)
            if entry is not None and entry.seq == seq:
                return key
            heapq.heappop(self._latest)
        return None

    def _item(self, key: str, entry: Entry, now: dt.datetime) -> _Item:
        line = entry.claim_at if entry.place is None else entry.place
        priority = entry.priority
        if self.aging is not None:
            priority = effective_priority(priority, line, now, self.aging)
        return (-priority, 0 if entry.specific else 1, line, entry.seq, key)

    def _promote(self, now: dt.datetime) -> None:
        if self.aging is not None and (self._aged_at is None or now >= self._aged_at + self.aging):
            self._age(now)
        while self._timers and self._timers[0][0] <= now:
            _, seq, key = heapq.heappop(self._timers)
            entry = self.entries.get(key)
            if entry is None or entry.seq != seq:
                continue
            self._ready.add(self._item(key, entry, now), entry.group)

    def _age(self, now: dt.datetime) -> None:
        """Compute the ready entries' effective priorities again (once per ``aging``); the
        groups' turns are kept."""
        self._aged_at = now
        ready = [(item[4], group) for item, group in self._ready.live_items()]
        self._ready.rebuild([(self._item(key, self.entries[key], now), g) for key, g in ready])

    def pop_due(self, now: dt.datetime, limit: int) -> list[str]:
        """Remove and return up to ``limit`` keys claimable at ``now``, best first."""
        self._promote(now)
        out: list[str] = []
        while len(out) < limit and (key := self._ready.pop()) is not None:
            del self.entries[key]
            out.append(key)
        if out:
            self._compact_latest()
        return out

    def due(self, now: dt.datetime) -> int:
        """How many entries are claimable at ``now``."""
        self._promote(now)
        return sum(1 for _ in self._ready.live_items())

    def _live(self, key: str, seq: int) -> bool:
        """Whether a heap item is still its key's entry (a push or discard leaves old ones)."""
        entry = self.entries.get(key)
        return entry is not None and entry.seq == seq

    def next_due(self, now: dt.datetime) -> dt.datetime | None:
        """When the next entry becomes due (``now`` if one is due already)."""
        self._promote(now)
        if self._ready:
            return now
        while self._timers:
            claim_at, seq, key = self._timers[0]
            entry = self.entries.get(key)
            if entry is not None and entry.seq == seq:
                return claim_at
            heapq.heappop(self._timers)
        return None

    def clear(self) -> None:
        self.entries.clear()
        self._timers.clear()
        self._ready.clear()
        self._latest.clear()
        self._aged_at = None
        self.resume = None

    def retain(self, keys: Collection[str]) -> None:
        """``clear`` (what was left out too: ``resume``), except the entries of ``keys``, queued
        again as they were."""
        kept = [(key, entry) for key, entry in self.entries.items() if key in keys]
        self.clear()
        for key, e in kept:
            self.push(key, e.claim_at, e.priority, e.specific, group=e.group, place=e.place)
