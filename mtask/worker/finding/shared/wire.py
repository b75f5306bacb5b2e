"""What the relay and its subscribers say to each other (carried by ``mailbox``): every frame is
spelled here, and read here.

Relay to subscriber:

- ``{"relay": "open"}`` (``OPEN``): the relay's stream is open: from now on it hands this
  worker its tasks;
- ``{"relay": "own"}`` (``OWN``): to the relay's own worker while it is the only subscriber:
  the task events follow, find work yourself;
- ``{"d": [[key, name, priority, worker_timeout_ms, group], …]}`` (``hand_out``): tasks handed
  over, due now (``group``: ``options.group`` or null);
- ``{"freed": [name, group]}`` (``group_freed``): a run of that group ended for good, so its
  sequence's lock may be free: to the subscribers that hold a key of the group (the worker's
  ``finding.Others.group_freed``);
- ``{"relay": "standby"}`` (``STANDBY``): watch this relay's lease as its standby
  (``standby``);
- ``{"relay": "gone"}`` (``LET_GO``): the last frame of an inbox the relay drops (a subscriber
  it let go): say hello again;
- ``{"relay": "taken", "by": relay}`` (``taken``): written by a relay that starts into every
  inbox it does not serve (the relay that inbox's subscriber follows is gone): say hello to
  ``relay``, from the same inbox (or, if this process holds ``relay``, follow it in memory);
- the change events of ``controls``, ``limits`` and ``schedules`` as they come (and, to the
  relay's own worker alone with it, the task events).

Subscriber to relay: its hello (``{"hello": PROTOCOL, "worker_id", "names", "free",
"inbox"}``: the capped collection it tails), then a report only when something happened that
the relay's stream does not show: ``free``, ``got`` and ``done`` (its credit: ``got``
acknowledges handed keys, ``done`` counts its successes, ``credit``; with ``"sync": true``
when the relay is to take ``done`` as the successes it has seen), ``names`` (when a pause
changes them), ``held``, ``missed`` and ``gone`` (keys of ``finding.protocols.ClaimReports``);
and ``{"bye": True}`` when it leaves. Its claims and successes are not said: the relay reads
them from its stream (``dispatch``), so a task costs the wire one insert, its hand-out.

Nothing is said to keep a line alive: an idle subscriber and its relay cost the server nothing
but a tailing getMore now and then. A subscriber learns that its relay is gone from the relay
that takes its place (``taken``), or from the lease (``store.relays.renewed_ago``); the relay
learns that a subscriber is gone when it leaves handed keys unacknowledged
(``credit.SILENT_SUBSCRIBER``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

from mtask.worker.finding.shared import mailbox
from mtask.worker.finding.shared.credit import Channel
from mtask.worker.finding.shared.dispatch import Dispatcher

log = logging.getLogger(__name__)

PROTOCOL = 8
"""The wire's version, said in each hello: a relay answers a subscriber of its own only."""
OPEN = {"relay": "open"}
OWN = {"relay": "own"}
STANDBY = {"relay": "standby"}
BYE = {"bye": True}
LET_GO = {"relay": "gone"}
"""The last frame of an inbox the relay drops (a subscriber it let go): its tail ends at once."""


def hand_out(entries: list[list[Any]]) -> dict[str, Any]:
    return {"d": entries}


def group_freed(name: str, group: str) -> dict[str, Any]:
    return {"freed": [name, group]}


def taken(relay: str) -> dict[str, Any]:
    return {"relay": "taken", "by": relay}


class Handed(NamedTuple):
    key: str
    name: str
    priority: int
    worker_timeout_ms: int | None
    group: str | None


def says(frame: Mapping[str, Any]) -> str | None:
    """What the relay says of itself in ``frame`` (``open``, ``own``, ``standby``, ``gone``,
    ``taken``), or ``None``: a frame about tasks, or an event."""
    said = frame.get("relay")
    return said if isinstance(said, str) else None


def handed(frame: Mapping[str, Any]) -> list[Handed] | None:
    """The tasks handed over in ``frame``, or ``None`` if it hands none over (entries of
    another shape are left out)."""
    entries = frame.get("d")
    if not isinstance(entries, list):
        return None
    return [Handed(*e) for e in entries if isinstance(e, list) and len(e) == 5]


def freed(frame: Mapping[str, Any]) -> tuple[str, str] | None:
    """The ``(name, group)`` whose run ended for good, if ``frame`` says so."""
    pair = frame.get("freed")
    if isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair):
        return pair[0], pair[1]
    return None


def taken_by(frame: Mapping[str, Any]) -> str | None:
    """The relay that took the lease, if ``frame`` is its ``taken``."""
    by = frame.get("by")
    return by if says(frame) == "taken" and isinstance(by, str) else None


class Hello(NamedTuple):
    worker_id: str
    inbox: str
    names: list[str]
    free: int


def parse_hello(tasks: str, hello: Mapping[str, Any]) -> Hello | None:
    """A subscriber's hello, or ``None`` (logged) if it is not one the relay can answer."""
    worker_id, inbox = hello.get("worker_id"), hello.get("inbox")
    if hello.get("hello") != PROTOCOL or not isinstance(worker_id, str):
        log.warning("refused a subscriber that is not mtask %s's: %r", PROTOCOL, worker_id)
        return None
    if not isinstance(inbox, str) or not mailbox.is_inbox(tasks, inbox):
        log.warning("refused a subscriber without an inbox: %s", worker_id)
        return None
    names = [n for n in hello.get("names") or () if isinstance(n, str)]
    free = hello.get("free")
    return Hello(worker_id, inbox, names, free if isinstance(free, int) else 0)


def apply_report(dispatcher: Dispatcher, channel: Channel, message: Mapping[str, Any]) -> None:
    """A subscriber's report (raises ``TypeError``/``ValueError`` on one that makes no sense):
    what became of its keys, then its credit and its names."""
    for key in message.get("held") or ():
        dispatcher.held(key, channel)
    for key in message.get("missed") or ():
        dispatcher.missed(key, channel)
    for key in message.get("gone") or ():
        dispatcher.gone(key)
    if "free" in message:
        free, got, done = (_count(message, f) for f in ("free", "got", "done"))
        dispatcher.report(
            channel, free, got, done, message.get("names"), message.get("sync") is True
        )


def _count(message: Mapping[str, Any], field: str) -> int:
    value = message.get(field)
    if not isinstance(value, int):
        raise ValueError(f"{field!r} is not a count: {value!r}")
    return value
