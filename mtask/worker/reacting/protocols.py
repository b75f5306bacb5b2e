"""The one contract between a follower and what it does with its collection's changes
(``Reaction``): publish tasks (``trigger_tasks.Publishing``, a trigger) or wake the tasks that
wait on the changed documents (``waking.Waking``, waits on data)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

Doc = dict[str, Any]
SaveScan = Callable[[Any, int], Awaitable[None]]
"""A scan's progress, written by the follower under its lease: the last ``_id`` done and how
many tasks the scan published so far."""


class Reaction(Protocol):
    """What a follower does with the changes of ``collection``. ``changes`` and ``catch_up``
    are idempotent: a change handed out again after a crash, and a scan run again, find their
    effect there."""

    @property
    def label(self) -> str:
        """The follower's name in logs, events and metrics."""
        ...

    @property
    def collection(self) -> str: ...

    @property
    def full_document(self) -> str | None:
        """The change stream's ``fullDocument`` (``None``: the change alone)."""
        ...

    @property
    def sweep_every(self) -> float | None:
        """Seconds between two ``catch_up`` calls while the stream is followed (``None``:
        only when the stream's history is lost, or a scan is due)."""
        ...

    def pipeline(self) -> list[Doc]: ...

    async def changes(self, changes: list[Doc]) -> int:
        """Act on a batch of changes; returns how many tasks it published or woke."""
        ...

    async def catch_up(self, scan: Doc, save: SaveScan) -> int:
        """Act on the collection's documents as they are (a trigger's scan, the waits'
        re-check): ``scan`` holds ``epoch`` and ``after`` (where an earlier scan stopped)."""
        ...
