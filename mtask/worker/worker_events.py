"""The worker's events: typed names, and the emitter that logs them and calls ``on_event``.

``on_event(name, **data)`` is the hook tests await (``tests/harness.Events``) and programs
embedding a worker may use; it receives the event's name as a plain string.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mtask.worker.events")  # the name operators filter on, kept


class Event(enum.StrEnum):
    STARTED = "started"
    STOPPING = "stopping"
    STOPPED = "stopped"
    CLAIMED = "claimed"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RELEASED = "released"
    CANCELLED = "cancelled"
    WAITING = "waiting"
    """A run ended sleeping or waiting for a signal (docs/steps.md)."""
    CONTINUED = "continued"
    """A run continued as new (``ctx.continue_as_new``): its task starts afresh."""
    SNOOZED = "snoozed"
    """A handler raised ``Snooze``: its run ended, no retry spent."""
    BATCH = "batch"
    """A batch handler was called with ``size`` tasks of ``name``."""
    STOPPING_RUN = "stopping_run"
    RECORDED = "recorded"
    NOT_RECORDED = "not_recorded"
    """An outcome MongoDB refused and the worker dropped: no FAIL could be written in its
    place (the task was marked invalid, or is run again when its lease ends)."""
    PAUSED_CHANGED = "paused_changed"
    HELD = "held"
    """A run told to stop (cancelled, its time limit, the worker's stop) whose handler has not
    stopped: it keeps its sequence's lock and limit slots until it has (docs/flow-control.md);
    ``released=True`` once it has."""
    LIMITS_APPLIED = "limits_applied"
    """A name's limit changed and this worker applies it: its claims from now on go by the
    new limit, and its runs in flight count towards it (``claiming.recount``)."""
    # -- triggers and waits on data (docs/triggers.md) --
    FOLLOWING = "following"
    """This process took a follower's lease (a trigger, or a collection tasks wait on) and
    knows its position: every change from now on is handed out."""
    UNFOLLOWED = "unfollowed"
    """A follower this process held was paused, reset or taken."""
    REACTED = "reacted"
    """A follower handled a batch of changes (``changes``; ``published``: tasks created, or
    data waits woken)."""
    SCANNED = "scanned"
    """A follower's scan of the matching documents ended (``published``)."""
    HISTORY_LOST = "history_lost"
    """A follower's stream could not resume (its history is gone): it scans instead."""


LOGGED = frozenset(
    {
        Event.CLAIMED,
        Event.SUCCEEDED,
        Event.FAILED,
        Event.RELEASED,
        Event.CANCELLED,
        Event.WAITING,
        Event.CONTINUED,
        Event.SNOOZED,
        Event.STOPPING_RUN,
        Event.NOT_RECORDED,
        Event.STARTED,
        Event.STOPPING,
        Event.STOPPED,
        Event.LIMITS_APPLIED,
        Event.HELD,
        Event.FOLLOWING,
        Event.UNFOLLOWED,
        Event.SCANNED,
    }
)
"""Events worth a log line at INFO; the others only reach ``on_event``."""


CONTROL = {c: f"\\x{c:02x}" for c in range(32) if chr(c) not in "\t"}


def _text(value: Any) -> str:
    """A value as a log line shows it: a control character (a NUL, a newline) escaped, so the
    log reads as text (``grep`` calls a log with a NUL binary) and one event is one line."""
    return str(value).translate(CONTROL)


class Emitter:
    """Logs an event and calls ``on_event``. The hook is the program's: what it raises is
    logged (at ERROR with its traceback the first time for each event name, then at DEBUG)
    and counted in ``hook_errors``, never passed on to the claim, the run or the outcome
    writer that emitted the event (it stranded runs and stopped the worker)."""

    def __init__(self, on_event: Callable[..., None] | None = None) -> None:
        self._on_event = on_event
        self.hook_errors = 0
        self._told: set[str] = set()

    def __call__(self, event: Event, **data: Any) -> None:
        if event in LOGGED and log.isEnabledFor(logging.INFO):
            log.info(
                "%s %s",
                event.value,
                " ".join(f"{k}={_text(v)}" for k, v in data.items()),
                extra={"event": event.value, **{f"mtask_{k}": v for k, v in data.items()}},
            )
        if self._on_event is not None:
            try:
                self._on_event(event.value, **data)
            except Exception:  # noqa: BLE001 - the program's hook: its error is its own
                self._hook_failed(event)

    def _hook_failed(self, event: Event) -> None:
        self.hook_errors += 1
        first = event.value not in self._told
        self._told.add(event.value)
        # a hook that fails on every event would log a line a task: the first of each name
        # has its traceback, the rest go to DEBUG
        log.log(
            logging.ERROR if first else logging.DEBUG,
            "on_event(%r) raised; the worker goes on (%d hook errors in all)",
            event.value,
            self.hook_errors,
            exc_info=first,
        )
