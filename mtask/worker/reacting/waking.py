"""Waits on data, the worker's side (docs/triggers.md): the one follower of a collection that
tasks wait on (``ctx.wait_until``) wakes the tasks a change may have settled.

A batch of changes costs one read of the tasks (the ``data_waits`` index, by the changed
documents' ``_id``s), one ``$facet`` read of the collection for the waits found (MongoDB decides
each predicate), and one update waking those that hold. Its sweep (every ``sweep_interval``, and
when the stream's history is lost) re-checks every pending wait of the collection the same way:
an event missed, or a wake-up that did not land, only delays a task.
"""

from __future__ import annotations

from typing import Any

from mtask import metrics
from mtask.driver import AsyncDriver, Doc
from mtask.store import datawaits
from mtask.worker.reacting.protocols import SaveScan

IDS_PER_READ = 1000
SWEEP_PAGE = 500


class Waking:
    """The ``Reaction`` of one collection that tasks wait on."""

    def __init__(self, driver: AsyncDriver, collection: str, sweep_every: float) -> None:
        self.driver = driver
        self._collection = collection
        self.sweep_every: float | None = sweep_every

    @property
    def label(self) -> str:
        return f"wait:{self._collection}"

    @property
    def collection(self) -> str:
        return self._collection

    @property
    def full_document(self) -> str | None:
        return None

    def pipeline(self) -> list[Doc]:
        """Changes that may settle a wait: a document inserted, updated or replaced (a deleted
        one matches no predicate), reduced to its key."""
        return [
            {"$match": {"operationType": {"$in": ["insert", "update", "replace"]}}},
            {"$project": {"documentKey": 1, "clusterTime": 1}},
        ]

    async def changes(self, changes: list[Doc]) -> int:
        ids: list[Any] = []
        for change in changes:
            key = change.get("documentKey")
            if isinstance(key, dict) and "_id" in key and key["_id"] not in ids:
                ids.append(key["_id"])
        woken = 0
        for start in range(0, len(ids), IDS_PER_READ):
            chunk = ids[start : start + IDS_PER_READ]
            tasks = await self.driver.run(datawaits.waiting_on(self._collection, chunk))
            woken += await self._wake(tasks, "change")
        return woken

    async def _wake(self, tasks: list[Doc], by: str) -> int:
        if not tasks:
            return 0
        holding = await self.driver.run(datawaits.holding(self._collection, tasks))
        woken = await self.driver.run(datawaits.wake(holding))
        metrics.DATA_WAITS_WOKEN.labels(self._collection, by).inc(woken)
        return woken

    async def catch_up(self, scan: Doc, save: SaveScan) -> int:
        """Every pending wait on the collection checked again, a page at a time."""
        after: str | None = None
        woken = 0
        while True:
            page = await self.driver.run(datawaits.open_waits(self._collection, after, SWEEP_PAGE))
            if not page:
                return woken
            woken += await self._wake(page, "sweep")
            after = page[-1]["_id"]
