"""Taking and giving back the slots of cluster-wide limits (``mtask.limits.rules``): a name's, and a
group's of a name.

A worker takes a slot (and a token) for a run *before* it claims the task, and claims it with
the run id the slot was taken for; a claim that misses gives the slot back. A slot is a lease
like the run's: it carries ``expires`` (server time), the lease pinger extends it with the
run's lease, and a slot whose worker died simply runs out. The token bucket is refilled from
the server clock inside the same update. No limit is ever kept in a single worker's memory.

``take`` takes any number of slots in at most two bulk writes and one read (a batch claim of
limited names costs a few round trips more, not a few per key):

- a group's slot limiting only runs at once (``group_concurrency`` above 1: a sequence has no
  slot document, its claim takes its lock, ``store.claim_locked``) is a **lock**: one plain
  update with ``upsert`` whose filter matches only if the slot has room (fewer holders than it
  allows, or as many with one whose lease ended);
  it pushes the holder (the holders kept sorted by lease end and as many as the slot allows,
  so an ended lease is dropped by the push that replaces it), and makes the group's document
  if there is none. A full slot makes the upsert's insert fail on ``_id`` (duplicate key):
  the bulk's own reply says which requests were refused, with no read and no write;
- the others (a name's slot, a group's with a rate, and a lock refused while a holder's lease
  had ended unseen — say after the limit was lowered) take the **exact** path: each request
  one pipeline update whose filter matches only if a slot is free and a token there (a full
  slot is not written: no change event), adding the holder (a slot limiting runs at once) or
  noting the run id in ``granted`` (one limiting only a rate: the newest ``GRANTED_KEPT``),
  which one read then looks for.

A run granted only a token holds no place; if its slot comes to limit runs at once while it
runs (a concurrency added), its next ping gives it one (``extend``): a change of limit stops
no run, and the runs in flight count towards the new one.

When a limit changes, each worker counts its runs in flight in at once (``join``, one bulk
write): every run of the name takes a place in each slot the new limit counts that it holds
none in (a name's concurrency set where there was none, a group's limit of runs at once where
its groups had none, or a lock; a sequence's lock given up for a slot), so from then on the
slots hold every run in flight, and new runs wait until fewer than the limit run. A worker that
hears of a sequence's change before the worker whose task holds a group's lock does would take
the group's places without that run: for a while after the change (``rules.LOCK_RUNS``), a
take first gives the lock holders' live runs places (``lock_runs_of``,
``store_slots.count_lock_runs``).

A take (or a join) sets ``taken_at``: the workers' change streams leave out those events (a
slot taken frees none: nobody waiting for the slot needs to hear of it); a release, a new
limit or a change of one reach them. A group's document is removed by MongoDB's TTL monitor
``GROUP_TTL`` after its last take or ping (a day more at most: ``expire_at`` moves once a day).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mtask.driver import Doc
from mtask.limits.rules import (
    GROUP_SEPARATOR,
    Limit,
    is_group_slot,
    lock_runs,
    retry_at,
    runs_at_once,
)
from mtask.limits.rules import is_lock as is_lock_limit

GRANTED_KEPT = 64
"""Run ids a rate-only slot remembers as granted. One evicted by other workers' grants before
this worker's read costs a token, never a run beyond a limit (a concurrency is read from
``holders``, which holds exactly the live runs)."""
TAKEN_AT = "taken_at"
"""Set by every take (and only by a take): the field the change streams' filter leaves out."""
GROUP_TTL = dt.timedelta(days=7)
"""A group's document is removed this long after the day of its last take or ping ends."""


def expire_at(now: dt.datetime) -> dt.datetime:
    """When a group's document used at ``now`` is removed: ``GROUP_TTL`` after that day ends.
    The same value all day, so a take or ping on the same day rewrites no index key."""
    return now.replace(hour=0, minute=0, second=0, microsecond=0) + GROUP_TTL + dt.timedelta(1)


@dataclass(frozen=True)
class Request:
    """One run's request for one slot. ``limit``: a group's limit (its document is made with
    it, and takes it at every request); ``None`` for a name's slot, whose document holds its
    own limit."""

    slot: str
    run_id: str
    key: str
    lease_ms: int
    limit: Limit | None = None
    replaces: str | None = None
    """A lock's request only: the run id of this worker's ended run that holds the slot, handed
    over to this run in the same write that gives it back (``_lock``)."""
    group: str | None = None
    """A name's request only: the run's group, which a back-off may hold in the name's document
    (``mtask.limits.holds``)."""
    units: int = 1
    """How many units of the limit the run takes (``@registry.task(units=…)``): of its
    runs at once and of its tokens."""


@dataclass(frozen=True)
class Taken:
    """What became of one request: ``taken``, or ``limited`` False (the name has no limit
    now: go on without its slot), else ``retry_at``: when one may be had at the earliest.
    A request that ``replaces`` an ended run took that run's place if taken; if not, the ended
    run still holds the slot (give it back)."""

    taken: bool
    limited: bool = True
    retry_at: dt.datetime | None = None
    holder: bool = False
    """Taken as one of the slot's holders (it limits runs at once); ``False``: only granted a
    token (it limits only a rate), so the run holds no place there (``extend``'s ``joins``)."""


def is_lock(request: Request) -> bool:
    """A group's slot limiting only runs at once, one unit a run: taken by ``_lock`` (which
    counts its holders by their places in the array)."""
    return request.limit is not None and request.units == 1 and is_lock_limit(request.limit)


def lock_runs_of(
    requests: Sequence[Request], limited: Mapping[str, Mapping[str, Any]], now: dt.datetime
) -> list[str]:
    """The group's slots among ``requests`` that limit runs at once and whose name's groups
    were sequences until a moment ago (``rules.LOCK_RUNS``, from the names' documents
    ``limited``): their lock holders are counted in before the take
    (``store_slots.count_lock_runs``)."""
    found = set()
    for request in requests:
        if request.limit is None or request.limit.concurrency is None:
            continue
        if not is_group_slot(request.slot):
            continue
        doc = limited.get(request.slot.partition(GROUP_SEPARATOR)[0])
        if doc is not None and lock_runs(doc, now):
            found.add(request.slot)
    return sorted(found)


def decide(requests: Sequence[Request], docs: Mapping[str, Doc], now: dt.datetime) -> list[Taken]:
    """What became of each request, from its slot's document as read after the bulk (pure):
    taken if its run holds the slot (or, for a slot limiting only a rate, was granted it)."""
    out = []
    for request in requests:
        doc = docs.get(request.slot)
        if doc is None:  # a name's limit was removed; a group's document is made next time
            if request.limit is None:
                out.append(Taken(taken=True, limited=False))
            else:
                out.append(Taken(taken=False, retry_at=now))
            continue
        # as the take's pipeline decided: holders if the slot limits runs at once (a number)
        holder = runs_at_once(doc.get("concurrency")) is not None
        if holder:
            holders = doc.get("holders")
            held = isinstance(holders, list) and any(
                isinstance(h, dict) and h.get("run_id") == request.run_id for h in holders
            )
        else:
            granted = doc.get("granted")
            held = isinstance(granted, list) and request.run_id in granted
        if held:
            out.append(Taken(taken=True, holder=holder))
        else:
            out.append(Taken(taken=False, retry_at=retry_at(doc, now, request.group)))
    return out
