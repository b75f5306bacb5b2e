"""Repeatable tasks: APScheduler triggers (cron expressions or intervals, with time zones).

- ``definition``: ``Schedule``, a schedule's definition, validated (pydantic);
- ``ticks``: pure rules of its ticks (the first, the next, the latest, a pass's plan, a tick's
  key, the overlap's step); its store operations are ``mtask.store.schedules``.

A schedule is one document in the ``schedules`` collection::

    {_id: id, task: name, cron: "0 * * * *" | null, every_s: 30.0 | null, timezone: "UTC",
     start: date (the interval's anchor), params, options, catch_up, misfire_grace_s,
     paused: bool, next_tick_at: date, last_tick_at, last_key, error, definition: hash, ...}

Every worker runs the scheduler loop (``worker.maintenance.scheduler``): it reads the schedules
whose ``next_tick_at`` has come (by the server's clock), publishes one task per tick with the key
``"<id>@<tick in UTC>"``, and moves ``next_tick_at`` on with a compare-and-set on its old value.
Any number of workers may do this at once: the publish is idempotent by key, so each tick is
published once, and only one of them advances the schedule — no leader election. A crash
between the two steps publishes the same keys again, which creates nothing.

Ticks missed while no worker ran are handled by ``catch_up``: ``"all"`` publishes each of them
(up to ``MAX_TICKS_PER_PASS`` at a time), ``"latest"`` (the default) only the most recent one,
``"none"`` none of them — a tick is published only if it is at most ``misfire_grace_s`` old.

A tick whose previous task is still open (pending or running) follows ``overlap``:
``"all"`` (the default) publishes it anyway; ``"skip"`` publishes nothing and counts it in
``skipped``; ``"buffer"`` keeps the newest such tick in ``buffered_tick`` (one at most: the
ticks it replaces count as skipped) and publishes it once the previous task has finished,
looked at every ``BUFFER_RECHECK_S`` while it waits (``next_tick_at`` is then the recheck,
``after_buffer`` the trigger's own next tick). Under ``skip`` and ``buffer`` a pass publishes one
tick at most. The previous task is the one ``last_key`` names, read by its key; the advance is
the same compare-and-set on ``next_tick_at``, so two workers never both publish.
"""

from typing import TYPE_CHECKING

from mtask._version import lazy_exports
from mtask.errors import ScheduleNotFound

if TYPE_CHECKING:
    from mtask.schedules.definition import (
        CATCH_UP_CHOICES,
        OVERLAP_CHOICES,
        CatchUp,
        Schedule,
    )

# the definition is a pydantic model: imported on its first use, so that the tick rules
# (``ticks``) load no pydantic (a worker's start)
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "mtask.schedules.definition": (
            "CATCH_UP_CHOICES",
            "OVERLAP_CHOICES",
            "CatchUp",
            "Schedule",
        )
    },
    globals(),
)

__all__ = ["CATCH_UP_CHOICES", "OVERLAP_CHOICES", "CatchUp", "Schedule", "ScheduleNotFound"]
