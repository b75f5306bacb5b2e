"""The kinds of step that may end the run WAITING (``Suspended``) and resume it on the server's
clock: a ``sleep`` recorded with its ``until`` is over once the clock passes it; a ``wait_for``
once its signal is there (the k-th wait for a signal name takes the k-th signal of that name)
or its timeout passed (``SignalTimeout``, recorded, so a replay raises it again); a
``wait_until`` once a ``find`` with its predicate returns the document (MongoDB decides, at
the wait and at each wake-up) or its timeout passed (``ConditionTimeout``, recorded likewise);
its predicate names the documents whose change may settle it (``wait_ids``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import bson

from mtask.errors import MtaskError
from mtask.steps.journal import Journal
from mtask.steps.plan import Io, Plan
from mtask.steps.rules import (
    NEVER,
    ConditionTimeout,
    Doc,
    SignalTimeout,
    StepError,
    aware,
    check_signal_name,
)
from mtask.triggers import check_collection

MAX_WAIT_IDS = 1000
"""The most documents one ``wait_until`` may name (``_id``, or ``_id: {$in: [...]}``)."""
REFUSED_OPERATORS = ("$where", "$text", "$near", "$nearSphere")
"""Top-level operators a predicate may not use: aggregation's ``$match`` (the wake-up's check)
refuses them."""


def wait_ids(predicate: Any) -> list[Any]:
    """The ``_id`` values a ``wait_until`` predicate names: its ``_id`` is a value, or
    ``{"$eq": value}``, or ``{"$in": [values]}`` (at most ``MAX_WAIT_IDS``). A change to one of
    these documents is what may settle the wait; the tasks are found by them (an index)."""
    if not isinstance(predicate, Mapping):
        raise StepError("a wait's predicate is a find filter (a mapping)")
    for op in REFUSED_OPERATORS:
        if op in predicate:
            raise StepError(f"a wait's predicate cannot use {op}")
    try:
        bson.encode(dict(predicate))
    except Exception as exc:  # noqa: BLE001 - any encoding problem is the handler's
        raise StepError(f"a wait's predicate must be BSON: {exc}") from None
    if "_id" not in predicate:
        raise StepError(
            "a wait's predicate names the document's _id (a value, $eq or $in): a change to "
            "that document is what wakes the task"
        )
    return _id_values(predicate["_id"])


def _id_values(value: Any) -> list[Any]:
    """The ``_id``s a predicate's ``_id`` condition names (a value, ``$eq`` or ``$in``)."""
    if not (isinstance(value, Mapping) and value and all(str(k).startswith("$") for k in value)):
        if isinstance(value, list):
            raise StepError("an _id is never an array")
        return [value]
    if set(value) == {"$eq"}:
        return [value["$eq"]]
    if set(value) == {"$in"} and isinstance(value["$in"], list | tuple):
        ids = list(value["$in"])
        if not ids or len(ids) > MAX_WAIT_IDS:
            raise StepError(f"_id: {{$in: [...]}} names 1 to {MAX_WAIT_IDS} documents")
        return ids
    raise StepError("a wait's predicate names its _id with a value, $eq or $in")


@dataclass(frozen=True)
class Wait:
    """Why a run ends waiting: its step's place, the entry to record there (``None``: recorded
    by an earlier run), and until when (a sleep), or for which signal (its ``nth`` of that name)
    with a deadline (``NEVER`` without a timeout), or for which document's state (``data``:
    ``collection``, ``ids``, ``filter``)."""

    index: int
    entry: Doc | None
    until: dt.datetime
    signal: str | None = None
    nth: int = 0
    data: Doc | None = None
    children: str | None = None
    """The step whose spawned children it waits for (``mtask.steps.children``)."""
    renew: Doc | None = None
    """Not a wait: the run continues as new (``ctx.continue_as_new``): ``params``, the task's
    new params, and ``taken``, how many signals of each name its journal's waits took
    (``[{name, n}]``: those go with the journal, the others stay for the next one)."""

    def to_document(self) -> Doc:
        step = self.entry["name"] if self.entry else None
        doc: Doc = {"until": self.until, "index": self.index}
        if step is not None:
            doc["step"] = step
        if self.signal is not None:
            doc["signal"] = self.signal
            doc["nth"] = self.nth
        if self.data is not None:
            doc["data"] = dict(self.data)
        if self.children is not None:
            doc["step"] = self.children
            doc["children"] = self.children
        return doc


class Suspended(BaseException):
    """Raised by ``sleep`` and ``wait_for`` to end the run as WAITING (a ``BaseException``, so
    a handler's ``except Exception`` does not swallow it): the worker records the wait and
    frees the slot; the task is claimed again when the sleep ends or the signal comes."""

    def __init__(self, wait: Wait) -> None:
        super().__init__(f"waiting until {wait.until.isoformat()}")
        self.wait = wait


class Waits:
    """A run's sleeps and waits, recorded in ``journal``."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    def renewal(self, params: Any) -> Wait:
        """What ends a run that continues as new with ``params`` (``ctx.continue_as_new``): the
        task starts afresh, a new journal (docs/steps.md, "Loops without end")."""
        journal = self.journal
        if journal.inside is not None or journal.group() is not None:
            raise StepError("continue_as_new is called by the handler, not in a step or a gather")
        if not isinstance(params, Mapping):
            raise StepError(f"continue_as_new takes the new params (a mapping), not {params!r}")
        try:
            bson.encode(dict(params))
        except Exception as exc:  # noqa: BLE001 - any encoding problem is the handler's
            raise StepError(f"continue_as_new: the params must be BSON: {exc}") from None
        taken: dict[str, int] = {}
        for entry in journal.recorded:
            signal, nth = entry.get("signal"), entry.get("nth")
            if entry.get("kind") == "signal" and isinstance(signal, str) and isinstance(nth, int):
                taken[signal] = max(taken.get(signal, 0), nth + 1)
        renew = {"params": dict(params), "taken": [{"name": k, "n": n} for k, n in taken.items()]}
        return Wait(len(journal.recorded), None, NEVER, renew=renew)

    def sleep(self, duration: float | dt.timedelta | dt.datetime, name: str | None) -> Plan[None]:
        journal = self.journal
        n = journal.count("sleep")
        step = name if name is not None else f"sleep#{n}"
        index, prior = journal.begin(step, "sleep")
        now = journal.store.now()
        if prior is not None and prior.get("state") == "done":
            return
        if prior is not None and isinstance(prior.get("until"), dt.datetime):
            until = aware(prior["until"])
        else:
            until = _until(duration, now)
        entry = journal.entry(step, "sleep", prior, now)
        if now >= until:
            entry["state"] = "done"
            entry["until"] = until
            journal.tried(entry, now, 0)
            yield from journal.write(index, entry, prior)
            return
        entry.update(state="waiting", until=until)
        raise Suspended(Wait(index, None if prior is not None else entry, until))

    def _recorded(self, prior: Doc | None, timed_out: SignalTimeout) -> Plan[tuple[bool, Any]]:
        """A wait an earlier run recorded as over: ``(True, its result)`` if done; ``timed_out``
        raised again if it timed out (a replay takes the same path); else ``(False, None)``."""
        if prior is not None and prior.get("state") == "done":
            value = yield from self.journal.read(prior)
            return True, value
        if prior is not None and prior.get("state") == "timed_out":
            raise timed_out
        return False, None

    def wait_for(
        self, signal: str, timeout: float | dt.timedelta | None, name: str | None
    ) -> Plan[Any]:
        journal = self.journal
        check_signal_name(signal)
        nth = journal.count(f"signal:{signal}") - 1
        step = name if name is not None else (f"wait:{signal}" + (f"#{nth + 1}" if nth else ""))
        index, prior = journal.begin(step, "signal")
        timed_out = SignalTimeout(f"no signal {signal!r} came before the timeout (recorded)")
        over, value = yield from self._recorded(prior, timed_out)
        if over:
            return value
        now = journal.store.now()
        entry = journal.entry(step, "signal", prior, now)
        entry.update(signal=signal, nth=nth)
        came = yield Io(lambda: journal.store.signals(signal))
        if len(came) > nth:
            payload = came[nth].get("payload")
            entry["state"] = "done"
            journal.tried(entry, now, 0)
            yield from journal.put_result(entry, payload)
            yield from journal.write(index, entry, prior)
            return payload
        until = _deadline(prior, timeout, now)
        if now >= until:
            entry.update(state="timed_out", until=until)
            journal.tried(entry, now, 0, "timed out")
            yield from journal.write(index, entry, prior)
            raise SignalTimeout(f"no signal {signal!r} came before {until.isoformat()}")
        entry.update(state="waiting", until=until)
        raise Suspended(Wait(index, None if prior is not None else entry, until, signal, nth))

    def wait_until(
        self,
        collection: str,
        predicate: Mapping[str, Any],
        timeout: float | dt.timedelta | None,
        name: str | None,
    ) -> Plan[Any]:
        journal = self.journal
        try:
            check_collection(collection)
        except MtaskError as exc:
            raise StepError(f"wait_until: {exc}") from None
        filt: Doc = dict(predicate)
        data: Doc = {"collection": collection, "ids": wait_ids(predicate), "filter": filt}
        nth = journal.count(f"until:{collection}") - 1
        step = name if name is not None else f"until:{collection}" + (f"#{nth + 1}" if nth else "")
        index, prior = journal.begin(step, "data")
        timed_out = ConditionTimeout(f"{collection} did not reach the state in time (recorded)")
        over, value = yield from self._recorded(prior, timed_out)
        if over:
            return value
        now = journal.store.now()
        entry = journal.entry(step, "data", prior, now)
        entry["collection"] = collection
        until = _deadline(prior, timeout, now)
        wait = Wait(index, None if prior is not None else entry, until, data=data)
        found = yield Io(lambda: journal.store.holds(collection, filt, None))
        if found is None and now < until:  # announced, then looked at again: no change is lost
            announce = wait.to_document()
            found = yield Io(lambda: journal.store.holds(collection, filt, announce))
        value = yield from self._settled(wait, entry, prior, now, found)
        return value

    def _settled(
        self, wait: Wait, entry: Doc, prior: Doc | None, now: dt.datetime, found: Doc | None
    ) -> Plan[Any]:
        """A data wait after its look: done with the document found, timed out, or waiting."""
        journal = self.journal
        collection = entry["collection"]
        if found is not None:
            entry["state"] = "done"
            journal.tried(entry, now, 0)
            yield from journal.put_result(entry, found)
            yield from journal.write(wait.index, entry, prior)
            return found
        if now >= wait.until:
            entry.update(state="timed_out", until=wait.until)
            journal.tried(entry, now, 0, "timed out")
            yield from journal.write(wait.index, entry, prior)
            raise ConditionTimeout(
                f"{collection} did not reach the state by {wait.until.isoformat()}"
            )
        entry.update(state="waiting", until=wait.until)
        raise Suspended(wait)


def _deadline(
    prior: Doc | None, timeout: float | dt.timedelta | None, now: dt.datetime
) -> dt.datetime:
    """A wait's deadline: the one an earlier run recorded, else ``timeout`` from ``now`` (the
    server's clock), else ``NEVER``."""
    if prior is not None and isinstance(prior.get("until"), dt.datetime):
        return aware(prior["until"])
    return NEVER if timeout is None else _until(timeout, now)


def _until(duration: float | dt.timedelta | dt.datetime, now: dt.datetime) -> dt.datetime:
    if isinstance(duration, dt.datetime):
        if duration.tzinfo is None:
            raise StepError("a time to sleep until must be timezone-aware")
        return duration
    seconds = duration.total_seconds() if isinstance(duration, dt.timedelta) else duration
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise StepError("a duration is a number of seconds (or a timedelta), not negative")
    if seconds > 366 * 86400 * 100:
        raise StepError("a duration of at most 100 years")
    return now + dt.timedelta(seconds=seconds)
