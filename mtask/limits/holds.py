"""Back-off from inside a handler: ``raise mtask.BackOff(group=True, seconds=30)``
after an HTTP 429 holds the run's group (or its name, or a shared resource) for that long.

The run is released without spending a retry (RELEASED, as a run given back; its task due once
the hold ends), and no task of what it holds back is claimed until the hold ends: a **hold** is
a date in a limit document, which the slot's take reads on the server's clock, inside the same
atomic update that decides the limit (``slots._filter``):

- ``name=True``: ``held_until`` in the name's limit document;
- ``group=True``: an entry ``{group, until}`` of ``group_holds`` in the name's document (the
  take of the name's slot for a task of that group refuses it);
- ``resource="openai"``: ``held_until`` in the resource's document (``limits.resource_slot``).

The document is made if there is none (a name with no limit gets one holding only the hold). A
hold is written with one update, before the run is released, and only ever moves later (a
second back-off during one ends at the later of the two). Workers hear of it as of a changed
limit (``HELD_UNTIL`` and ``GROUP_HOLDS`` are limit fields), and take the name's slot for its
tasks from then on. A limited name's take carries its task's group whatever the worker has
heard, so its hold is exact at once; a worker that has not heard of a hold on a name with no
limit before (within a second) may claim one more of its tasks.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from typing import Any

from mtask.errors import InvalidTask
from mtask.limits.rules import (
    GROUP_HOLDS,
    HELD_UNTIL,
    resource_slot,
    validate_group,
    validate_resource,
)
from mtask.vocabulary import validate_name

MAX_BACKOFF_S = 86_400.0
"""A back-off holds for at most a day."""


class BackOff(Exception):
    """Raise from a handler to hold back what it calls for ``seconds``: its task's ``group``,
    its ``name``, or the shared ``resource`` named. The run is released without spending a
    retry; no task of the group, name or resource is claimed until the hold ends (its own task
    runs again after it)."""

    def __init__(
        self,
        seconds: float,
        *,
        group: bool = False,
        name: bool = False,
        resource: str | None = None,
        reason: str = "backing off",
    ) -> None:
        super().__init__(reason)
        if sum((bool(group), bool(name), resource is not None)) != 1:
            raise ValueError("BackOff holds one thing: group=True, name=True or resource=...")
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not math.isfinite(seconds)
            or not 0 < seconds <= MAX_BACKOFF_S
        ):
            raise ValueError(f"BackOff seconds must be above 0 and at most {MAX_BACKOFF_S:g}")
        self.seconds = float(seconds)
        self.group = bool(group)
        self.name = bool(name)
        self.resource = None if resource is None else validate_resource(resource)


def target(exc: BackOff, name: str, group: str | None) -> tuple[str, str | None]:
    """The document a back-off of a run of ``name`` (in ``group``) holds, and the group it holds
    in it (``None``: the whole document). ``InvalidTask`` for a group back-off of a task with no
    group."""
    if exc.resource is not None:
        return resource_slot(exc.resource), None
    if exc.group:
        if group is None:
            raise InvalidTask("BackOff(group=True) from a task with no group", field="group")
        return validate_name(name), validate_group(group)
    return validate_name(name), None


def held_until(doc: Mapping[str, Any], group: str | None, now: dt.datetime) -> dt.datetime | None:
    """Until when ``doc`` (a name's or a resource's limit document, any shape) holds back a task
    (of ``group``) at ``now``, or ``None`` if it does not."""
    found = [doc.get(HELD_UNTIL)]
    holds = doc.get(GROUP_HOLDS)
    if group is not None and isinstance(holds, list):
        found += [
            h.get("until") for h in holds if isinstance(h, Mapping) and h.get("group") == group
        ]
    later = [at for at in found if isinstance(at, dt.datetime) and at > now]
    return max(later) if later else None
