"""The worker's events: typed names, and the emitter that logs them and calls ``on_event``.

``on_event(name, **data)`` is the hook tests await (``tests/harness.Events``) and programs
embedding a worker may use; it receives the event's name as a plain string.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


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
    STOPPING_RUN = "stopping_run"
    RECORDED = "recorded"
    PAUSED_CHANGED = "paused_changed"


LOGGED = frozenset(
    {
        Event.CLAIMED,
        Event.SUCCEEDED,
        Event.FAILED,
        Event.RELEASED,
        Event.CANCELLED,
        Event.WAITING,
        Event.STOPPING_RUN,
        Event.STARTED,
        Event.STOPPING,
        Event.STOPPED,
    }
)
"""Events worth a log line at INFO; the others only reach ``on_event``."""


class Emitter:
    def __init__(self, on_event: Callable[..., None] | None = None) -> None:
        self._on_event = on_event

    def __call__(self, event: Event, **data: Any) -> None:
        if event in LOGGED and log.isEnabledFor(logging.INFO):
            log.info(
                "%s %s",
                event.value,
                " ".join(f"{k}={v}" for k, v in data.items()),
                extra={"event": event.value, **{f"mtask_{k}": v for k, v in data.items()}},
            )
        if self._on_event is not None:
            self._on_event(event.value, **data)
