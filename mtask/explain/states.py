"""A task's derived state, and why it is not running: one pure function, ``explain``.

The stored ``status`` says where a task is in the state machine (docs/design.md); it does not
say why a ``pending`` task does not run. ``explain`` reads that from the document and from the
cluster's state (``Cluster``: paused names, the live workers' names, the limits, the groups'
locks and heads, read by ``mtask.store.cluster``; nothing is written, nothing is kept), and
gives one ``State`` with the ``why`` behind it and a sentence with its facts:

=============  =================================================================================
``scheduled``  not due yet: a delayed start (``run_at``, ``delay``), or an open ``debounce``
               window
``available``  due, nothing in its way: the next free worker of its name claims it
``running``    a run holds it (``why`` ``lease_ended``: its lease ran out, a worker takes it over)
``retrying``   a run failed; the next try waits for its backoff
``waiting``    for a ``signal``, a ``sleep``'s end, a document (``data``), the tasks it depends on
               (``dependencies``),
               the ``children`` it spawned, or the end of a ``snoozed`` run's
               ``Snooze``
``blocked``    due, but its ``group`` (a sequence's lock, a group limit), a ``limit`` of its
               name, its name ``paused``, ``no_worker`` (no live worker handles its name), or
               ``no_key`` (encrypted, and the last worker that claimed it could not decrypt
               it) keeps it from being claimed
``succeeded``, ``failed``, ``cancelled``, ``invalid``: the final statuses, as stored
=============  =================================================================================

The state is derived where it is read (the dashboard, ``mtask get``/``list``, the API): the
claim and the outcome write nothing more for it. A blocked task is claimed as soon as what
blocks it goes (a slot freed, a lock given up, a name resumed): the claim decides, as always.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from mtask.explain.wording import plural, relative, span, when
from mtask.limits import measured
from mtask.limits.rules import (
    Limit,
    is_sequence,
    refill,
    resource_of,
    runs_at_once,
    wait_for_token,
)
from mtask.models import Task, WaitingData
from mtask.security.encryption import UNOPENED
from mtask.steps import NEVER
from mtask.vocabulary import RunState, TaskStatus, bson_json


class State(StrEnum):
    SCHEDULED = "scheduled"
    AVAILABLE = "available"
    RUNNING = "running"
    RETRYING = "retrying"
    WAITING = "waiting"
    BLOCKED = "blocked"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INVALID = "invalid"

    @property
    def open(self) -> bool:
        return self in OPEN_STATES


STATES: tuple[str, ...] = tuple(s.value for s in State)
OPEN_STATES = frozenset(
    {State.SCHEDULED, State.AVAILABLE, State.RUNNING, State.RETRYING, State.WAITING, State.BLOCKED}
)
PENDING_STATES = frozenset(OPEN_STATES - {State.RUNNING})
"""The states of a stored ``pending`` task."""
WHY: dict[State, tuple[str, ...]] = {
    State.WAITING: ("signal", "sleep", "data", "dependencies", "children", "snoozed"),
    State.BLOCKED: ("group", "backoff", "limit", "paused", "no_worker", "no_key"),
}
"""The reasons of a waiting and of a blocked task, in the order ``explain`` tries them."""
SHOWN_DEPENDENCIES = 5
"""How many of the keys a task waits for its reason names."""
_FINAL = {
    TaskStatus.SUCCEEDED: State.SUCCEEDED,
    TaskStatus.FAILED: State.FAILED,
    TaskStatus.CANCELLED: State.CANCELLED,
    TaskStatus.INVALID: State.INVALID,
}


# -- the cluster's state, as read (mtask.store.cluster) ----------------------------------------


@dataclass(frozen=True)
class Worker:
    """A live worker: its id, host and the names it handles."""

    id: str
    host: str | None = None
    names: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Group:
    """A group of a name that limits its groups (``set_limit(group_concurrency=…)``)."""

    limit: Limit
    holder: Task | None = None
    """A sequence's lock holder: the open task that holds the group's lock (it runs, waits for
    its retry, or sleeps), if one does."""
    first: str | None = None
    """A sequence's first open task in publish order (its head when no task holds the lock)."""
    slot: Mapping[str, Any] | None = None
    """Another group limit's slot document (``<name>\\x00<group>`` in ``limits``), if made."""
    ahead: Mapping[str, int] = field(default_factory=dict)
    """Open tasks of the group published before each key (read for one task's page only)."""

    @property
    def sequence(self) -> bool:
        return is_sequence(self.limit)


@dataclass(frozen=True)
class Cluster:
    """What the cluster held at ``now`` (the server's time) that decides whether an open task
    may run. ``workers`` ``None``: not read (no task is then said to have no worker)."""

    now: dt.datetime
    paused: frozenset[str] = frozenset()
    workers: tuple[Worker, ...] | None = None
    limits: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Each limited name's limit document (``limits``), by name."""
    groups: Mapping[tuple[str, str], Group] = field(default_factory=dict)
    """The limited groups of the tasks asked about, by ``(name, group)``."""
    resources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The slots of the shared resources with a limit each name takes (its handlers' ``uses``,
    and the resources that list it), by name: their documents are in ``limits``."""
    missing: frozenset[str] = frozenset()
    """The keys the tasks asked about wait for that no task has (never published, or purged)."""

    def host_of(self, worker_id: str) -> str | None:
        return next((w.host for w in self.workers or () if w.id == worker_id), None)


@dataclass(frozen=True)
class Explained:
    """A task's derived state, the reason behind it (``WHY``; ``None`` when the state says it
    all) and one sentence with the facts (keys and names in backticks)."""

    state: State
    why: str | None
    reason: str


# -- the function ------------------------------------------------------------------------------


def explain(task: Task, cluster: Cluster) -> Explained:
    """The derived state of ``task`` and its reason, given what ``cluster`` held (pure: the
    same answer for the same document and cluster, whatever the document holds)."""
    status = task.status
    if status is not None and status in _FINAL:
        return _final(task, _FINAL[status], cluster.now)
    if status is TaskStatus.RUNNING:
        return _running(task, cluster)
    if task.waiting_on:
        return Explained(State.WAITING, "dependencies", _dependencies(task, cluster))
    due = _due(task, cluster.now)
    if due is None:
        return Explained(
            State.BLOCKED,
            "malformed",
            "it has no time to be claimed at (a malformed document): a worker's sweep marks it "
            "invalid",
        )
    if due > cluster.now:
        return _later(task, due, cluster.now)
    return _blocked(task, cluster) or _available(task, due, cluster)


def _dependencies(task: Task, cluster: Cluster) -> str:
    """What a task waiting for the tasks it depends on says: which, and those no task has."""
    shown = task.waiting_on[:SHOWN_DEPENDENCIES]
    keys = ", ".join(f"`{k}`" for k in shown)
    extra = len(task.waiting_on) - len(shown)
    more = f" and {extra} more" if extra > 0 else ""
    said = f"waiting for {plural(len(task.waiting_on), 'task')} it depends on: {keys}{more}"
    missing = [k for k in shown if k in cluster.missing]
    if missing:
        which = ", ".join(f"`{k}`" for k in missing)
        verb = "does" if len(missing) == 1 else "do"
        said += (
            f"; {which} {verb} not exist: no task has that key, so it waits until one is "
            "published and succeeds (mtask cancel it, or publish the missing task)"
        )
    return said


def _due(task: Task, now: dt.datetime) -> dt.datetime | None:
    """When the task may be claimed: ``next_claim_at``; a publisher's minimal document (no
    status yet) is due at its ``run_at`` or now (the first worker that meets it completes it)."""
    if task.status is None:
        return task.options.run_at or task.created_at or now
    return task.next_claim_at


def _final(task: Task, state: State, now: dt.datetime) -> Explained:
    at = f" {relative(task.finished_at, now)}" if task.finished_at else ""
    if state is State.INVALID:
        return Explained(state, None, f"invalid: {task.invalid_reason or 'a malformed document'}")
    if state is State.SUCCEEDED:
        return Explained(state, None, f"succeeded{at}, on {attempt_text(task)}")
    if state is State.CANCELLED:
        by = f", superseded by `{task.superseded_by}`" if task.superseded_by else ""
        return Explained(state, None, f"cancelled{at}{by}")
    error = last_line(task.error) or "no error was recorded"
    how = " for good" if task.failed_permanently else ""
    return Explained(state, None, f"failed{how}{at}, on {attempt_text(task)}: {error}")


def _running(task: Task, cluster: Cluster) -> Explained:
    now = cluster.now
    runs = [r for r in task.runs if r.state is RunState.RUNNING]
    if not runs:
        return Explained(State.RUNNING, None, "running (no run is recorded)")
    run = runs[-1]
    host = cluster.host_of(run.worker_id)
    where = f"`{run.worker_id}`" + (f" ({host})" if host else "")
    more = f" (and {len(runs) - 1} more runs)" if len(runs) > 1 else ""
    lease = run.lease_expires_at
    if lease is not None and lease <= now:
        return Explained(
            State.RUNNING,
            "lease_ended",
            f"its run on {where} stopped extending its lease {span((now - lease).total_seconds())}"
            " ago: another worker takes it over",
        )
    took = span((now - run.claimed_at).total_seconds())
    return Explained(
        State.RUNNING, None, f"running for {took} on {where}, {attempt_text(task)}{more}"
    )


def _later(task: Task, due: dt.datetime, now: dt.datetime) -> Explained:
    """A pending task not due yet: waiting (a sleep, a signal), retrying, or scheduled."""
    w = task.waiting
    if w is not None:
        step = f"step {w.index + 1}" + (f": {w.step}" if w.step else "")
        if w.children is not None:
            return Explained(State.WAITING, "children", _children(task, step))
        if w.signal is not None:
            return Explained(
                State.WAITING,
                "signal",
                f"waiting for the signal `{w.signal}` ({step}), {deadline(w.until, now)}",
            )
        if w.data is not None:
            return Explained(State.WAITING, "data", _data_wait(w.data, step, w.until, now))
        return Explained(
            State.WAITING,
            "sleep",
            f"sleeping until {when(w.until)} ({relative(w.until, now)}; {step})",
        )
    if snoozed(task):
        return Explained(State.WAITING, "snoozed", _snoozed(task, due, now))
    backed = backed_off(task)
    if backed is not None:
        return Explained(State.SCHEDULED, "backoff", _released(task, backed, due, now))
    if retried(task):
        error = last_line(task.error) or last_line(_last_error(task))
        failed = f"attempt {max(1, attempt_of(task)[0] - 1)} failed" + (
            f": {error}" if error else ""
        )
        return Explained(
            State.RETRYING,
            "backoff",
            f"{failed}; {attempt_text(task)} at {when(due)} ({relative(due, now)})",
        )
    window = task.debounce
    if window is not None and task.attempts == 0:  # a debounce window still open
        most = f"; at the latest {when(window.max_at)}" if window.max_at is not None else ""
        return Explained(
            State.SCHEDULED,
            "debounce",
            f"debounced: runs at {when(due)} ({relative(due, now)}) unless `{window.key}` is "
            f"published again; {plural(window.count, 'publish', 'publishes')} since "
            f"{when(window.first_at)}{most}",
        )
    return Explained(State.SCHEDULED, None, f"scheduled for {when(due)} ({relative(due, now)})")


def snoozed(task: Task) -> bool:
    """Whether the task's newest ended run was snoozed (``raise mtask.Snooze``)."""
    ended = [r for r in task.runs if r.state is not RunState.RUNNING]
    return bool(ended) and ended[-1].state is RunState.SNOOZED


def backed_off(task: Task) -> str | None:
    """What the task's newest ended run said, if its handler's ``BackOff`` released it
    (``backed off group `globex` of `send_email` until …, by its handler``)."""
    ended = [r for r in task.runs if r.state is not RunState.RUNNING]
    if not ended or ended[-1].state is not RunState.RELEASED:
        return None
    said = last_line(ended[-1].error)
    return said if said.startswith("backed off ") else None


HELD_UNTIL = re.compile(r" until \d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\+00:00| UTC)?")
"""The end of a hold in a back-off's stored sentence (the time once written as ISO 8601)."""


def not_decrypted(task: Task) -> str | None:
    """What the task's newest ended run said, if its worker could not decrypt the task's
    params and gave it back (``not decrypted by worker `w1`: this worker has no encryption
    key …``)."""
    ended = [r for r in task.runs if r.state is not RunState.RUNNING]
    if not ended or ended[-1].state is not RunState.RELEASED:
        return None
    said = last_line(ended[-1].error)
    return said if said.startswith(UNOPENED) else None


def _released(task: Task, backed: str, due: dt.datetime, now: dt.datetime) -> str:
    """What a task its handler's ``BackOff`` released says: what it held, until when, how
    often it did of how often it may."""
    cap = task.options.max_backoffs
    of = f" of at most {cap} (max_backoffs)" if cap is not None else ""
    backed = HELD_UNTIL.sub("", backed, count=1)  # said once, as "due again at"
    return (
        f"released: {backed}; due again at {when(due)} ({relative(due, now)}); "
        f"{plural(task.backoffs or 1, 'back-off')}{of}, no retry spent"
    )


def _snoozed(task: Task, due: dt.datetime, now: dt.datetime) -> str:
    """What a snoozed task says: until when, why, how often (no retry was spent)."""
    ended = [r for r in task.runs if r.state is not RunState.RUNNING]
    why = last_line(ended[-1].error) if ended else ""
    times = plural(task.snoozes or 1, "time")
    said = f" ({why})" if why else ""
    return (
        f"snoozed until {when(due)} ({relative(due, now)}){said}; snoozed {times}, no retry spent"
    )


DATA_FILTER_SHOWN = 120
"""How many characters of a data wait's filter its reason shows."""


def _data_wait(data: WaitingData, step: str, until: dt.datetime, now: dt.datetime) -> str:
    """What a task waiting on data says: the collection, the filter that settles it (cut to
    ``DATA_FILTER_SHOWN`` characters), its step, its deadline."""
    import json

    shown = json.dumps(bson_json(data.filter), default=str)
    if len(shown) > DATA_FILTER_SHOWN:
        shown = shown[: DATA_FILTER_SHOWN - 1] + "…"
    return f"waiting until `{data.collection}` holds `{shown}` ({step}), {deadline(until, now)}"


def _children(task: Task, step: str) -> str:
    """What a parent waiting for its children says: how many finished."""
    spawned = task.spawned
    if spawned is None:
        return f"waiting for its children ({step}), holding no slot"
    failed = f", {spawned.failed} failed" if spawned.failed else ""
    return (
        f"waiting for its children: {spawned.done} of {plural(spawned.total, 'child', 'children')} "
        f"finished{failed} ({step}), holding no slot"
    )


def _available(task: Task, due: dt.datetime, cluster: Cluster) -> Explained:
    since = f"due since {when(due)} ({relative(due, cluster.now)})"
    if task.status is None:
        return Explained(
            State.AVAILABLE,
            "incomplete",
            f"{since}: published without a status, so the first worker that meets it completes "
            "it, then claims it",
        )
    handlers = [w for w in cluster.workers or () if task.name in w.names]
    if not handlers:
        return Explained(State.AVAILABLE, None, f"{since}: the next free worker claims it")
    return Explained(
        State.AVAILABLE,
        None,
        f"{since}: the next free worker of `{task.name}` claims it "
        f"({plural(len(handlers), 'live worker')} handle{'s' if len(handlers) == 1 else ''} it)",
    )


# -- blocked ------------------------------------------------------------------------------------


def _blocked(task: Task, cluster: Cluster) -> Explained | None:
    """Why a due task is not claimed, if something keeps it: its name paused, no live worker
    for it, its group, its name's limit — the first that applies."""
    name = task.name
    if name is None:
        return None
    if name in cluster.paused:
        return Explained(
            State.BLOCKED,
            "paused",
            f"`{name}` is paused: no worker claims it until it is resumed (mtask resume {name})",
        )
    missing = _no_worker(task, name, cluster)
    if missing is not None:
        return Explained(State.BLOCKED, "no_worker", missing)
    unopened = not_decrypted(task)
    if unopened is not None:
        return Explained(
            State.BLOCKED,
            "no_key",
            f"given back, no retry spent: {unopened}; it waits for a worker of `{name}` that "
            "holds the encryption key (one that cannot decrypt it does not claim it again)",
        )
    group = task.options.group
    facts = cluster.groups.get((name, group)) if group is not None else None
    if group is not None and facts is not None:
        held = _group(task, name, group, facts, cluster)
        if held is not None:
            return Explained(State.BLOCKED, "group", held)
    doc = cluster.limits.get(name)
    held = _held(doc, name, group, cluster.now) if doc is not None else None
    if held is not None:
        return Explained(State.BLOCKED, "backoff", held)
    full = _full(doc, cluster.now) if doc is not None else None
    if full is not None:
        return Explained(State.BLOCKED, "limit", f"limit of `{name}`: {full}")
    return _resource(name, cluster)


def _resource(name: str, cluster: Cluster) -> Explained | None:
    """A shared resource the task's name takes, holding it back: a back-off, or its limit."""
    from mtask.limits.holds import held_until

    for slot in cluster.resources.get(name, ()):
        doc = cluster.limits.get(slot)
        if doc is None:
            continue
        resource = f"resource `{resource_of(slot)}`, which `{name}` uses,"
        until = held_until(doc, None, cluster.now)
        if until is not None:
            left = span((until - cluster.now).total_seconds())
            said = f"{resource} backs off (a handler's BackOff) for {left} more"
            return Explained(State.BLOCKED, "backoff", said)
        full = _full(doc, cluster.now)
        if full is not None:
            return Explained(State.BLOCKED, "limit", f"{resource} is full: {full}")
        window = measured.current(doc, cluster.now)
        if window is not None and window.full:
            said = f"{resource} has spent its tokens: {window.describe()}"
            return Explained(State.BLOCKED, "limit", said)
    return None


def _held(doc: Mapping[str, Any], name: str, group: str | None, now: dt.datetime) -> str | None:
    """A back-off holding the task back (``mtask.limits.holds``), said with when it ends."""
    from mtask.limits.holds import held_until

    until = held_until(doc, group, now)
    if until is None:
        return None
    whose = f"`{name}`" if held_until(doc, None, now) == until else f"group `{group}` of `{name}`"
    return f"{whose} backs off (a handler's BackOff) for {span((until - now).total_seconds())} more"


def _no_worker(task: Task, name: str, cluster: Cluster) -> str | None:
    if cluster.workers is None:
        return None
    handlers = [w for w in cluster.workers if name in w.names]
    if not handlers:
        return f"no live worker handles `{name}`"
    only = task.options.specific_worker_ids
    if only and not any(w.id in only for w in handlers):
        named = ", ".join(f"`{w}`" for w in only[:3]) + (" …" if len(only) > 3 else "")
        return f"it may run only on {named}: none of them is a live worker of `{name}`"
    return None


def _group(task: Task, name: str, group: str, facts: Group, cluster: Cluster) -> str | None:
    if facts.sequence:
        return _sequence(task, group, facts, cluster)
    if facts.slot is None:
        return None
    # the slot holds the group's limit as of its last take; the name's current one decides
    slot = {**facts.slot, "concurrency": facts.limit.concurrency, "rate": facts.limit.rate}
    full = _full(slot, cluster.now)
    return None if full is None else f"waiting for group `{group}` of `{name}`: {full}"


def _sequence(task: Task, group: str, facts: Group, cluster: Cluster) -> str | None:
    ahead = facts.ahead.get(task.key)
    behind = "" if ahead is None else f"; {ahead} ahead of this one" if ahead else "; next in line"
    holder = facts.holder
    if holder is not None and holder.key != task.key:
        doing = _doing(holder, cluster)
        return f"waiting for group `{group}` (sequence): `{holder.key}` holds it, {doing}{behind}"
    if holder is None and facts.first is not None and facts.first != task.key:
        return (
            f"waiting for group `{group}` (sequence): `{facts.first}` goes first (published "
            f"earlier){behind}"
        )
    return None


def _doing(holder: Task, cluster: Cluster) -> str:
    """What a sequence's lock holder does, said short: ``running 21 s on host-3``."""
    said = explain(holder, Cluster(cluster.now, cluster.paused, cluster.workers, cluster.limits))
    if said.state is State.RUNNING and said.why is None:
        run = [r for r in holder.runs if r.state is RunState.RUNNING][-1]
        host = cluster.host_of(run.worker_id) or f"`{run.worker_id}`"
        return f"running {span((cluster.now - run.claimed_at).total_seconds())} on {host}"
    return f"{said.state.value}: {said.reason}"


def _full(doc: Mapping[str, Any], now: dt.datetime) -> str | None:
    """What a limit's document keeps from a run now (its runs at once in use, or no token for
    its rate), or ``None`` if it has room (``mtask.limits.rules``' rules, read as the take reads
    them)."""
    concurrency = runs_at_once(doc.get("concurrency"))
    holders = doc.get("holders")
    live = [
        h
        for h in (holders if isinstance(holders, list) else ())
        if isinstance(h, dict) and isinstance(h.get("expires"), dt.datetime) and h["expires"] > now
    ]
    used = sum(u if isinstance(u := h.get("units"), int) and u > 0 else 1 for h in live)
    if concurrency is not None and used >= concurrency:
        return f"{used} of {concurrency} runs at once in use"
    rate = doc.get("rate")
    if not isinstance(rate, int | float) or isinstance(rate, bool) or rate <= 0:
        return None
    refilled, tokens = doc.get("refilled_at"), doc.get("tokens")
    if not isinstance(refilled, dt.datetime) or not isinstance(tokens, int | float):
        return None
    burst = doc.get("burst")
    size = float(burst) if isinstance(burst, int | float) and not isinstance(burst, bool) else 1.0
    have = refill(float(tokens), refilled, now, float(rate), size)
    if have >= 1:
        return None
    return f"{rate:g} per second, the next in {span(wait_for_token(have, float(rate)))}"


HELD = frozenset({"backoff", "limit", "group"})
"""The reasons a due task is held back by something that ends by time alone."""


def held_ends(task: Task, cluster: Cluster) -> dt.datetime | None:
    """The soonest time after ``cluster.now`` at which what holds a due ``task`` back (a
    back-off, a full limit or token window of its name, its group or a shared resource it
    takes) ends, as ``explain`` reads it; ``None`` if ``explain`` does not say it is held so,
    or nothing of it ends by time."""
    said = explain(task, cluster)
    if said.state is not State.BLOCKED or said.why not in HELD or task.name is None:
        return None
    group = task.options.group
    facts = cluster.groups.get((task.name, group)) if group is not None else None
    docs = [cluster.limits.get(task.name)]
    docs += [cluster.limits.get(s) for s in cluster.resources.get(task.name, ())]
    ends = [end for doc in docs if doc is not None for end in doc_ends(doc, group, cluster.now)]
    if facts is not None and facts.slot is not None:
        ends += doc_ends(facts.slot, None, cluster.now)
    return min(ends, default=None)


def doc_ends(doc: Mapping[str, Any], group: str | None, now: dt.datetime) -> list[dt.datetime]:
    """The future times at which a limit document (a name's, a group's, a resource's) could
    stop holding a task (of ``group``) back: its hold's end, its live holders' expiries, its
    bucket's next token, its full token window's end."""
    from mtask.limits.holds import held_until

    ends = [at for at in (held_until(doc, group, now),) if at is not None]
    holders = doc.get("holders")
    ends += [
        h["expires"]
        for h in (holders if isinstance(holders, list) else ())
        if isinstance(h, dict) and isinstance(h.get("expires"), dt.datetime) and h["expires"] > now
    ]
    rate, refilled, tokens = doc.get("rate"), doc.get("refilled_at"), doc.get("tokens")
    if (
        isinstance(rate, int | float)
        and not isinstance(rate, bool)
        and rate > 0
        and isinstance(refilled, dt.datetime)
        and isinstance(tokens, int | float)
    ):
        burst = doc.get("burst")
        size = float(burst) if isinstance(burst, int | float) and not isinstance(burst, bool) else 1
        wait = wait_for_token(refill(float(tokens), refilled, now, float(rate), size), float(rate))
        if wait > 0:
            ends.append(now + dt.timedelta(seconds=wait))
    window = measured.current(doc, now)
    if window is not None and window.full:
        ends.append(window.end)
    return ends


# -- the words the pages share -----------------------------------------------------------------


def label(state: str, why: str | None) -> str:
    """A derived state with its reason's kind, as every reader shows it (``mtask get``,
    ``list``, ``flow``, the dashboard): ``blocked · backoff``, ``waiting · children``,
    ``running · lease ended``. A retrying task's ``backoff`` (the wait before its next try) is
    what retrying means: plain ``retrying``."""
    if not why or (state == State.RETRYING and why == "backoff"):
        return str(state)
    return f"{state} · {why.replace('_', ' ')}"


def timing(task: Task, said: Explained) -> tuple[str, dt.datetime | None] | None:
    """The time that matters next for a task in its state, and what it is called: ``runs`` (a
    scheduled task), ``next try`` (retrying), ``times out`` (a signal wait; ``None``: no
    deadline), ``wakes`` (a sleep), ``due`` (available or blocked), ``lease until`` (running)."""
    state, w = said.state, task.waiting
    if state is State.WAITING and said.why == "snoozed":
        return "wakes", task.next_claim_at
    if state is State.WAITING and w is not None:
        until = None if w.until.year >= NEVER.year else w.until
        waits = w.signal is not None or w.children is not None
        return ("times out", until) if waits else ("wakes", until)
    labels = {
        State.SCHEDULED: "runs",
        State.RETRYING: "next try",
        State.AVAILABLE: "due",
        State.BLOCKED: "due",
    }
    if state in labels and task.next_claim_at is not None:
        return labels[state], task.next_claim_at
    runs = [r for r in task.runs if r.state is RunState.RUNNING]
    if state is State.RUNNING and runs:
        return "lease until", runs[-1].lease_expires_at
    return None


def attempt_of(task: Task) -> tuple[int, int | None]:
    """``(n, max)``: which try of its retry budget the task is on (or ended on), and how many
    it has (``max_retries + 1``; ``None`` if unknown). ``n`` counts failed tries, not runs: a
    run that ended waiting (a sleep, a signal) or was released takes no try."""
    failures = task.failures or 0
    retries = task.options.max_retries
    total = None if retries is None else retries + 1
    n = (
        failures
        if task.status is TaskStatus.FAILED and not task.failed_permanently
        else failures + 1
    )
    if total is not None:
        n = min(n, total)
    return max(n, 1), total


def attempt_text(task: Task) -> str:
    n, total = attempt_of(task)
    return f"attempt {n}" + (f" of {total}" if total is not None else "")


def retried(task: Task) -> bool:
    """Whether a run of the task failed and it waits for its retry."""
    ended = [r for r in task.runs if r.state is not RunState.RUNNING]
    last = ended[-1].state if ended else None
    return (task.failures or 0) > 0 or last in (RunState.FAIL, RunState.TIMEOUT)


def _last_error(task: Task) -> str | None:
    return next((r.error for r in reversed(task.runs) if r.error), None)


def last_line(text: str | None) -> str:
    """An error's last line: ``RuntimeError: upstream 503`` of a whole traceback."""
    lines = (text or "").strip().splitlines()
    return lines[-1].strip() if lines else ""


def deadline(until: dt.datetime | None, now: dt.datetime) -> str:
    """A wait's deadline as a sentence says it: ``times out at … (in 59 min)``, or ``no
    deadline`` for a wait without a timeout."""
    if until is None or until.year >= NEVER.year:
        return "no deadline"
    return f"times out at {when(until)} ({relative(until, now)})"
