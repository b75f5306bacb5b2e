"""What a worker sharing the stream finds its work by: one named state (``SubscriberState``),
drawn with its transitions in ``subscriber.py`` (``SharedStream._enter``)."""

from __future__ import annotations

import enum


class SubscriberState(enum.Enum):
    BETWEEN = "between"
    OWN_STREAM = "own stream"
    RELAY_EVENTS = "relay events"
    DISPATCHED = "dispatched"
    FOR_GOOD = "for good"

    @property
    def mode(self) -> str:
        """What the heartbeat says: ``dispatched``, ``own`` (for good) or ``alone``."""
        return {"dispatched": "dispatched", "for good": "own"}.get(self.value, "alone")
