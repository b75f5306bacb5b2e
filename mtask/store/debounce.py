"""Debounce: publishes of one key within a quiet period collapse into one run that
starts that long after the last of them, and never later than a maximum after the first.

A debounced publish (``publish(name, key, params, debounce=5, debounce_max=60)``) looks for
the key's open *window*: the task of that name whose ``debounce.key`` is the key, still
``pending`` and never claimed (``attempts: 0``). The unique partial index ``debounce`` on
``(name, debounce.key)`` holds exactly those, so a key has at most one open window. Found, one
``findAndModify`` collapses the publish into it, on the server's time the caller took: the new
params replace the old (the last publish wins), ``available_at`` becomes ``min(now + quiet,
debounce.max_at)``, ``debounce.count`` and ``debounce.last_at`` move on. Not found (no window
yet, or its task was claimed: a run started, so later publishes need a run of their own), a new
task is inserted, keyed ``<key>~<the window's first publish, UTC ms>``, due after the quiet
period. Two publishers opening a window at once are decided by the index: the one refused
collapses into the other's window. A claim and a collapse are both atomic writes on the same
document: if the claim wins, the collapse matches nothing and opens a new window; if the
collapse wins, the task is no longer due and the claim's filter refuses it.

A claim takes the task out of the index (``attempts`` 1), a retry never puts it back: so no
write of the worker's can collide on it. A publish without ``debounce`` pays nothing for this.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pymongo import ReturnDocument
from pymongo.errors import DuplicateKeyError

from mtask.driver import Call, Doc, Op
from mtask.errors import InvalidTask, StorageError
from mtask.statemachine import recompute_stages
from mtask.store.retention import resolve
from mtask.store.schema import literal, new_document
from mtask.vocabulary import MAX_KEY_LENGTH, TaskStatus, delay_ms

if TYPE_CHECKING:
    from mtask.models import NewTask

FIELD = "debounce"
INDEX = "debounce"
SEPARATOR = "~"
STAMP_LENGTH = len("~YYYY-MM-DDTHH:MM:SS.mmmZ")
MAX_DEBOUNCED_KEY = MAX_KEY_LENGTH - STAMP_LENGTH
"""A debounced key and its window's stamp make the task's key, at most ``MAX_KEY_LENGTH``."""
MAX_ROUNDS = 100


@dataclass(frozen=True)
class Quiet:
    """A debounce: ``quiet_ms`` after the last publish, at most ``max_ms`` after the first
    (``None``: no maximum)."""

    quiet_ms: int
    max_ms: int | None = None

    @classmethod
    def build(cls, debounce: object, debounce_max: object = None) -> Quiet:
        """Seconds (numbers or timedeltas, up to 30 days) checked; ``InvalidTask`` naming the
        bad one. ``debounce_max`` must not be shorter than ``debounce``."""
        quiet = _ms(debounce, "debounce")
        most = None if debounce_max is None else _ms(debounce_max, "debounce_max")
        if most is not None and most < quiet:
            raise InvalidTask("must not be shorter than debounce", field="debounce_max")
        return cls(quiet, most)


def _ms(value: object, field: str) -> int:
    ms = delay_ms(value)
    if ms is None:
        raise InvalidTask(
            f"must be a number of seconds from 0 to 30 days, not {value!r}", field=field
        )
    return ms


def window_key(key: str, first_at: dt.datetime) -> str:
    """The key of the task of ``key``'s window opened at ``first_at``."""
    stamp = first_at.astimezone(dt.UTC).isoformat(timespec="milliseconds")
    return f"{key}{SEPARATOR}{stamp.replace('+00:00', 'Z')}"


def check_key(key: str) -> None:
    if len(key) > MAX_DEBOUNCED_KEY:
        raise InvalidTask(
            f"is {len(key)} characters; a debounced key is at most {MAX_DEBOUNCED_KEY} (the "
            f"task's key is '<key>{SEPARATOR}<first publish>', at most {MAX_KEY_LENGTH})",
            field="key",
        )


def open_filter(name: str, key: str) -> Doc:
    """The key's open window: pending, never claimed (what the ``debounce`` index holds)."""
    return {
        "name": name,
        f"{FIELD}.key": key,
        "status": TaskStatus.PENDING.value,
        "attempts": 0,
    }


def collapse_pipeline(params: Mapping[str, object], quiet: Quiet, now: dt.datetime) -> list[Doc]:
    """The update that collapses a publish into its window: the last params win, due
    ``quiet`` after ``now`` but not after the window's ``max_at`` (``$min`` passes over a
    missing one)."""
    due = {"$min": [now + dt.timedelta(milliseconds=quiet.quiet_ms), f"${FIELD}.max_at"]}
    return [
        {
            "$set": {
                "params": literal(dict(params)),
                "available_at": due,
                "updated_at": now,
                f"{FIELD}.count": {"$add": [{"$ifNull": [f"${FIELD}.count", 1]}, 1]},
                f"{FIELD}.last_at": now,
            }
        },
        *recompute_stages(now),
    ]


def window_document(task: NewTask, quiet: Quiet, now: dt.datetime) -> Doc:
    """A new window's task document, due ``quiet`` from now (``max_at`` if that is sooner)."""
    doc = new_document(task.model_copy(update={"key": window_key(task.key, now)}), now)
    due = now + dt.timedelta(milliseconds=quiet.quiet_ms)
    window: Doc = {"key": task.key, "first_at": now, "last_at": now, "count": 1}
    if quiet.max_ms is not None:
        window["max_at"] = now + dt.timedelta(milliseconds=quiet.max_ms)
        due = min(due, window["max_at"])
    doc["available_at"] = doc["next_claim_at"] = due
    doc[FIELD] = window
    return doc


@dataclass(frozen=True)
class Debounced:
    """What a debounced publish did: ``created`` a new window's task, else ``document`` is the
    open window it collapsed into (its params now this publish's)."""

    created: bool
    document: Doc


def publish(
    task: NewTask,
    quiet: Quiet,
    now: dt.datetime,
    trace: dict[str, str] | None = None,
    retention: Mapping[str, Doc] | None = None,
) -> Op[Debounced]:
    """Collapse ``task`` into its key's open window, or open one (module doc)."""
    check_key(task.key)
    task = (yield from resolve([task], retention))[0]
    for _ in range(MAX_ROUNDS):
        found: Doc | None = yield Call(
            "find_one_and_update",
            (open_filter(task.name, task.key), collapse_pipeline(task.params, quiet, now)),
            {"return_document": ReturnDocument.AFTER},
        )
        if found is not None:
            return Debounced(False, found)
        doc = window_document(task, quiet, now)
        if trace:
            doc["trace"] = trace
        try:
            yield Call("insert_one", (doc,))
            return Debounced(True, doc)
        except DuplicateKeyError:  # another publisher opened the window first: collapse
            continue
    raise StorageError(f"debounce: no window for {task.key!r} after {MAX_ROUNDS} rounds")
