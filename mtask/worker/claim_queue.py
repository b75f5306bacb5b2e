"""The claim queue: when each known task becomes claimable, and which to try first.

Two heaps: ``timers`` orders tasks by claim time; once a task is due it moves to ``ready``,
which orders by priority (high first), then tasks that name this worker, then claim time. The
queue is bounded; when full it keeps the soonest tasks and remembers that it dropped some
(``overflowed``), so the worker rescans once the queue runs dry. Entries are hints: the claim
decides. Pure and synchronous, so it is property-tested without MongoDB.
"""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    claim_at: dt.datetime
    priority: int
    specific: bool
    seq: int


class ClaimQueue:
    def __init__(self, max_size: int = 10_000) -> None:
        if max_size < 1:
            raise ValueError("max_size must be at least 1")
        self.max_size = max_size
        self.entries: dict[str, Entry] = {}
        self._timers: list[tuple[dt.datetime, int, str]] = []
        self._ready: list[tuple[int, int, dt.datetime, int, str]] = []
        self._latest: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.overflowed = False
        self.overflow_at: dt.datetime | None = None
        """The earliest claim time of a task left out because the queue was full: every task
        not in the queue becomes due no earlier than this."""

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.max_size

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def push(
        self, key: str, claim_at: dt.datetime, priority: int = 0, specific: bool = False
    ) -> bool:
        """Add or move ``key``. Returns False when the queue is full and ``key`` is later than
        everything kept (it is dropped and ``overflowed`` set)."""
        if key not in self.entries and len(self.entries) >= self.max_size:
            latest_key = self._latest_key()
            if latest_key is None or self.entries[latest_key].claim_at <= claim_at:
                self.note_overflow(claim_at)
                return False
            self.note_overflow(self.entries[latest_key].claim_at)
            self.discard(latest_key)
        entry = Entry(claim_at, priority, specific, next(self._seq))
        self.entries[key] = entry
        heapq.heappush(self._timers, (claim_at, entry.seq, key))
        heapq.heappush(self._latest, (-claim_at.timestamp(), entry.seq, key))
        return True

    def note_overflow(self, claim_at: dt.datetime) -> None:
        """Some task due at ``claim_at`` (or later) is known but not kept."""
        self.overflowed = True
        if self.overflow_at is None or claim_at < self.overflow_at:
            self.overflow_at = claim_at

    def needs_refill(self, now: dt.datetime) -> bool:
        """True when tasks left out of a full queue may be due and none kept is: scan again."""
        if not self.overflowed or self.next_due(now) == now:
            return False
        return self.overflow_at is None or self.overflow_at <= now

    def discard(self, key: str) -> None:
        self.entries.pop(key, None)  # heap items of a discarded or moved key are skipped later

    def _latest_key(self) -> str | None:
        """The kept key with the latest claim time (O(log n) amortised: a max-heap with lazy
        deletion, rebuilt when stale items outnumber live ones)."""
        if len(self._latest) > 2 * len(self.entries) + 64:
            self._latest = [(-e.claim_at.timestamp(), e.seq, k) for k, e in self.entries.items()]
            heapq.heapify(self._latest)
        while self._latest:
            _, seq, key = self._latest[0]
            entry = self.entries.get(key)
            if entry is not None and entry.seq == seq:
                return key
            heapq.heappop(self._latest)
        return None

    def _promote(self, now: dt.datetime) -> None:
        while self._timers and self._timers[0][0] <= now:
            claim_at, seq, key = heapq.heappop(self._timers)
            entry = self.entries.get(key)
            if entry is None or entry.seq != seq:
                continue
            heapq.heappush(
                self._ready, (-entry.priority, 0 if entry.specific else 1, claim_at, seq, key)
            )

    def pop_due(self, now: dt.datetime, limit: int) -> list[str]:
        """Remove and return up to ``limit`` keys claimable at ``now``, best first."""
        self._promote(now)
        out: list[str] = []
        while self._ready and len(out) < limit:
            *_, seq, key = heapq.heappop(self._ready)
            if not self._live(key, seq):
                continue
            del self.entries[key]
            out.append(key)
        return out

    def due(self, now: dt.datetime) -> int:
        """How many entries are claimable at ``now``."""
        self._promote(now)
        return sum(1 for *_, seq, key in self._ready if self._live(key, seq))

    def _live(self, key: str, seq: int) -> bool:
        """Whether a heap item is still its key's entry (a push or discard leaves old ones)."""
        entry = self.entries.get(key)
        return entry is not None and entry.seq == seq

    def next_due(self, now: dt.datetime) -> dt.datetime | None:
        """When the next entry becomes due (``now`` if one is due already)."""
        self._promote(now)
        while self._ready:
            seq, key = self._ready[0][3], self._ready[0][4]
            entry = self.entries.get(key)
            if entry is not None and entry.seq == seq:
                return now
            heapq.heappop(self._ready)
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
        self.overflowed = False
        self.overflow_at = None
