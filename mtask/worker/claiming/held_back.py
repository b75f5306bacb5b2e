"""The keys a cluster-wide limit holds back, as the ``LimitGate`` keeps them (``HeldBack``).

A key whose slot (a name's, a group's, a resource's, a sequence's lock) had no room waits for
it: it goes back in the claim queue when the slot may have freed (its document's change event,
a sequence's run ended for good, its limit changed), as many keys as the slot allows at once,
first held back first, and at its ``until`` (the next token, the earliest slot lease end), at
the latest after ``BLOCKED_AT_MOST``, whatever happens: events are hints. Bounded: past
``BLOCKED_KEPT`` keys the book starts afresh (a key still queued comes back by its ``until``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from mtask.clock import Clock
from mtask.limits import rules as limits
from mtask.worker.finding.protocols import QueueSink

BLOCKED_KEPT = 100_000
BLOCKED_AT_MOST = dt.timedelta(seconds=5.0)
"""How long a key held back by a limit waits at most before it is tried again, if no change
event of its slot came (events are hints); the gate's ``REFRESH_SECONDS``."""


class HeldBack:
    """The keys that wait for each slot; ``limited`` is the gate's limit documents, as last
    read (how much room a slot has, whether it is a lock)."""

    def __init__(self, sink: QueueSink, clock: Clock, limited: Mapping[str, dict[str, Any]]):
        self.sink = sink
        self.clock = clock
        self.limited = limited
        self.blocked: dict[str, dict[str, None]] = {}
        """The keys that wait for each slot, first blocked first."""
        self.waits_for: dict[str, str] = {}
        """The slot each blocked key waits for."""

    def block(self, slot: str, key: str, until: dt.datetime | None, now: dt.datetime) -> None:
        """``key`` waits for ``slot`` (a name's or a group's): back in the queue at ``until``
        (the next token, the earliest slot lease end, a sequence's next task due), at once when
        the slot's document changes, and after ``BLOCKED_AT_MOST`` at the latest."""
        self.unblock([key])
        if len(self.waits_for) >= BLOCKED_KEPT:  # bounded: keys whose task ended elsewhere
            self.blocked.clear()  # are never woken; those still queued come back by ``until``
            self.waits_for.clear()
        self.blocked.setdefault(slot, {})[key] = None
        self.waits_for[key] = slot
        latest = now + BLOCKED_AT_MOST
        self.sink.requeue_at(key, latest if until is None else min(until, latest))

    def wake(self, slot: str) -> None:
        """``slot`` may have freed: as many of its keys as it allows at once are tried again
        (the others wait for the next change), or all of them if it limits only a rate."""
        keys = list(self.blocked.get(slot, ()))
        room = self._room(slot)
        if room is not None:
            keys = keys[:room]
        self.retry_now(keys)

    def limit_changed(self, name: str) -> None:
        """``name``'s limit changed: the keys that wait for any of its slots are woken."""
        prefix = name + limits.GROUP_SEPARATOR
        for slot in [s for s in self.blocked if s == name or s.startswith(prefix)]:
            self.wake(slot)

    def group_freed(self, name: str, group: str) -> None:
        """A run of the group ``(name, group)`` ended for good (``finding.Others``): the keys
        that wait for its sequence's lock are tried again."""
        self.wake(limits.claim_lock(name, group))

    def retry_now(self, keys: list[str]) -> None:
        """``keys`` wait for no slot any more: back in the claim queue now."""
        self.unblock(keys)
        now = self.clock.now()
        for key in keys:
            self.sink.requeue_at(key, now)

    def waiting_for_lock(self, slot: str, most: int) -> list[str]:
        """The first ``most`` keys (first blocked first) that wait for ``slot``, if it is a
        lock (``is_lock``: a release of it may be kept for them, ``releases.SlotReleases``)."""
        return list(self.blocked.get(slot, ()))[:most] if self.is_lock(slot) else []

    def unblock(self, keys: Iterable[str]) -> None:
        """``keys`` wait for no slot any more (claimed, or tried again)."""
        for key in keys:
            slot = self.waits_for.pop(key, None)
            if slot is not None and (waiting := self.blocked.get(slot)) is not None:
                waiting.pop(key, None)
                if not waiting:
                    del self.blocked[slot]

    def _room(self, slot: str) -> int | None:
        """How many runs ``slot`` allows at once (``None``: no such bound known)."""
        if limits.is_resource(slot):
            found = self.limited.get(slot)
            return None if found is None else limits.own_limit(found).concurrency
        name, _, group = slot.partition(limits.GROUP_SEPARATOR)
        doc = self.limited.get(name)
        if doc is None:
            return None
        return (limits.group_limit_for(doc, group) if group else limits.own_limit(doc)).concurrency

    def is_lock(self, slot: str) -> bool:
        """A group's slot limiting only runs at once (``slots.is_lock``)."""
        name, _, group = slot.partition(limits.GROUP_SEPARATOR)
        doc = self.limited.get(name)
        if not group or doc is None or limits.is_claim_lock(slot):
            return False
        return limits.is_lock(limits.group_limit_for(doc, group))
