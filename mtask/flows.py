"""Flows: next steps returned by a handler, and tasks that wait for other tasks.

**Next steps.** A handler returns ``Next(name, params)`` (or a list of them). The worker writes
the steps into the task's ``outbox`` in the same fenced update that records the run's SUCCESS,
so they exist exactly when the success does; then it publishes them (idempotent upserts, keys
derived from the parent key and the step) and clears the outbox. A crash in between leaves the
outbox, which any worker's flow sweep publishes later: no step lost, none published twice.

**Dependencies.** A task published with ``depends_on=[keys]`` carries ``waiting_on`` (the keys
not yet succeeded) and no ``next_claim_at``, so no claim can match it. When a dependency
finishes, ``resolve`` removes it from its dependents' ``waiting_on`` (succeeded) or fails them
(failed, cancelled or invalid for good); the last removal makes the task claimable. Who calls
``resolve``: the publisher right after inserting (the dependency may have finished already),
the worker that recorded a dependency's outcome (it knows from the claim that the task has
dependents), and the flow sweep (for the remaining races).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pymongo import UpdateOne

from mtask.driver import Doc
from mtask.errors import InvalidTask
from mtask.vocabulary import MAX_KEY_LENGTH, TaskStatus

if TYPE_CHECKING:
    from mtask.models import NewTask

FAILED_FOR_GOOD = (TaskStatus.FAILED.value, TaskStatus.CANCELLED.value, TaskStatus.INVALID.value)
MAX_TREE_NODES = 10_000

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Next:
    """A next step: returned by a handler, published once the run's SUCCESS is recorded.
    Without ``key``, its key is derived from the parent's key and the step's name."""

    name: str
    params: Mapping[str, Any] | None = None
    key: str | None = None
    options: Mapping[str, Any] | None = None
    depends_on: Sequence[str] = field(default_factory=tuple)


def is_steps(result: Any) -> bool:
    if isinstance(result, Next):
        return True
    return (
        isinstance(result, list | tuple)
        and bool(result)
        and all(isinstance(r, Next) for r in result)
    )


def child_key(parent: str, name: str, ordinal: int | None) -> str:
    """``parent/name`` (``parent/name.2`` for the third step of one name); hashed when that
    would be longer than a key may be."""
    key = f"{parent}/{name}" if ordinal is None else f"{parent}/{name}.{ordinal}"
    if len(key) > MAX_KEY_LENGTH:
        key = f"{parent[:64]}/…{hashlib.sha256(key.encode()).hexdigest()}"
    return key


def build_steps(parent: str, result: Any, max_params_bytes: int) -> list[NewTask]:
    """Validate the steps a handler returned (``InvalidTask`` names the bad one)."""
    from mtask.models import NewTask

    steps = [result] if isinstance(result, Next) else list(result)
    names = [s.name for s in steps]
    seen: dict[str, int] = {}
    built = []
    for step in steps:
        ordinal = seen.get(step.name, 0)
        seen[step.name] = ordinal + 1
        key = step.key or child_key(
            parent, step.name, ordinal if names.count(step.name) > 1 else None
        )
        built.append(
            NewTask.build(
                step.name,
                key,
                dict(step.params or {}),
                dict(step.options) if step.options is not None else None,
                max_params_bytes=max_params_bytes,
                depends_on=list(step.depends_on) or None,
                parent=parent,
            )
        )
    return built


def outbox_entry(task: NewTask) -> Doc:
    return {
        "name": task.name,
        "key": task.key,
        "params": task.params,
        "options": task.options.to_document(),
        "depends_on": list(task.depends_on),
    }


def from_outbox(parent: object, entry: object) -> NewTask:
    """The step an outbox entry describes; ``InvalidTask`` says what is wrong with it."""
    from mtask.models import NewTask

    if not isinstance(parent, str):
        raise InvalidTask(f"must be a string, not {type(parent).__name__}", field="parent key")
    if not isinstance(entry, Mapping):
        raise InvalidTask(f"must be an object, not {type(entry).__name__}", field="step")
    return NewTask.build(
        entry.get("name"),
        entry.get("key"),
        entry.get("params"),
        entry.get("options"),
        max_params_bytes=2**31,
        depends_on=entry.get("depends_on") or None,
        parent=parent,
    )


def read_outbox(parent: object, outbox: object) -> tuple[list[NewTask], list[Doc]]:
    """The steps a task's ``outbox`` holds, and the entries no step can be built from (a hand
    edit, another version's shape), each as ``{"entry": ..., "reason": ...}``. Never raises,
    whatever the document holds."""
    if outbox is None:
        return [], []
    if not isinstance(outbox, list):
        reason = f"outbox: must be a list of steps, not {type(outbox).__name__}"
        return [], [{"entry": outbox, "reason": reason}]
    steps: list[NewTask] = []
    rejected: list[Doc] = []
    for index, entry in enumerate(outbox):
        try:
            steps.append(from_outbox(parent, entry))
        except InvalidTask as exc:
            rejected.append({"entry": entry, "reason": f"outbox[{index}]: {exc.message}"})
    return steps, rejected


def clear_outbox(key: Any, outbox: Any, rejected: Sequence[Doc]) -> UpdateOne:
    """Unset the ``outbox`` if it still holds what was read (``$eq``: a value, never an
    operator), moving the ``rejected`` entries to ``outbox_rejected``, where they are kept
    with the reason and no sweep meets them again."""
    filt = {"_id": key, "outbox": {"$eq": outbox}}
    if not rejected:
        return UpdateOne(filt, {"$unset": {"outbox": ""}})
    kept = {"$cond": [{"$isArray": "$outbox_rejected"}, "$outbox_rejected", []]}
    return UpdateOne(
        filt,
        [
            {"$set": {"outbox_rejected": {"$concatArrays": [kept, {"$literal": rejected}]}}},
            {"$unset": "outbox"},
        ],
    )


# ---------------------------------------------------------------------------------------------
# Operations
# ---------------------------------------------------------------------------------------------


def dependents_of(keys: Sequence[str], statuses: Sequence[str]) -> Doc:
    """The tasks with one of ``statuses`` that wait for one of ``keys``, in a ``waiting_on`` that
    is an array. A string ``waiting_on`` equal to a key matches ``$in`` too, and ``resolve``'s
    pipeline then fails on it, stopping its ``update_many`` before the well-formed dependents
    after it; such a document (open, no claim time, no dependency listed) is the sweep's
    stranded search's, which marks it invalid (``store.quarantine``)."""
    return {
        "waiting_on": {"$in": list(keys)},
        "status": {"$in": list(statuses)},
        "$expr": {"$isArray": "$waiting_on"},
    }


RELEASABLE = (TaskStatus.PENDING.value, TaskStatus.FAILED.value, TaskStatus.CANCELLED.value)
"""The dependents whose ``waiting_on`` a success shrinks: the waiting ones, and those failed or
cancelled meanwhile (it keeps naming what had not succeeded, and a retry finds it current).
Never an invalid one, nor one of another status: ``recompute_stages`` would derive a status
from the fields a worker judged malformed, reviving it."""
