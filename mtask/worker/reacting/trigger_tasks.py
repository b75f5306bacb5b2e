"""A trigger's reaction (docs/triggers.md): each change publishes its task, idempotently by the
key the change gives (``mtask.triggers``); a scan publishes one for each matching document.

Keyed by change, a batch of changes is one unordered bulk insert-if-absent
(``store.publish_many``); keyed by document, each change follows ``store.triggers``' rules
(join, reset, follow-up). A change whose params MongoDB would refuse (past ``max_params_bytes``,
too deep) still publishes its task, with the document's ``_id`` and the change but without the
fields, and says why in ``params.omitted``: a document of any shape never stops a trigger.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mtask import metrics
from mtask.clock import Clock
from mtask.driver import AsyncDriver, Doc
from mtask.errors import InvalidTask
from mtask.store import publish_many, retention
from mtask.store import triggers as store_triggers
from mtask.triggers import Trigger, cluster_time
from mtask.vocabulary import DEFAULT_MAX_PARAMS_BYTES
from mtask.worker.reacting.protocols import SaveScan

if TYPE_CHECKING:
    from mtask.models import NewTask

SCAN_PAGE = 500


class Publishing:
    """The ``Reaction`` of one trigger."""

    sweep_every: float | None = None

    def __init__(
        self,
        driver: AsyncDriver,
        clock: Clock,
        trigger: Trigger,
        options: Mapping[str, Any],
        max_params_bytes: int = DEFAULT_MAX_PARAMS_BYTES,
    ) -> None:
        self.driver = driver
        self.clock = clock
        self.trigger = trigger
        self.options = dict(options)
        """The published tasks' options: the trigger's, completed with the handler's."""
        self.max_params_bytes = max_params_bytes
        self._retention = retention.DefaultsCache()

    @property
    def label(self) -> str:
        return f"trigger:{self.trigger.name}"

    @property
    def collection(self) -> str:
        return self.trigger.collection

    @property
    def full_document(self) -> str | None:
        return self.trigger.full_document

    def pipeline(self) -> list[Doc]:
        return self.trigger.pipeline()

    # -- changes --------------------------------------------------------------------------------

    async def changes(self, changes: list[Doc]) -> int:
        if self.trigger.key == "change":
            tasks = [self._of_change(c, self.trigger.change_key) for c in changes]
            return await self._publish_all(tasks, "created")
        created = 0
        for change in changes:
            own = self._of_change(change, self.trigger.change_key)
            by_document = self._of_change(change, lambda i, _t: self.trigger.document_key(i))
            created += await self._publish_one(by_document, own, cluster_time(change))
        return created

    def _of_change(self, change: Doc, key_for: Any) -> NewTask:
        doc_id = (change.get("documentKey") or {}).get("_id")
        when = cluster_time(change)
        params = self.trigger.params_for(
            doc_id, change.get("fullDocument"), str(change.get("operationType")), when
        )
        return self._task(key_for(doc_id, change["_id"]), params, when)

    def _task(self, key: str, params: Doc, at: dt.datetime | None) -> NewTask:
        from mtask.models import NewTask

        options = dict(self.options)
        run_at = self.trigger.run_at(at)
        if run_at is not None:
            options["run_at"] = run_at
        by = {
            "trigger": self.trigger.name,
            "collection": self.trigger.collection,
            "document": params.get("_id"),
        }
        try:
            return NewTask.build(
                self.trigger.task,
                key,
                params,
                options,
                max_params_bytes=self.max_params_bytes,
                triggered_by=by,
            )
        except InvalidTask as exc:
            kept = {
                "_id": params["_id"],
                "change": params["change"],
                "omitted": f"the document's fields were left out: {exc}",
            }
            try:
                return NewTask.build(self.trigger.task, key, kept, options, triggered_by=by)
            except InvalidTask:  # an _id BSON holds but a task's params cannot: its key says it
                kept["_id"] = by["document"] = None
                return NewTask.build(self.trigger.task, key, kept, options, triggered_by=by)

    async def _known(self) -> dict[str, Doc]:
        now = time.monotonic()
        known = self._retention.get(now)
        if known is None:
            known = self._retention.put(await self.driver.run(retention.all_defaults()), now)
        return known

    async def _publish_all(self, tasks: list[NewTask], how: str) -> int:
        known = await self._known()
        created = await self.driver.run(publish_many(tasks, self.clock.now(), retention=known))
        metrics.TRIGGER_TASKS.labels(self.trigger.name, how).inc(created)
        metrics.by_name(metrics.PUBLISHED, self.trigger.task).inc(created)
        return created

    async def _publish_one(self, task: NewTask, own: NewTask, at: dt.datetime | None) -> int:
        known = await self._known()
        how = await self.driver.run(
            store_triggers.publish_document(
                task, own, self.clock.now(), self.trigger.run_at(at), known
            )
        )
        metrics.TRIGGER_TASKS.labels(self.trigger.name, how).inc()
        made = how in ("created", "follow-up", "own")
        if made:
            metrics.by_name(metrics.PUBLISHED, self.trigger.task).inc()
        return int(made or how == "reset")

    # -- the scan -------------------------------------------------------------------------------

    async def catch_up(self, scan: Doc, save: SaveScan) -> int:
        """A task for each document the match finds now, keyed by the scan's epoch (or by the
        document, for a trigger so keyed), a page at a time, the progress saved after each."""
        epoch = int(scan.get("epoch") or 0)
        after, first = scan.get("after"), "after" not in scan
        published = int(scan.get("published") or 0)
        trigger = self.trigger
        while True:
            page = await self.driver.run(
                store_triggers.scan_page(
                    trigger.collection,
                    trigger.scan_filter(),
                    trigger.scan_projection(),
                    after,
                    first,
                    SCAN_PAGE,
                )
            )
            if not page:
                return published
            published += await self._scanned(page, epoch)
            after, first = page[-1]["_id"], False
            await save(after, published)

    async def _scanned(self, page: list[Doc], epoch: int) -> int:
        now = self.clock.now()
        tasks = []
        for doc in page:
            params = self.trigger.params_for(doc["_id"], doc, "scan", now)
            tasks.append(self._task(self.trigger.scan_key(doc["_id"], epoch), params, now))
        if self.trigger.key == "change":
            return await self._publish_all(tasks, "scan")
        created = 0
        for doc, own in zip(page, tasks, strict=True):
            by_document = own.model_copy(update={"key": self.trigger.document_key(doc["_id"])})
            created += await self._publish_one(by_document, own, now)
        return created
