"""The run side's seams: what the claim side sees of it (``RunStarter``), and what it needs of
the parts around it, each a narrow protocol (River's producer and executor meet at a struct
and a few callbacks).

- ``RunStarter`` (the ``Executor``): the claim side starts a claimed document's run, reads how
  many outcomes wait to be written (its backpressure), gives back a limit slot a run of this
  worker held but no longer needs, and has a run in flight hold a slot a changed limit counts
  it in;
- ``SlotReturns`` (the claim side's ``SlotReleases``): the recorder gives back the limit slots of
  ended runs once their outcomes are written;
- ``Recorded`` (finding's ``QueueSink``): what the recorder tells the finding side of an outcome
  written (a success its stream skips) or not (the task back in the claim queue);
- ``PoolView`` (the ``ProcessPool``): what the heartbeat shows of the pool's children.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, Protocol


class RunStarter(Protocol):
    """What the claim side sees of the run side."""

    def start(
        self,
        doc: dict[str, Any],
        sent: float,
        slots: tuple[str, ...] = (),
        tokens: frozenset[str] = frozenset(),
    ) -> None:
        """Run a claimed task: ``sent`` is when (monotonic) its claim was sent, ``slots`` the
        limit slots the run holds, ``tokens`` those it holds only a token of."""
        ...

    @property
    def unwritten(self) -> int:
        """Outcomes waiting to be written (the claimer's backpressure)."""
        ...

    def give_back(self, slot: str, run_id: str) -> None:
        """Give a limit slot back once the outcomes now pending are written (or at once)."""
        ...

    def hold(self, run_id: str, slot: str) -> bool:
        """The run in flight ``run_id`` holds a place in ``slot`` from now on (a changed limit
        counted it in): its pings keep it, its end gives it back. ``False`` if the run has
        ended (the caller gives the place back)."""
        ...


class SlotReturns(Protocol):
    """Where the limit slots of ended runs go back (``claiming.releases.SlotReleases``)."""

    def release_later(self, slot: str, run_ids: Iterable[str]) -> None: ...

    def take_releases(self) -> dict[str, list[str]]: ...

    async def flush(
        self, releases: dict[str, list[str]] | None = None, keep: bool = True
    ) -> None: ...


class Recorded(Protocol):
    """What the recorder tells the finding side (its ``QueueSink``) once outcomes are written."""

    def succeeded(self, key: str) -> None:
        """This worker recorded a success of ``key`` (an own stream leaves that event out)."""
        ...

    async def requeue(self, keys: list[str], later_than: dt.datetime | None = None) -> None:
        """Put tasks back from their current documents (an outcome that could not be
        written: no event will)."""
        ...

    def requeue_at(self, key: str, when: dt.datetime) -> None:
        """Put a known task back at ``when`` (a run that continued as new: due at once, its
        next run claimed without waiting for the change's event)."""
        ...


class PoolView(Protocol):
    """The process pool as the heartbeat shows it."""

    max_tasks_per_child: int | None
    max_memory_per_child: int | None
    memory_limit: int | None

    def state(self) -> dict[str, int]: ...

    def children(self, limit: int = 64) -> list[dict[str, Any]]: ...
