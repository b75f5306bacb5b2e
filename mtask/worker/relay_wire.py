"""What the relay and its subscribers say to each other (carried by ``mailbox``).

Relay to subscriber: ``{"relay": "open"}`` (the relay's stream is open: from now on the relay
hands this worker its tasks), ``{"relay": "own"}`` (to the relay's own worker while it is the
only subscriber: the task events follow, find work yourself), ``{"relay": "tick"}`` (alive,
nothing to say), ``{"d": [[key, name, priority, worker_timeout_ms], …]}`` (tasks handed over,
due now), and the change events of ``controls``, ``limits`` and ``schedules`` as they come.

Subscriber to relay: its hello (``{"hello": PROTOCOL, "worker_id", "names", "free",
"inbox"}``: the capped collection it tails), then reports: ``free`` and ``got`` (its credit),
``names`` (when a pause changes them), ``claimed`` (``[[key, next_claim_at]]``), ``held``,
``done``, ``missed`` and ``gone`` (keys), at least every ``KEEPALIVE`` seconds; and
``{"bye": True}`` when it leaves.
"""

from __future__ import annotations

PROTOCOL = 3
OPEN = {"relay": "open"}
OWN = {"relay": "own"}
TICK = {"relay": "tick"}
BYE = {"bye": True}
KEEPALIVE = 5.0
"""Seconds between two reports of a subscriber at most (the relay lets go of a subscriber
silent for ``3 * KEEPALIVE``)."""
