"""Where a known task sits in the claim queue, and whose it is (pure: no I/O).

``Placement`` keeps what is known of each open task it queued (``TaskMeta``) and puts the task
in the ``ClaimQueue`` at its claim time. Whose tasks it queues is its ``Scope``: one worker's
(``WorkerScope``: its active names, tasks that name it, a stagger among its peers) or the
relay's for every subscriber (``HostScope``: their names and ids, no stagger).

Stampede control (``WorkerScope``, own streams): when several idle workers see the same new
task, each places it at ``claim time + rank * stagger``, where ``rank`` is its place in a
rendezvous hash of the task's key over the live workers that handle the name. The first-ranked
worker claims at once; the others try only if it did not (it was busy).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from mtask.vocabulary import WORKER_TIMEOUT_MS, in_range
from mtask.worker.claim_queue import ClaimQueue, Group
from mtask.worker.presence import Assignment


class TaskMeta(NamedTuple):
    """What is remembered of an open task that was queued."""

    name: str
    priority: int
    specific: frozenset[str]
    """The worker ids in its ``specific_worker_ids`` (empty: any worker of the name)."""
    worker_timeout_ms: int | None
    multi: bool = False
    """Its ``concurrency`` is over 1: several workers may run it at once."""
    group: Group = None
    """Its fairness group: ``(name, options.group)``, or ``None`` without a group."""
    place: dt.datetime | None = None
    """Its place in line: ``available_at`` as last seen."""


class Scope(Protocol):
    """Whose tasks a placement queues."""

    @property
    def names(self) -> Sequence[str]:
        """The names whose tasks are queued."""

    @property
    def ids(self) -> str | tuple[str, ...]:
        """Whose ``specific_worker_ids`` tasks a scan reads."""

    def may_run(self, specific: frozenset[str]) -> bool:
        """Whether a task naming ``specific`` workers (none: any) is in scope."""

    def rank(self, key: str, name: str) -> int:
        """How many staggers after its claim time the task is queued."""


def rendezvous_rank(key: str, worker_id: str, peers: Collection[str]) -> int:
    """This worker's place (0 = first) among ``peers`` for ``key``; 0 if it is not a peer."""
    if len(peers) <= 1 or worker_id not in peers:
        return 0

    def weight(peer: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{peer}".encode(), digest_size=8).digest()

    mine = weight(worker_id)
    return sum(1 for peer in peers if peer != worker_id and weight(peer) < mine)


class WorkerScope:
    """One worker's tasks: its active names (``Assignment``, kept by ``Presence``)."""

    def __init__(self, worker_id: str, assignment: Assignment) -> None:
        self.worker_id = worker_id
        self.assignment = assignment

    @property
    def names(self) -> Sequence[str]:
        return self.assignment.active

    @property
    def ids(self) -> str:
        return self.worker_id

    def may_run(self, specific: frozenset[str]) -> bool:
        return not specific or self.worker_id in specific

    def rank(self, key: str, name: str) -> int:
        return rendezvous_rank(key, self.worker_id, self.assignment.peers.get(name, ()))


class HostScope:
    """The relay's: every subscriber's names and ids, set as subscribers come and go. No
    stagger: one relay holds the queue of every worker that shares the stream."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.ids: tuple[str, ...] = ()

    def may_run(self, specific: frozenset[str]) -> bool:
        return not specific or not specific.isdisjoint(self.ids)

    def rank(self, key: str, name: str) -> int:
        return 0


class Placement:
    """The known open tasks and their place in the claim queue."""

    def __init__(
        self,
        queue: ClaimQueue,
        scope: Scope,
        *,
        in_flight: Callable[[str], bool],
        wake: Callable[[], None],
        stagger: dt.timedelta = dt.timedelta(milliseconds=25),
    ) -> None:
        self.queue = queue
        self.scope = scope
        self.in_flight = in_flight
        """True for a key claimed or run here (or, for the relay, handed over): not queued."""
        self.wake = wake
        self.stagger = stagger
        self.meta: dict[str, TaskMeta] = {}
        self.ignored: set[str] = set()
        """Keys of documents that could not even be marked invalid: never queued again."""
        self.changed_busy: set[str] = set()
        """Known keys whose claim time changed while they were in flight (the event was not
        queued): a claim of one that misses is not the last word (``changed_while_busy``)."""

    def place(self, doc: Mapping[str, Any]) -> None:
        """Queue a task from its document (an insert event, a scan, a lookup); raises
        ``TypeError`` (or another error) on a malformed one."""
        key = doc["_id"]
        options = doc.get("options") or {}
        listed = options.get("specific_worker_ids") or []
        if not isinstance(listed, list):
            raise TypeError("options.specific_worker_ids is not a list")
        specific = frozenset(s for s in listed if isinstance(s, str))
        name = doc.get("name")
        if (
            not isinstance(name, str)
            or name not in self.scope.names
            or key in self.ignored
            or (listed and not specific)  # it names no worker that can exist
            or not self.scope.may_run(specific)
        ):
            self.forget(key)
            return
        if len(self.meta) >= 4 * self.queue.max_size:
            self.meta.clear()  # bounded memory; unknown keys are looked up again
            self.changed_busy.clear()
        priority, timeout = options.get("priority", 0), options.get("worker_timeout_ms")
        concurrency, group = options.get("concurrency"), options.get("group")
        place = doc.get("available_at")
        self.meta[key] = TaskMeta(
            name,
            priority if isinstance(priority, int) else 0,
            specific,
            timeout if in_range(timeout, WORKER_TIMEOUT_MS) else None,
            isinstance(concurrency, int) and concurrency > 1,
            (name, group) if isinstance(group, str) else None,
            place if isinstance(place, dt.datetime) else None,
        )
        self.move(key, doc.get("next_claim_at"))

    def move(self, key: str, claim_at: Any, place: Any = None) -> None:
        """A known task's claim time changed (not a date: it finished), and its place in line
        too if ``place`` is a date (a retry's or a wake-up's ``available_at``)."""
        if not isinstance(claim_at, dt.datetime):
            self.forget(key)
            return
        if isinstance(place, dt.datetime):
            self.meta[key] = self.meta[key]._replace(place=place)
        if self.in_flight(key):
            self.queue.discard(key)
            self.changed_busy.add(key)
            return
        self.changed_busy.discard(key)
        meta = self.meta[key]
        try:
            at = claim_at + self.scope.rank(key, meta.name) * self.stagger
        except OverflowError:  # a claim time at the last date Python holds: none is later
            at = claim_at
        self.requeue(key, at)
        self.wake()

    def requeue(self, key: str, at: dt.datetime) -> None:
        """Queue a known ``key`` at ``at``, keeping its priority, group and place in line."""
        meta = self.meta.get(key)
        if meta is not None:
            self.queue.push(
                key, at, meta.priority, bool(meta.specific), group=meta.group, place=meta.place
            )

    def move_known(self, key: str, when: dt.datetime) -> bool:
        """Move ``key`` to ``when`` if it is known; whether it was."""
        if key not in self.meta:
            return False
        self.move(key, when)
        return True

    def hand(
        self,
        key: str,
        name: str,
        priority: int,
        timeout: int | None,
        now: dt.datetime,
        group: str | None = None,
    ) -> bool:
        """Queue ``key``, handed over by the relay, due ``now``; False if it runs here already
        (for another worker of a task of ``concurrency`` > 1)."""
        if key in self.ignored:
            return True
        if self.in_flight(key):
            return False
        grouped = (name, group) if isinstance(group, str) else None
        self.changed_busy.discard(key)
        self.meta[key] = TaskMeta(name, priority, frozenset(), timeout, group=grouped)
        self.queue.push(key, now, priority, group=grouped)
        self.wake()
        return True

    def forget(self, key: str) -> None:
        self.queue.discard(key)
        self.meta.pop(key, None)
        self.changed_busy.discard(key)

    def changed_while_busy(self, key: str) -> bool:
        """Whether ``key``'s claim time changed while it was in flight (and since it last was):
        a claim of it sent before that change may have missed because of what changed (an
        outcome written while the claim was on its way), so the claim's miss is not final. Asked
        once: the answer is forgotten."""
        if key in self.changed_busy:
            self.changed_busy.discard(key)
            return True
        return False

    def ignore(self, key: str) -> None:
        """Never queue ``key`` again (its document cannot even be marked invalid)."""
        self.ignored.add(key)
        self.forget(key)

    def clear(self, keep: Collection[str] = ()) -> None:
        """Forget every known task (and what the queue left out), except the known ones in
        ``keep``: they stay where they are in the queue."""
        kept = {key: self.meta[key] for key in keep if key in self.meta}
        self.queue.retain(kept)
        self.meta = kept
        self.changed_busy.intersection_update(kept)

    def known(self, key: str) -> TaskMeta | None:
        return self.meta.get(key)

    def timeouts(self, keys: list[str]) -> dict[str, int]:
        """The tasks' worker_timeout_ms as last seen (hints for the claim shortcut)."""
        found = {k: self.meta[k].worker_timeout_ms for k in keys if k in self.meta}
        return {k: t for k, t in found.items() if t is not None}
