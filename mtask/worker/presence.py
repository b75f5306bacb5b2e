"""Presence in the cluster: the heartbeat, pause and resume, remote stop, and the peers.

Every ``heartbeat_interval`` seconds (at once when a control changes) ``Presence`` writes this
worker's document in ``workers``, reads the paused names and (while this worker finds its own
work) the live workers, and publishes
what it learnt through the ``Assignment`` the ``Claimer`` and the finding parts read. It also
re-calibrates a ``ServerClock`` when its heartbeat's server time disagrees with it, the beat
came back quicker than half the calibration's round trip, or its calibration is old
(``ServerClock.needs_calibration``), and twice soon after the start; the beat's time is offered
to the clock as a sample (``ServerClock.offer``).

Ownership: the one ``Assignment`` object is written by ``Presence`` only, on the event loop's
thread (each field is replaced whole, never mutated in place); the ``Claimer`` and the
finding parts read it on the same thread.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import socket
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from pymongo.errors import PyMongoError

from mtask._version import __version__
from mtask.clock import Clock, ServerClock
from mtask.driver import AsyncDriver
from mtask.errors import StorageError
from mtask.store import controls as control
from mtask.worker.inflight import InFlight
from mtask.worker.running.protocols import PoolView
from mtask.worker.service import PeriodicService, event_or_timeout
from mtask.worker.worker_events import Emitter, Event

log = logging.getLogger(__name__)

WorkerState = Literal["ready", "running", "stopping", "stopped"]
CALIBRATE_EARLY = frozenset({2, 5})
"""Heartbeats soon after the start that calibrate too: workers started together measure their
first round trips on a loaded host (the clock keeps the most precise: ``mtask.clock``)."""


@dataclass
class Assignment:
    """What this worker claims: its names except the paused ones, and which live workers
    handle each name (for the stagger of own streams)."""

    names: tuple[str, ...]
    paused: frozenset[str] = frozenset()
    peers: Mapping[str, Collection[str]] = field(default_factory=dict)
    active: list[str] = field(init=False)
    """``names`` except the paused ones (kept, not computed: it is read per event)."""

    def __post_init__(self) -> None:
        self.active = [n for n in self.names if n not in self.paused]

    def pause(self, paused: frozenset[str]) -> frozenset[str]:
        """Make ``paused`` the paused names; return the names resumed by it."""
        resumed = self.paused - paused
        self.paused = paused
        self.active = [n for n in self.names if n not in paused]
        return resumed


class Lifecycle(Protocol):
    """The supervisor as Presence sees it: its state, and a way to ask it to stop."""

    @property
    def state(self) -> WorkerState: ...

    def stop(self, immediate: bool = False) -> None: ...


class Rescanner(Protocol):
    def request_rescan(self) -> None: ...


class Presence(PeriodicService):
    name: ClassVar[str] = "heartbeat"
    failure: ClassVar[str] = "heartbeat failed, retrying"
    errors: ClassVar[tuple[type[Exception], ...]] = (StorageError, PyMongoError)

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        *,
        worker_id: str,
        concurrency: int,
        interval: float,
        inflight: InFlight,
        lifecycle: Lifecycle,
        emit: Emitter,
        assignment: Assignment,
        rescanner: Rescanner,
        controls_changed: asyncio.Event,
        server_clock: ServerClock | None = None,
        database: Any = None,
        read_every: int = 1,
        stream_state: Callable[[], dict[str, Any] | None] = lambda: None,
        quiet_every: int = 1,
        ranks: Callable[[], bool] = lambda: True,
        pool: PoolView | None = None,
        uses: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.worker_id = worker_id
        self.concurrency = concurrency
        self.interval = interval
        self.inflight = inflight
        self.lifecycle = lifecycle
        self.emit = emit
        self.server_clock = server_clock
        self.database = database
        """The async database a ``ServerClock`` calibrates against."""
        self.assignment = assignment
        self.rescanner = rescanner
        """Told to rescan when a name is resumed (the worker's ``Finder``)."""
        self.controls_changed = controls_changed
        """Set on a change event of the controls: beat at once."""
        self.read_every = read_every
        """Beats between two reads of the paused names and the peers (and on a change of the
        controls, which the shared stream's relay passes on as it comes, or when the worker
        begins to find its own work): with the shared stream a worker ranks by its peers only
        while it finds its own work, and a read each beat by every worker cost the server N
        reads every beat."""
        self.quiet_every = quiet_every
        """Beats between two writes while this worker is idle and its document unchanged:
        with the shared stream an idle worker writes every ``quiet_every`` intervals (live
        within ``client.workers``' window all the same); a remote stop reaches it then."""
        self.beats = 0
        self._read = True
        """Whether this beat reads the paused names (and the peers) whatever ``read_every``
        says: a change of the controls, and the start-up's beat, before the first claim (a
        worker started while a name is paused must never claim it)."""
        self._written: tuple[int, dict[str, Any]] | None = None
        """The beat of the last write, and the document it wrote."""
        self.pool = pool
        """The worker's process pool, whose children the heartbeat shows."""
        self.uses = [
            {"name": name, "resources": list(resources)}
            for name, resources in sorted((uses or {}).items())
            if resources
        ]
        """The shared resources each name's handler declares, in the heartbeat for
        the readers' "why" (a list: a task name may hold a dot); none, no field."""
        self.stream_state = stream_state
        """What the heartbeat shows of the shared stream (``None``: an own stream)."""
        self.ranks = ranks
        """Whether this worker's claims are staggered by its peers now (it finds its own
        work): the peers are read only then. A worker the shared stream's relay hands its
        tasks to ranks nothing, and 64 idle hosts read them twice a second for nothing."""

    async def wait(self) -> None:
        self._read = await event_or_timeout(self.controls_changed, self.interval)
        self.controls_changed.clear()

    async def run_once(self) -> None:
        self.beats += 1
        if self.server_clock is not None and self.beats in CALIBRATE_EARLY:
            await self.server_clock.calibrate_async(self.database)
        await self.beat()

    async def beat(self) -> None:
        """Write this worker's document; follow a remote stop, the paused names, the peers."""
        now = self.clock.now()
        document = self.document(now)
        if self._quiet(document):
            return
        self._written = (self.beats, document)
        clock = self.server_clock
        sent = clock.monotonic() if clock is not None else 0.0
        doc = await self.driver.run(control.heartbeat(document, now))
        if clock is not None:
            back, beat_at = clock.monotonic(), doc.get("beat_at")
            if clock.needs_calibration(sent, back, beat_at):
                await clock.calibrate_async(self.database)
            clock.offer(sent, back, beat_at)
        if doc.get("stop_requested") and self.lifecycle.state == "running":
            log.info("stop requested remotely", extra={"worker_id": self.worker_id})
            self.lifecycle.stop()
        if not (self._read or self.beats % self.read_every == 1 % self.read_every):
            return
        paused = await self.driver.run(control.paused_names())
        assignment = self.assignment
        if self.ranks():
            assignment.peers = await self.peers(now)
        if paused != assignment.paused:
            resumed = assignment.pause(frozenset(paused))
            self.emit(Event.PAUSED_CHANGED, paused=sorted(paused))
            if resumed:
                self.rescanner.request_rescan()  # resumed names: find their tasks

    async def peers(self, now: dt.datetime) -> dict[str, list[str]]:
        """The live workers of each name."""
        peers = await self.driver.run(
            control.live_workers(now, 3 * dt.timedelta(seconds=self.interval), {"names": 1})
        )
        table: dict[str, list[str]] = {}
        for peer in peers:
            names, worker = peer.get("names"), peer.get("_id")
            if not isinstance(names, list) or not isinstance(worker, str):
                continue  # a heartbeat edited by hand: no worker wrote it, none ranks by it
            for name in names:
                if isinstance(name, str):
                    table.setdefault(name, []).append(worker)
        return table

    def _quiet(self, document: dict[str, Any]) -> bool:
        """Whether this beat may go unwritten: idle, nothing changed, written lately."""
        if self.quiet_every <= 1 or self._written is None or self._read:
            return False
        beat, written = self._written
        idle = not self.inflight.runs and document == written
        return idle and self.beats - beat < self.quiet_every

    def document(self, now: dt.datetime | None = None) -> dict[str, Any]:
        runs = list(self.inflight.runs.values())
        doc = {
            "_id": self.worker_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "version": __version__,
            "names": list(self.assignment.names),
            "concurrency": self.concurrency,
            "in_flight": len(runs),
            "state": self.lifecycle.state,
            "running": [{"key": r.key, "run_id": r.run_id} for r in runs[:50]],
            "waiting": sum(1 for r in runs if r.waiting),
        }
        if self.uses:
            doc["uses"] = self.uses
        if self.pool is not None:
            doc["pool"] = pool_document(self.pool, now or self.clock.now())
        if (stream := self.stream_state()) is not None:
            doc["stream"] = stream
        return doc


def pool_document(pool: PoolView, now: dt.datetime) -> dict[str, Any]:
    """The process pool in the heartbeat: its counts (children started, recycled, killed,
    died; runs ended by their hard time limit or memory limit) and each live child (pid,
    ``busy``/``idle``, runs done, resident bytes after its last run, since when its current
    run runs)."""
    children = []
    for child in pool.children():
        busy_for = child.pop("busy_for")
        child["busy_since"] = None if busy_for is None else now - dt.timedelta(seconds=busy_for)
        children.append(child)
    counts = pool.state()
    return {
        **{
            k: counts[k]
            for k in ("started", "recycled", "killed", "died", "time_limit_kills", "memory_kills")
        },
        "max_tasks_per_child": pool.max_tasks_per_child,
        "max_memory_per_child": pool.max_memory_per_child,
        "memory_limit_per_child": pool.memory_limit,
        "children": children,
    }
