"""Which slots a batch of limited keys asks for, and which keys wait (pure: no I/O).

A key of a limited name asks for the name's slot (if the name itself is limited) and for its
group's slot (if the name limits its groups and the task has a group). In a **sequence** (a
name whose ``group_concurrency`` is 1) only the group's head may run (``store.open_groups.heads``:
the task that holds its lock, else its first open task in publish order): a key that is not
its group's head waits for its turn, and the head is claimed in its place if it is due. A
sequence with no group rate has no slot: its head is claimed with its group's lock
(``store.claim_locked``, ``Plan.locked``), and its keys wait for that lock
(``limits.claim_lock``). A batch never asks a slot for more runs than it allows at once; the
rest wait for it. The server decides: the slots' atomic updates, then the claim.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mtask.limits import measured
from mtask.limits import rules as limits
from mtask.limits.slots import Request
from mtask.worker.finding.placement import TaskMeta


@dataclass(frozen=True)
class Wait:
    """``key`` waits for ``slot``: until ``until`` (``None``: its document's change)."""

    key: str
    slot: str
    until: dt.datetime | None = None


@dataclass
class Plan:
    claims: list[tuple[str, list[Request]]] = field(default_factory=list)
    """Keys to claim, each with the slot requests that must all be granted first."""
    waits: list[Wait] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    """Keys whose group has no open task any more: they finished (let the sink say so)."""
    locked: dict[str, str] = field(default_factory=dict)
    """Keys to claim with their group's lock (a sequence's head), each with that lock."""
    unknown: list[str] = field(default_factory=list)
    """Keys whose task this worker no longer knows (its name, its group): never claimed
    blind, since a plain claim would pass every limit by; looked up again."""


def group_of(meta: TaskMeta) -> str | None:
    group = meta.group
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[1], str):
        return group[1]
    return None


def sequences(
    keys: Sequence[str], known: Mapping[str, TaskMeta], limited: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """The ``(name, group)`` of ``keys`` that are sequences: their heads are read first."""
    pairs = set()
    for key in keys:
        meta = known.get(key)
        doc = limited.get(meta.name) if meta is not None else None
        if meta is None or not isinstance(doc, Mapping):
            continue
        group = group_of(meta)
        if group is not None and limits.group_limit(doc).concurrency == 1:
            pairs.add((meta.name, group))
    return sorted(pairs)


def counted(
    name: str, group: str | None, held: Sequence[str], doc: Mapping[str, Any]
) -> list[tuple[str, limits.Limit | None]]:
    """The slots a run in flight of ``name`` (in ``group``, holding ``held``) must hold a place
    in to count towards the limit ``doc`` (a name's document), each with the limit a group's
    slot takes: the name's slot if it limits runs at once; its group's slot if its groups are
    limited by runs at once, or are sequences and the run holds no lock of its own (a sequence
    waits for the runs its group's slot holds: ``store.heads_and_slots``). A slot it holds a
    place in already is asked again: the join does nothing for a holder (``slots.join``)."""
    out: list[tuple[str, limits.Limit | None]] = []
    if limits.own_limit(doc).concurrency is not None:
        out.append((name, None))
    each = limits.group_limit_for(doc, group)
    if group is None or each.concurrency is None:
        return out
    if limits.is_sequence(limits.group_limit(doc)) and limits.claim_lock(name, group) in held:
        return out
    out.append((limits.group_slot(name, group), each))
    return out


def due(head: Mapping[str, Any], now: dt.datetime) -> bool:
    at = head.get("next_claim_at")
    return isinstance(at, dt.datetime) and at <= now


def _turn(
    key: str,
    pair: tuple[str, str],
    gslot: str,
    head: Mapping[str, Any] | None,
    now: dt.datetime,
    out: Plan,
) -> str | None:
    """In a sequence: the key to claim for ``key``'s group (its head, if due), or ``None``;
    ``key`` waits if it is not its turn, or while its group's slot holds a run of it that
    holds no lock (``store.heads_and_slots``: its release wakes the key)."""
    if head is None:  # no open task in its group: it finished
        out.gone.append(key)
        return None
    if head.get("slot_held"):
        out.waits.append(Wait(key, limits.group_slot(*pair)))
        return None
    first = head.get("_id")
    if first != key:
        out.waits.append(Wait(key, gslot))  # not its turn: the head goes first
    if not isinstance(first, str):  # no claim takes it: the sweep marks it invalid
        return None
    if due(head, now):
        return first
    if first == key:  # its turn, but running elsewhere or retrying later
        at = head.get("next_claim_at")
        out.waits.append(Wait(key, gslot, at if isinstance(at, dt.datetime) else None))
    return None


def _group_slots(
    name: str, group: str | None, each: limits.Limit, base: limits.Limit
) -> tuple[str | None, str | None]:
    """The group's slot (if its name limits groups, or it has an override that limits it:
    ``each``), and its lock instead (a sequence with no rate: taken by the claim,
    ``store.claim_locked``; whether the groups are sequences is the name's ``base``)."""
    if group is None or not each.set:
        return None, None
    lock = limits.claim_lock(name, group) if limits.is_sequence(base) else None
    return limits.group_slot(name, group), lock


def _in_turn(
    key: str,
    pair: tuple[str, str],
    slot: str,
    turns: set[tuple[str, str]],
    heads: Mapping[tuple[str, str], Mapping[str, Any]],
    now: dt.datetime,
    out: Plan,
) -> str | None:
    """In a sequence: the key to claim for ``key``'s group, once per batch (``turns``)."""
    if pair in turns:
        out.waits.append(Wait(key, slot))
        return None
    turns.add(pair)
    return _turn(key, pair, slot, heads.get(pair), now, out)


def _full(
    caps: Mapping[str | None, int | None], requests: Sequence[Request], asked: Mapping[str, int]
) -> str | None:
    """A slot the batch has already asked for as many runs as it allows at once."""
    return next(
        (
            r.slot
            for r in requests
            if (cap := caps[r.slot]) is not None and asked.get(r.slot, 0) + r.units > cap
        ),
        None,
    )


def _unlimited(key: str, meta: TaskMeta | None, chosen: set[str], out: Plan) -> None:
    """A key with no limit (any more) is a plain claim; one whose task the worker forgot is
    looked up again: claimed blind, it would pass every limit of its name by."""
    if meta is None:
        out.unknown.append(key)
    elif key not in chosen:
        chosen.add(key)
        out.claims.append((key, []))


@dataclass
class _Planner:
    """One batch's plan, key by key (``plan``)."""

    known: Mapping[str, TaskMeta]
    limited: Mapping[str, Any]
    heads: Mapping[tuple[str, str], Mapping[str, Any]]
    now: dt.datetime
    run_id: Callable[[str], str]
    default_lease_ms: int
    uses: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """The slots of the shared resources each name's runs take (``LimitGate.uses``)."""
    units: Mapping[str, int] = field(default_factory=dict)
    """The units of each limit each name's runs take (``LimitGate.units``; 1 if not there)."""
    out: Plan = field(default_factory=Plan)
    asked: dict[str, int] = field(default_factory=dict)
    """Requests per slot in this batch."""
    turns: set[tuple[str, str]] = field(default_factory=set)
    """Sequences that have had their turn in this batch."""
    chosen: set[str] = field(default_factory=set)

    def key(self, key: str) -> None:
        """Plan ``key``: what to claim for it (itself, or its sequence's head), with which
        requests, or what it waits for."""
        meta = self.known.get(key)
        found = self.limited.get(meta.name) if meta is not None else None
        shared = [] if meta is None else self.shared(meta.name)
        if meta is None or (not isinstance(found, Mapping) and not shared):
            _unlimited(key, meta, self.chosen, self.out)
            return
        doc: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        group = group_of(meta)
        each = limits.group_limit_for(doc, group)  # an override's, else the name's
        gslot, lock = _group_slots(meta.name, group, each, limits.group_limit(doc))
        candidate = self.candidate(key, meta.name, group, doc, gslot, lock)
        if candidate is None or candidate in self.chosen:
            return
        lease = (meta.worker_timeout_ms if candidate == key else None) or self.default_lease_ms
        units = self.units.get(meta.name, 1)
        base = Request(meta.name, self.run_id(candidate), candidate, lease, units=units)
        requests, caps = self.requests(base, doc, group, each, gslot, lock, shared)
        self.choose(key, candidate, requests, caps, lock)

    def candidate(
        self,
        key: str,
        name: str,
        group: str | None,
        doc: Mapping[str, Any],
        gslot: str | None,
        lock: str | None,
    ) -> str | None:
        """The key to claim for ``key``: itself, or in a sequence (a group of one run at once)
        its head, once per batch (``None``: nothing now)."""
        if gslot is None or group is None or limits.group_limit(doc).concurrency != 1:
            return key
        return _in_turn(
            key, (name, group), lock or gslot, self.turns, self.heads, self.now, self.out
        )

    def requests(
        self,
        base: Request,
        doc: Mapping[str, Any],
        group: str | None,
        each: limits.Limit,
        gslot: str | None,
        lock: str | None,
        shared: Sequence[tuple[str, limits.Limit]],
    ) -> tuple[list[Request], dict[str | None, int | None]]:
        """The requests of ``base``'s run (the name's slot, its group's, its shared resources'),
        and how many runs at once the batch may ask of each slot (``None``: no bound)."""
        own = limits.own_limit(doc)
        requests = []
        if own.set or limits.has_holds(doc):  # a back-off's hold: the take decides it
            # the group always: a hold of it written since this worker's view was read is
            # refused by the take itself, not once the worker hears of it
            requests.append(dataclasses.replace(base, group=group))
        if gslot is not None and lock is None:
            requests.append(dataclasses.replace(base, slot=gslot, limit=each))
        # a lossy limit is asked for every key: the server's refusal is what drops the excess
        queued = limits.overflow_of(doc) == "queue"
        caps = {
            base.slot: own.concurrency if queued else None,
            gslot: each.concurrency if queued else None,
        }
        for slot, limit in shared:  # a resource's slot: its document holds its limit
            requests.append(dataclasses.replace(base, slot=slot))
            lossy = limits.overflow_of(self.limited.get(slot)) != "queue"
            caps[slot] = None if lossy else limit.concurrency
        return requests, caps

    def shared(self, name: str) -> list[tuple[str, limits.Limit]]:
        """The slots of the shared resources ``name`` uses that have a limit, with it."""
        out = []
        for slot in self.uses.get(name, ()):
            doc = self.limited.get(slot)
            if isinstance(doc, Mapping) and (
                (limit := limits.own_limit(doc)).set
                or limits.has_holds(doc)
                or measured.of(doc) is not None  # its take decides the window's room
            ):
                out.append((slot, limit))
        return out

    def choose(
        self,
        key: str,
        candidate: str,
        requests: list[Request],
        caps: Mapping[str | None, int | None],
        lock: str | None,
    ) -> None:
        """Claim ``candidate`` (for ``key``) with ``requests``, unless the batch has asked one
        of their slots for as many runs as it allows at once: then ``key`` waits for it."""
        full = _full(caps, requests, self.asked)
        if full is not None:
            if candidate == key:
                self.out.waits.append(Wait(key, full))
            return
        for r in requests:
            self.asked[r.slot] = self.asked.get(r.slot, 0) + r.units
        self.chosen.add(candidate)
        self.out.claims.append((candidate, requests))
        if lock is not None:
            self.out.locked[candidate] = lock


def plan(
    keys: Sequence[str],
    known: Mapping[str, TaskMeta],
    limited: Mapping[str, Any],
    heads: Mapping[tuple[str, str], Mapping[str, Any]],
    now: dt.datetime,
    run_id: Callable[[str], str],
    default_lease_ms: int,
    uses: Mapping[str, Sequence[str]] | None = None,
    units: Mapping[str, int] | None = None,
) -> Plan:
    """What to ask for ``keys`` (popped in the claim queue's order, best first); ``uses``: the
    slots of the shared resources each name's runs take (a resource's document in ``limited``
    under its slot's id)."""
    planner = _Planner(
        known, limited, heads, now, run_id, default_lease_ms, uses or {}, units or {}
    )
    for key in keys:
        planner.key(key)
    return planner.out
