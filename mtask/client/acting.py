"""A client's changes to tasks already published: one task cancelled, retried, signalled or its
durable steps changed; many at once by a filter (``mtask.store.bulk``); finished ones purged."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from mtask import store
from mtask.client.checks import check_key, check_number
from mtask.client.core import Core, operation
from mtask.driver import Op
from mtask.models import Task
from mtask.store import bulk, journal_edits, retention
from mtask.store import children as store_children
from mtask.store import steps as store_steps


class Acting:
    """The operations that change tasks already published."""

    def __init__(self, core: Core) -> None:
        self.core = core

    @operation
    def cancel(self, key: str) -> Op[Task]:
        """Cancel an open task; a task that spawned children (``ctx.spawn_and_wait``) cancels
        its open children too, and theirs."""
        check_key(key)
        doc = yield from store_children.cancel_tree(key, self.core.clock.now())
        return Task.from_document(doc)

    @operation
    def retry(self, key: str, from_step: str | None = None) -> Op[Task]:
        """Run a failed or cancelled task again. ``from_step``: its durable steps before that
        one are kept and replayed, that one and the later ones run again (one update, fenced
        like ``reset_step``; ``InvalidTask`` for no such step)."""
        check_key(key)
        if from_step is not None:
            return Task.from_document(
                (yield from journal_edits.retry_from(key, from_step, self.core.clock.now()))
            )
        return Task.from_document((yield from store.retry(key, self.core.clock.now())))

    @operation
    def signal(self, key: str, name: str, payload: Any = None) -> Op[bool]:
        """Send signal ``name`` (with a BSON ``payload``) to an open task: its handler's
        ``ctx.wait_for(name)`` returns the payload, whether the wait began before or after
        (docs/steps.md). ``True`` if it woke the task (it was waiting for ``name``).
        ``InvalidTask`` for a bad name or payload, ``TaskNotFound``, ``InvalidTransition`` for
        a finished task."""
        check_key(key)
        return (yield from store_steps.signal(key, name, payload))

    @operation
    def reset_step(self, key: str, step: str) -> Op[store_steps.Reset]:
        """Reset task ``key``'s durable steps to before step ``step``: it and every step after
        it are removed, and the next run calls them again (a removed wait takes the next
        signal of its name: the one it had taken is removed too); a pending task may run now,
        a failed or cancelled one runs again once retried. One update, fenced so that no run
        of the task is RUNNING (docs/web.md). ``InvalidTask`` for no such step,
        ``TaskNotFound``, ``InvalidTransition`` while the task runs or once it succeeded."""
        check_key(key)
        return (yield from store_steps.reset(key, step))

    @operation
    def rename_step(self, key: str, step: str, to: str) -> Op[journal_edits.Remarked]:
        """Rename durable step ``step`` of a parked task ``to``, so that a changed handler
        replays it under its new name. One update, fenced like ``reset_step``."""
        check_key(key)
        return (yield from journal_edits.remark(key, step, to))

    @operation
    def drop_step(self, key: str, step: str) -> Op[journal_edits.Remarked]:
        """Drop durable step ``step`` from a parked task's journal (a changed handler no longer
        asks for it): the later steps move up one place. One update, fenced like
        ``reset_step``; a pending task that waited in it runs now."""
        check_key(key)
        return (yield from journal_edits.remark(key, step, None))

    # -- many tasks at once (mtask.store.bulk): the dashboard's bulk actions -----------------

    @operation
    def bulk_count(self, action: bulk.Action, where: bulk.Filter, limit: int) -> Op[int]:
        """How many tasks ``bulk`` would act on, up to ``limit`` (``limit + 1``: more)."""
        check_number(limit, "limit", 1, 10**9, integer=True)
        return (yield from bulk.count(action, where, self.core.clock.now(), limit))

    @operation
    def bulk(
        self, action: bulk.Action, where: bulk.Filter, *, dry_run: bool = False
    ) -> Op[bulk.BulkResult]:
        """Retry, cancel or purge the tasks ``where`` matches (a dry run only counts them)."""
        return (yield from bulk.apply(action, where, self.core.clock.now(), dry_run))

    @operation
    def purge(
        self,
        *,
        name: str | None = None,
        status: Sequence[str] | None = None,
        older_than: dt.timedelta | None = None,
        keys: Sequence[str] | None = None,
        dry_run: bool = False,
    ) -> Op[int]:
        """Remove finished tasks (never an open one) matching the filters: ``status`` among
        succeeded, failed, cancelled (the default) and invalid, finished at least
        ``older_than`` ago; returns how many were (``dry_run``: would be) removed."""
        filt = retention.purge_filter(
            self.core.clock.now(), name=name, statuses=status, older_than=older_than, keys=keys
        )
        return (yield from (retention.purge_count(filt) if dry_run else retention.purge(filt)))
