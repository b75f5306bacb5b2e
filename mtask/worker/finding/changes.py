"""Applying one task change event to a placement (hints: the claim decides).

The stream carries no looked-up documents: an insert or a replace has its document, an update
only the new ``next_claim_at``, which is enough for a task already known; an unknown one is
looked up (``Scanner.unknown``). A key that is not a string is never queued: its document is
noted for quarantine. Applying is supervised: an error is about that one document (any service
may write any shape), so it is logged with the key, the document noted, and the worker goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from mtask.limits.rules import LIMIT_FIELDS, is_group_slot
from mtask.worker.finding.placement import TaskMeta
from mtask.worker.finding.scan import Scanner
from mtask.worker.finding.setaside import count, task_key

log = logging.getLogger(__name__)


def event_key(change: Mapping[str, Any]) -> Any:
    """The document key of a change event of any shape, or ``None``."""
    key = change.get("documentKey")
    return key.get("_id") if isinstance(key, Mapping) else None


def updated_fields(change: Mapping[str, Any]) -> Mapping[str, Any]:
    """The fields an update's event says were set (none for any other event or shape)."""
    update = change.get("updateDescription")
    fields = update.get("updatedFields") if isinstance(update, Mapping) else None
    return fields if isinstance(fields, Mapping) else {}


def lock_freed(change: Mapping[str, Any], meta: TaskMeta | None) -> tuple[str, str] | None:
    """The ``(name, group)`` of a grouped task whose run this event ended for good (it has no
    next claim time: finished, or waiting for its dependencies): its sequence's lock
    (``limits.claim_lock``) may be free."""
    group = None if meta is None else meta.group
    if not (isinstance(group, tuple) and len(group) == 2):
        return None
    name, of = group
    fields = updated_fields(change)
    if change.get("operationType") != "update" or fields.get("next_claim_at", 0) is not None:
        return None
    return (name, of) if isinstance(name, str) and isinstance(of, str) else None


def limit_set(change: Mapping[str, Any]) -> str | None:
    """The name whose limit this event of the ``limits`` collection set, changed or cleared:
    an insert, a replace or a delete of a name's document, or an update that names one of its
    limit's fields (``limits.LIMIT_FIELDS``). ``None`` for a slot taken, given back or pinged,
    and for a group's document."""
    key = event_key(change)
    if not isinstance(key, str) or is_group_slot(key):  # a resource's is as a name's
        return None
    if change.get("operationType") in ("insert", "replace", "delete"):
        return key
    fields = updated_fields(change)
    return key if any(f in fields for f in LIMIT_FIELDS) else None


def apply_task_change(scanner: Scanner, change: Mapping[str, Any]) -> None:
    """Apply one task event to ``scanner``'s placement, supervised."""
    try:
        _apply(scanner, change)
    except Exception:
        key = event_key(change)
        log.exception("could not apply a change event for task %r; marking it invalid", key)
        count("event")
        if key is not None:
            scanner.malformed.add(key)


def _apply(scanner: Scanner, change: Mapping[str, Any]) -> None:
    placement = scanner.placement
    raw = event_key(change)
    if raw is None:
        return
    key = task_key(raw)
    if key is None:
        if change.get("operationType") != "delete":
            scanner.malformed.add(raw)
        return
    doc = change.get("fullDocument")
    fields = updated_fields(change)
    if doc is None and change.get("operationType") == "update" and "next_claim_at" not in fields:
        return  # another worker's claim or success that left its place as it was
    scanner.touch(key)
    if doc is not None:
        scanner.place_safely(doc)
    elif change.get("operationType") != "update":
        placement.forget(key)  # a delete (a replace carries its document)
    else:
        claim_at = fields["next_claim_at"]
        if key in placement.meta:
            placement.move(key, claim_at, fields.get("available_at"))
        elif claim_at is None:
            placement.forget(key)
        elif not placement.in_flight(key):
            scanner.unknown.add(key)
