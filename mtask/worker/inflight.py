"""The in-flight ledger: the runs this worker holds, and the keys whose claim is on its way.

This is the only mutable state the ``Claimer``, the ``Executor`` and the finding parts share.
Ownership (River's producer style): every field is read and written on the event loop's thread
only; the pinger thread never touches it (it learns about runs through ``LeasePinger.add``).

- ``Claimer`` marks keys ``claiming`` for the length of a claim call, so that the claim's own
  change events cannot put them back in the claim queue before its reply arrives;
- ``Executor`` records a run ``started`` (under its claim) and ``ended`` (after its handler);
- the finding parts (``Placement``) ask ``busy(key)`` before queueing a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from mtask.registry import TaskContext


@dataclass
class ActiveRun:
    key: str
    name: str
    run_id: str
    ctx: TaskContext
    slots: tuple[str, ...] = ()
    """The limit slots this run holds (a name's, a group's): given back when it ends."""
    group: str | None = None
    """Its task's group (``options.group``), if any: a changed group limit counts it."""
    lease_ms: int = 30_000
    """Its lease's length (``worker_timeout_ms``): a place it takes in a slot lasts as long."""
    has_dependents: bool = False
    child_of: dict[str, object] | None = None
    """A spawned child's ``spawn``: its final outcome is counted on its parent."""
    deadline: dt.datetime | None = None
    """Its task's deadline: the run is stopped there, and the task fails."""
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None
    started: float = field(default_factory=time.monotonic)
    waiting: bool = True
    """Claimed ahead (prefetch) and waiting for a slot: its handler has not started."""
    running_since: float = 0.0
    """When (monotonic) it took its slot: how long its handler ran is measured from here."""
    begun: bool = False
    """Its task has taken its first step. A task cancelled before that never runs its body,
    so no outcome would be recorded: ``Executor.stop`` leaves such a task to see
    ``stop_reason`` itself."""


class InFlight:
    def __init__(self, on_free: Callable[[], None] = lambda: None) -> None:
        self.runs: dict[str, ActiveRun] = {}
        """Runs in flight by run id (``Executor``)."""
        self._keys: dict[str, int] = {}
        """Runs in flight per key (a task may be run again before its previous run ended)."""
        self._claiming: set[str] = set()
        """Keys whose claim is on its way (``Claimer``)."""
        self.on_free = on_free
        """Called when a slot may have freed (a run ended, a claim came back): the shared
        stream tells its relay how many tasks this worker can take."""
        self._begun = 0
        """Claims begun so far (``claims_mark``)."""
        self._open: set[int] = set()
        """The numbers of the claims on their way."""
        self._ended = asyncio.Event()
        """Set when a claim came back (``claims_back`` waits on it)."""

    def __len__(self) -> int:
        return len(self.runs)

    @property
    def load(self) -> int:
        """Runs in flight and keys being claimed: the slots taken or about to be."""
        return len(self.runs) + len(self._claiming)

    def busy(self, key: str) -> bool:
        """True while ``key`` is being claimed or run here: it is not queued."""
        return key in self._keys or key in self._claiming

    @contextlib.contextmanager
    def claiming(self, keys: Iterable[str]) -> Iterator[None]:
        """The keys count as in flight while the block runs (their claim is on its way)."""
        keys = list(keys)
        self._claiming.update(keys)
        self._begun += 1
        number = self._begun
        self._open.add(number)
        try:
            yield
        finally:
            self._claiming.difference_update(keys)
            self._open.discard(number)
            self._ended.set()
            self.on_free()

    def claims_mark(self) -> int:
        """``ClaimsBack``: a mark of the claims begun so far."""
        return self._begun

    async def claims_back(self, mark: int, within: float) -> None:
        """``ClaimsBack``: return once no claim begun after ``mark`` is on its way (those of
        limited names in batches beside the main loop, begun before, are not waited for), or
        after ``within`` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while any(number > mark for number in self._open):
                    self._ended.clear()
                    await self._ended.wait()

    async def claims_before(self, mark: int, within: float) -> None:
        """Return once no claim begun at or before ``mark`` is on its way (its runs have
        started, or it took nothing), or after ``within`` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while any(number <= mark for number in self._open):
                    self._ended.clear()
                    await self._ended.wait()

    def started(self, run: ActiveRun) -> None:
        self.runs[run.run_id] = run
        self._keys[run.key] = self._keys.get(run.key, 0) + 1

    def ended(self, run: ActiveRun) -> None:
        self.runs.pop(run.run_id, None)
        left = self._keys.pop(run.key, 1) - 1
        if left:
            self._keys[run.key] = left
        self.on_free()

    def get(self, run_id: str) -> ActiveRun | None:
        return self.runs.get(run_id)

    def active(self) -> list[ActiveRun]:
        """Runs whose handler has not ended yet."""
        return [r for r in self.runs.values() if r.task is not None and not r.task.done()]
