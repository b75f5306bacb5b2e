"""Cluster-wide limits per task name, and per group of a name: at most N runs at once, at most
R claims per second.

One document per limited name in the ``limits`` collection holds the limit and the name's
state; a name may also limit each of its groups (``options.group``), whose state is a document
of its own, made by the first claim that needs it (``mtask.limits.slots``)::

    {_id: name, concurrency: N | null, rate: per second | null, burst: tokens | null,
     group_concurrency: N | null, group_rate: per second | null, group_burst: tokens | null,
     holders: [{run_id, key, worker_id, expires}], tokens: float, refilled_at: date,
     slot_runs_since: date | null, lock_runs_since: date | null}
    {_id: "<name>\\x00<group>", name, group, concurrency, rate, burst, holders, tokens, ...}

``group_concurrency: 1`` makes each group a **sequence**: its tasks run one at a time, in
publish order (docs/flow-control.md).

A worker takes a slot (and a token) with one atomic update of that document *before* it claims
a task of that name, and claims the task with the run id the slot was taken for; a claim that
misses gives the slot back. A slot is a lease like the run's: it carries ``expires`` (server
time), the lease pinger extends it with the run's lease, and a slot whose worker died simply
runs out. The token bucket is refilled from the server clock inside the same update. No limit is
ever kept in a single worker's memory: workers cache the names' documents, to know when to take
a slot and which limit a group's slot has (read again at once when a change event says a
name's limit was set, changed or cleared, ``LIMIT_FIELDS``; and every few seconds whatever
happens, which bounds a lost event).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeGuard

from bson.decimal128 import Decimal128

from mtask.driver import Doc
from mtask.errors import InvalidTask
from mtask.limits import measured
from mtask.vocabulary import MAX_NAME_LENGTH, UNENCODABLE, encodable, validate_name

MAX_LIMIT_CONCURRENCY = 1_000_000
MAX_RATE = 1_000_000.0

NO_ROOM_WAIT = dt.timedelta(hours=1)
"""``retry_at`` of a slot that admits no run (a concurrency below 1, written by hand): no run
ending frees one; the worker tries again on the limit's change event (``LimitGate.block`` waits
a few seconds at most anyway)."""

# ---------------------------------------------------------------------------------------------
# Pure rules (property-tested); the pipeline below computes the same on the server
# ---------------------------------------------------------------------------------------------


BUCKET_CLOCK_SLACK = dt.timedelta(seconds=1)
"""How far a rate bucket's clock (``refilled_at``) may be ahead of a taker's time and still
hold: workers' estimates of the server's clock differ by milliseconds. A bucket further ahead
was stamped before the server's clock was stepped back: it starts again, full, from the
taker's time (``refill``, ``bucket_clock``)."""


def bucket_clock(refilled_at: dt.datetime, now: dt.datetime) -> dt.datetime:
    """The bucket's clock after a take at ``now``: never back by less than
    ``BUCKET_CLOCK_SLACK`` (a clock moved back would count that stretch twice)."""
    return now if refilled_at > now + BUCKET_CLOCK_SLACK else max(now, refilled_at)


def refill(
    tokens: float, refilled_at: dt.datetime, now: dt.datetime, rate: float, burst: float
) -> float:
    """Tokens in the bucket at ``now``: ``rate`` per second since ``refilled_at``, at most
    ``burst``. A clock that went back (another worker's ``now`` a millisecond behind) adds
    nothing and takes nothing, and a take leaves the bucket's clock where it was
    (``bucket_clock``). A bucket's clock more than ``BUCKET_CLOCK_SLACK`` ahead was set before
    the server's clock was stepped back: the bucket is full again (else it would refill
    nothing, and so grant nothing, until the server's clock caught up)."""
    if refilled_at > now + BUCKET_CLOCK_SLACK:
        return burst
    elapsed_ms = max(0.0, (now - refilled_at).total_seconds() * 1000)
    return min(burst, tokens + elapsed_ms * rate / 1000)


def runs_at_once(value: object) -> int | None:
    """How many runs at once a stored ``concurrency`` allows, read as the server's take reads it
    (``slots._filter``): ``None`` if it is no number (``$isNumber``: the slot limits no runs
    at once), else the most live holders it admits — the take adds one only while there are
    fewer than the value. So a document written by hand reads the same everywhere: ``3.0``
    (mongosh writes ``3`` as a double) allows 3; ``2.5`` allows 3; ``0``, a value below it, or
    NaN none; infinity ``MAX_LIMIT_CONCURRENCY`` (more than a document can hold)."""
    if isinstance(value, Decimal128):
        value = value.to_decimal()
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal):
        return None
    if value.is_nan() if isinstance(value, Decimal) else value != value:
        return 0  # no number of holders is below NaN
    if value >= MAX_LIMIT_CONCURRENCY:
        return MAX_LIMIT_CONCURRENCY
    return math.ceil(value) if value > 0 else 0


def wait_for_token(tokens: float, rate: float) -> float:
    """Seconds until the bucket holds one token, given ``tokens`` now."""
    return 0.0 if tokens >= 1 else (1 - tokens) / rate


@dataclass(frozen=True)
class Limit:
    """What one slot document allows: runs at once, claims per second, the bucket's size."""

    concurrency: int | None = None
    rate: float | None = None
    burst: int | None = None

    @property
    def set(self) -> bool:
        return self.concurrency is not None or self.rate is not None

    def full(self) -> float:
        """The bucket's size (a new bucket starts full)."""
        return float(self.burst or max(1.0, self.rate or 1.0))


def validate_limit(name: object, own: Limit, group: Limit = Limit()) -> tuple[str, Limit, Limit]:
    """Check a limit before anything is written; the error names the bad field."""
    name = validate_name(name)
    if not own.set and not group.set:
        raise InvalidTask("give concurrency, rate, group_concurrency or group_rate", field="limit")
    own = _validate_one(own, "")
    return name, own, _validate_one(group, "group_")


def _validate_one(limit: Limit, prefix: str) -> Limit:
    concurrency, rate, burst = limit.concurrency, limit.rate, limit.burst
    if concurrency is not None and (
        isinstance(concurrency, bool)
        or not isinstance(concurrency, int)
        or not 1 <= concurrency <= MAX_LIMIT_CONCURRENCY
    ):
        raise InvalidTask(
            f"must be an integer from 1 to {MAX_LIMIT_CONCURRENCY}", field=f"{prefix}concurrency"
        )
    if rate is not None and (
        isinstance(rate, bool)
        or not isinstance(rate, int | float)
        or not math.isfinite(rate)
        or not 0 < rate <= MAX_RATE
    ):
        raise InvalidTask(
            f"must be a number above 0 and at most {MAX_RATE:g} per second", field=f"{prefix}rate"
        )
    if burst is not None:
        if rate is None:
            raise InvalidTask(f"applies only with a {prefix}rate", field=f"{prefix}burst")
        if isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_RATE:
            raise InvalidTask("must be an integer of at least 1", field=f"{prefix}burst")
    return Limit(concurrency, None if rate is None else float(rate), burst)


def parse_rate(text: str) -> float:
    """``"10/s"``, ``"600/m"``, ``"3600/h"`` or a plain number per second."""
    value, _, unit = text.strip().partition("/")
    seconds = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}.get(unit.strip().lower())
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if seconds is None or not math.isfinite(number) or number <= 0:
        raise InvalidTask(f"{text!r} is not a rate like 10/s, 600/m or 3600/h", field="rate")
    return number / seconds


# ---------------------------------------------------------------------------------------------
# Operations on the limits collection
# ---------------------------------------------------------------------------------------------

CONFIG_FIELDS = {
    "concurrency": 1,
    "rate": 1,
    "burst": 1,
    "group_concurrency": 1,
    "group_rate": 1,
    "group_burst": 1,
    "overflow": 1,
    measured.LIMIT: 1,
    measured.WINDOW: 1,
}

GROUP_SEPARATOR = "\x00"
"""Between a name and a group in a group's slot id (neither may hold a NUL)."""
NAME_LIMITS = {"group": {"$exists": False}}
"""The documents of the names' limits (not the groups' state)."""


RESOURCE_PREFIX = GROUP_SEPARATOR
"""Before a shared resource's name in its document's ``_id`` (``resource_slot``): a task name
is never empty, so no name's or group's document begins with it."""


RESOURCE_IDS = {"_id": {"$gte": RESOURCE_PREFIX, "$lt": chr(ord(RESOURCE_PREFIX) + 1)}}
"""The shared resources' documents, by a range of ``_id`` (its index, not a scan of every
name's and group's document)."""


def resource_slot(resource: str) -> str:
    """The ``_id`` of the limit document of the shared resource ``resource``."""
    return RESOURCE_PREFIX + resource


def is_resource(slot: str) -> bool:
    return slot.startswith(RESOURCE_PREFIX)


def resource_of(slot: str) -> str:
    return slot.removeprefix(RESOURCE_PREFIX)


def slot_label(slot: str) -> str:
    """A limit document's ``_id`` as a log line or a metric shows it, without its NUL
    separator: ``send_email``, ``resource:smtp``, ``send_email group acme``."""
    if is_resource(slot):
        return f"resource:{resource_of(slot)}"
    name, _, group = slot.partition(GROUP_SEPARATOR)
    return f"{name} group {group}" if group else name


def is_group_slot(slot: str) -> bool:
    """A group's slot document (``<name>\x00<group>``), not a name's nor a resource's."""
    return GROUP_SEPARATOR in slot and not is_resource(slot)


def group_slot(name: str, group: str) -> str:
    """The ``_id`` of the limit document of ``group`` of ``name``."""
    return f"{name}{GROUP_SEPARATOR}{group}"


CLAIM_LOCK = f"{GROUP_SEPARATOR}lock"


def claim_lock(name: str, group: str) -> str:
    """What the keys of a sequence wait for while another task of it runs: its group's lock,
    held by a task document (``store.claim_locked``), not a slot document. (A group's name
    holds no NUL: this never names a document.)"""
    return group_slot(name, group) + CLAIM_LOCK


def is_claim_lock(slot: str) -> bool:
    return slot.endswith(CLAIM_LOCK)


def lock_group(lock: str) -> tuple[str, str]:
    """The ``(name, group)`` of a ``claim_lock``."""
    name, _, group = lock.removesuffix(CLAIM_LOCK).partition(GROUP_SEPARATOR)
    return name, group


def is_lock(limit: Limit) -> bool:
    """A limit of runs at once (at least one) and no rate: a slot document taken by one plain
    upsert (``slots._lock``), or a sequence's lock (``is_sequence``). One admitting none (a
    hand-written ``group_concurrency`` below 1) takes the exact path, which refuses it."""
    return limit.concurrency is not None and limit.concurrency >= 1 and limit.rate is None


def is_sequence(limit: Limit) -> bool:
    """A group limit of one run at a time and no rate: its groups run in publish order, each
    held by its running task's claim (``claim_lock``), with no slot document."""
    return limit.concurrency == 1 and limit.rate is None


SLOT_RUNS = "slot_runs_since"
"""When ``set_limit`` made the name's groups sequences (``None``: it did not, or that is
settled): runs of a limit before it (of more runs at once, or a rate) or runs that started
under no limit, counted in since (``slots.join``), may still hold places in the groups' slot
documents, which a sequence has none of. While it is set, a sequence's heads are read with its
groups' slot documents (``store.heads_and_slots``), and the head waits for the runs they hold.
A worker's periodic read settles it (``settle_slot_runs``) once ``SETTLE_AFTER`` has passed and
no group's slot holds a live run: from then on the heads cost their two reads alone."""
SETTLE_AFTER = dt.timedelta(minutes=1)
"""How long after ``set_limit`` the groups' slots are looked at at the earliest to settle
``SLOT_RUNS``: every worker has counted its runs in flight in by then (a change applies within
a second; a lost event within the periodic read's interval, 30 s at most by default)."""


LOCK_RUNS = "lock_runs_since"
"""When ``set_limit`` made the name's groups no sequences any more while they were (``None``:
it did not): a sequence's running task holds its group's lock, not a place in the group's slot
document, until its worker counts it in (``slots.join``) once it hears of the change. Another
worker may hear of it first: while ``SETTLE_AFTER`` has not passed, a worker counts the
groups' lock holders in itself before it takes a place in their slots
(``store_slots.count_lock_runs``), so that its take counts them."""


def lock_runs(doc: Mapping[str, Any], now: dt.datetime) -> bool:
    """Whether a name's document's groups were sequences until less than ``SETTLE_AFTER``
    before ``now`` (``LOCK_RUNS``)."""
    since = doc.get(LOCK_RUNS)
    return isinstance(since, dt.datetime) and now - since < SETTLE_AFTER


def validate_resource(resource: object) -> str:
    """A shared resource's name: as a task name (1 to 200 characters, no NUL)."""
    if not isinstance(resource, str) or not resource.strip():
        raise InvalidTask("must be a non-empty string", field="resource")
    if len(resource) > MAX_NAME_LENGTH or GROUP_SEPARATOR in resource or not encodable(resource):
        raise InvalidTask(
            f"must be at most {MAX_NAME_LENGTH} characters of valid Unicode, with no NUL",
            field="resource",
        )
    return resource


RESOURCE_USERS = "names"
"""In a shared resource's document: task names whose every run takes a slot of it, as if their
handler declared ``uses`` it. Set with the limit (``set_limit(resource=…, names=[…])``, ``mtask
limit --resource R --names a,b``, ``PUT /resources/{r}``) or by any service's own update of the
document (docs/scheduling.md), so a name published and run from anywhere can share a quota."""
MAX_RESOURCE_USERS = 1000


def validate_users(names: object) -> list[str]:
    """A resource's declared users: a list of at most ``MAX_RESOURCE_USERS`` task names (sorted,
    each once)."""
    if isinstance(names, str) or not isinstance(names, list | tuple):
        raise InvalidTask("must be a list of task names", field="names")
    if len(names) > MAX_RESOURCE_USERS:
        raise InvalidTask(f"at most {MAX_RESOURCE_USERS} names", field="names")
    for index, name in enumerate(names):
        try:
            validate_name(name)
        except InvalidTask as bad:
            said = str(bad).removeprefix("name: ")
            raise InvalidTask(f"{said} (the name at {index})", field="names") from None
    return sorted(set(names))


def users(doc: Mapping[str, Any]) -> tuple[str, ...]:
    """The task names a resource's document (any shape) declares as its users."""
    found = doc.get(RESOURCE_USERS)
    if not isinstance(found, list):
        return ()
    return tuple(n for n in found if isinstance(n, str) and n and GROUP_SEPARATOR not in n)


def resource_users(
    declared: Mapping[str, Sequence[str]], docs: Mapping[str, Mapping[str, Any]]
) -> dict[str, tuple[str, ...]]:
    """The slots of the shared resources each name takes: ``declared`` (its handlers' uses, as
    slots), and each resource of ``docs`` (limit documents by ``_id``) whose document lists it
    (``RESOURCE_USERS``): one definition for the worker's claims and the readers' "why"."""
    taken = {name: list(dict.fromkeys(slots)) for name, slots in declared.items() if slots}
    for slot, doc in docs.items():
        if is_resource(slot):
            for user in users(doc):
                found = taken.setdefault(user, [])
                if slot not in found:
                    found.append(slot)
    return {name: tuple(slots) for name, slots in taken.items()}


def overflow_of(doc: Mapping[str, Any] | None) -> str:
    """What a limit does with a task it refuses (``store.overflow``): ``drop``, ``fail``, or
    ``queue`` (it waits for a slot: the default, and what any other value reads as)."""
    found = None if doc is None else doc.get("overflow")
    return found if found in ("drop", "fail") else "queue"


def validate_overflow(overflow: object) -> str | None:
    if overflow is not None and overflow not in ("queue", "drop", "fail"):
        raise InvalidTask("must be queue, drop or fail", field="overflow")
    return None if overflow == "queue" else overflow


def slot_runs(doc: Mapping[str, Any]) -> dt.datetime | None:
    """A name's document's ``SLOT_RUNS``, if it holds a time."""
    since = doc.get(SLOT_RUNS)
    return since if isinstance(since, dt.datetime) else None


OVERRIDES = "group_overrides"
"""A name's per-group overrides (``set_group_limit``): ``[{group, concurrency, rate, burst,
weight}]``, one entry per group, written only by ``set_group_limit`` and
``clear_group_limit``."""
OVERRIDES_AT = "overrides_at"
"""When the overrides last changed: a top-level field every override write sets, so that the
workers' change streams (which look for ``LIMIT_FIELDS`` among an update's fields) hear of
it whatever the server says of the array's change, and carry no copy of the array."""

HELD_UNTIL = "held_until"
"""Until when a name's (or a resource's) document holds back its tasks (``mtask.limits.holds``)."""
GROUP_HOLDS = "group_holds"
"""A name's groups held back, each ``{group, until}`` (``mtask.limits.holds``)."""

LIMIT_FIELDS = (*CONFIG_FIELDS, OVERRIDES_AT, RESOURCE_USERS)
"""The fields of a name's document that say its limit: only ``set_limit`` (or a hand) writes
them, so a change event that names one of them is a change of the limit (a slot taken, given
back or pinged writes none of them)."""
READ_FIELDS = {
    **CONFIG_FIELDS,
    OVERRIDES: 1,
    HELD_UNTIL: 1,
    GROUP_HOLDS: 1,
    "resource": 1,
    RESOURCE_USERS: 1,
    "holders": 1,
    "tokens": 1,
    "refilled_at": 1,
    SLOT_RUNS: 1,
    LOCK_RUNS: 1,
    measured.AT: 1,
    measured.USED: 1,
}


def same_limit(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two of a name's documents (``None``: no limit) say the same limit."""
    if a is None or b is None:
        return a is b
    return all(a.get(f) == b.get(f) for f in (*LIMIT_FIELDS, OVERRIDES, HELD_UNTIL, GROUP_HOLDS))


def own_limit(doc: Mapping[str, Any]) -> Limit:
    """The limit a name's document sets on the name as a whole (any shape: what is not a
    limit is none)."""
    return _limit(doc, "")


def group_limit(doc: Mapping[str, Any]) -> Limit:
    """The limit a name's document sets on each group of the name."""
    return _limit(doc, "group_")


def _limit(doc: Mapping[str, Any], prefix: str) -> Limit:
    concurrency, rate, burst = (doc.get(f"{prefix}{f}") for f in ("concurrency", "rate", "burst"))
    return Limit(
        runs_at_once(concurrency),
        float(rate) if isinstance(rate, int | float) and not isinstance(rate, bool) else None,
        int(burst) if isinstance(burst, int | float) and not isinstance(burst, bool) else None,
    )


def retry_at(doc: Doc, now: dt.datetime, group: str | None = None) -> dt.datetime:
    """When a run of a blocked name (of ``group``) may get a slot and a token at the earliest
    (a slot may free sooner, when a run ends: the worker hears of that from the change
    stream), and the back-off holding it back has ended."""
    waits = [0.0, *_hold_waits(doc, now, group)]
    found = (_token_wait(doc, now), _slot_wait(doc, now), measured.window_wait(doc, now))
    waits += [w for w in found if w is not None]
    return now + dt.timedelta(seconds=max(waits) + 0.001)


def _hold_waits(doc: Doc, now: dt.datetime, group: str | None) -> list[float]:
    """Seconds until each back-off's hold on the name (and on ``group``) ends."""
    holds = [doc.get(HELD_UNTIL)]
    if group is not None and isinstance(found := doc.get(GROUP_HOLDS), list):
        holds += [h.get("until") for h in found if isinstance(h, dict) and h.get("group") == group]
    return [(at - now).total_seconds() for at in holds if isinstance(at, dt.datetime)]


def _token_wait(doc: Doc, now: dt.datetime) -> float | None:
    """Seconds until the name's next token (``None``: no rate, or no bucket yet)."""
    rate, burst = doc.get("rate"), doc.get("burst")
    refilled, tokens = doc.get("refilled_at"), doc.get("tokens")
    if not _is_number(rate):
        return None
    if not rate > 0:  # 0, below or NaN, written by hand: no token comes (the take's reading)
        return NO_ROOM_WAIT.total_seconds()
    if not (isinstance(refilled, dt.datetime) and _is_number(tokens)):
        return None
    # tokens come at the bucket's clock, which may be ahead of ``now`` (another worker's
    # estimate of the server's clock): from whichever is later
    start = bucket_clock(refilled, now)
    size = float(burst) if _is_number(burst) else max(1.0, float(rate))  # as the take's
    have = refill(float(tokens), refilled, start, float(rate), size)
    return (start - now).total_seconds() + wait_for_token(have, float(rate))


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


LIMIT_NUMBERS = ("concurrency", "rate", "burst", "group_concurrency", "group_rate", "group_burst")


def problems(doc: Mapping[str, Any]) -> list[str]:
    """What in a name's (or a resource's) limit document, written by hand, is not what the
    documents' shape says (the module's docstring), and how the take reads it, for the
    worker's warning: a field that is no number limits nothing, one that admits no run or
    no token holds the name's tasks until it changes, ``holders`` that is no array counts no
    run. Empty for every document ``set_limit`` writes."""
    found = []
    for field in LIMIT_NUMBERS:
        value = doc.get(field)
        if value is None:
            continue
        if isinstance(value, Decimal128):
            value = float(value.to_decimal())
        if not _is_number(value):
            found.append(f"{field} {value!r} is no number: it limits nothing")
        elif not value > 0 or (field.endswith("burst") and value < 1):
            found.append(f"{field} {value!r} admits no run: the tasks wait until it changes")
    holders = doc.get("holders")
    if holders is not None and not isinstance(holders, list):
        found.append(f"holders {holders!r} is no array: read as no run holding a slot")
    return found


def _slot_wait(doc: Doc, now: dt.datetime) -> float | None:
    """Seconds until a slot of the name frees, if none is free now (by its holders' leases
    ending; ``None``: one is free, or the name has no bound on its runs at once)."""
    concurrency = runs_at_once(doc.get("concurrency"))
    holders = [h for h in doc.get("holders") or () if isinstance(h, dict)]
    live: list[dt.datetime] = sorted(
        h["expires"]
        for h in holders
        if isinstance(h.get("expires"), dt.datetime) and h["expires"] > now
    )
    if concurrency == 0:  # no slot frees: only a change of the limit (its event) lets one in
        return NO_ROOM_WAIT.total_seconds()
    if concurrency is not None and len(live) >= concurrency:
        return (live[len(live) - concurrency] - now).total_seconds()
    return None


# ---------------------------------------------------------------------------------------------
# Per-group overrides and weights
# ---------------------------------------------------------------------------------------------

MAX_OVERRIDES = 10_000
"""Groups of one name that may have an override: they live in the name's document, which every
worker reads (a tier per tenant of a large SaaS fits; a group without one takes the default)."""
MAX_WEIGHT = 1000.0


@dataclass(frozen=True)
class GroupOverride:
    """What one group of a name has instead of the name's group limit (``None``: the name's
    ``group_…`` value), and its share of turns among the name's groups (``weight``: 3 takes three
    turns for every one of a group of weight 1; ``None``: 1)."""

    concurrency: int | None = None
    rate: float | None = None
    burst: int | None = None
    weight: float | None = None

    @property
    def limits(self) -> bool:
        return self.concurrency is not None or self.rate is not None


def validate_group(group: object) -> str:
    """A group's name as ``options.group`` admits it (1 to 200 characters, no NUL)."""
    if not isinstance(group, str) or not group:
        raise InvalidTask("must be a non-empty string", field="group")
    if len(group) > MAX_NAME_LENGTH:
        raise InvalidTask(f"is {len(group)} characters; at most {MAX_NAME_LENGTH}", field="group")
    if GROUP_SEPARATOR in group:
        raise InvalidTask("must not contain NUL characters", field="group")
    if not encodable(group):
        raise InvalidTask(UNENCODABLE, field="group")
    return group


def validate_override(name: object, group: object, override: GroupOverride) -> tuple[str, str]:
    """Check an override before anything is written; the error names the bad field."""
    name = validate_name(name)
    group = validate_group(group)
    _validate_one(Limit(override.concurrency, override.rate, override.burst), "")
    if not override.limits and override.weight is None:
        raise InvalidTask("give concurrency, rate or weight", field="group")
    if override.concurrency == 1 and override.rate is None:
        raise InvalidTask(
            "1 run at a time per group is a sequence, which the name's group_concurrency=1 "
            "makes; an override of 1 needs a rate",
            field="concurrency",
        )
    weight = override.weight
    if weight is not None and (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not math.isfinite(weight)
        or not 0 < weight <= MAX_WEIGHT
    ):
        raise InvalidTask(f"must be a number above 0 and at most {MAX_WEIGHT:g}", field="weight")
    return name, group


def overrides(doc: Mapping[str, Any]) -> dict[str, GroupOverride]:
    """A name's document's overrides by group (any shape: an entry that is not one is none)."""
    found = doc.get(OVERRIDES)
    out: dict[str, GroupOverride] = {}
    if not isinstance(found, list):
        return out
    for entry in found:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("group"), str):
            continue
        own = _limit(entry, "")
        weight = entry.get("weight")
        good: float | None = None
        if isinstance(weight, int | float) and not isinstance(weight, bool):
            good = float(weight) if 0 < weight <= MAX_WEIGHT else None  # NaN is none
        out[entry["group"]] = GroupOverride(own.concurrency, own.rate, own.burst, good)
    return out


def group_override(doc: Mapping[str, Any] | None, group: str | None) -> GroupOverride | None:
    if doc is None or group is None or OVERRIDES not in doc:
        return None
    return overrides(doc).get(group)


def group_limit_for(doc: Mapping[str, Any], group: str | None) -> Limit:
    """The limit of ``group`` of the name ``doc`` is of: its override's fields over the name's
    group limit. The groups of a name whose groups are sequences (``group_concurrency`` 1)
    keep the name's: an override gives them a weight only; nor does an override make a group a
    sequence (1 run at a time with no rate, say after the name's group rate was cleared)."""
    return limit_under(group_limit(doc), group_override(doc, group))


def limit_under(base: Limit, found: GroupOverride | None) -> Limit:
    """The limit of a group whose name's group limit is ``base`` and whose override is
    ``found`` (``None``: it has none), as ``group_limit_for`` reads it (for a caller that has
    the name's overrides already)."""
    if found is None or not found.limits or base.concurrency == 1:
        return base
    concurrency = base.concurrency if found.concurrency is None else found.concurrency
    if found.rate is not None:
        limit = Limit(concurrency, found.rate, found.burst)
    else:
        limit = Limit(concurrency, base.rate, base.burst)
    # one run at a time and no rate is a sequence, which only the name's limit makes
    return base if is_sequence(limit) else limit


def restricts(doc: Mapping[str, Any]) -> bool:
    """Whether a name's document limits anything (one holding weights alone does not: its
    tasks are claimed plainly)."""
    return (
        own_limit(doc).set
        or group_limit(doc).set
        or any(o.limits for o in overrides(doc).values())
        or has_holds(doc)
        or measured.of(doc) is not None
    )


def has_holds(doc: Mapping[str, Any]) -> bool:
    """Whether a back-off (``mtask.limits.holds``) ever held this document or a group of it: its
    tasks take its slot from then on, and the take decides whether the hold still holds."""
    holds = doc.get(GROUP_HOLDS)
    return isinstance(doc.get(HELD_UNTIL), dt.datetime) or (isinstance(holds, list) and bool(holds))


def weights(doc: Mapping[str, Any]) -> dict[str, float]:
    """The groups of a name's document given a weight other than 1."""
    return {g: o.weight for g, o in overrides(doc).items() if o.weight not in (None, 1.0)}
