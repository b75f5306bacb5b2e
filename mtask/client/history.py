"""A client's records of what happened: the audit of actions (``store.audit``) and finished
tasks per minute and per worker (``store.throughput``), for ``mtask serve``'s dashboard."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Mapping
from typing import Any

from mtask.client.checks import check_number
from mtask.client.core import Core, operation
from mtask.driver import Op
from mtask.store import audit as store_audit
from mtask.store import queries, throughput
from mtask.vocabulary import MAX_AGE_SECONDS


class History:
    """The operations that record and read the audit and the throughput."""

    def __init__(self, core: Core) -> None:
        self.core = core

    @operation
    def ensure_audit(self) -> Op[None]:
        """The audit's capped collection (``store.audit``; ``mtask serve`` makes it)."""
        yield from store_audit.ensure()

    @operation
    def record_audit(self, entry: Mapping[str, Any]) -> Op[None]:
        """One record of an action, at the server's time."""
        yield from store_audit.record({**entry, "at": self.core.clock.now()})

    @operation
    def audit(
        self, limit: int = 100, before: str | None = None
    ) -> Op[builtins.list[dict[str, Any]]]:
        """The newest audit records first (``before``: the last ``id`` of the previous page)."""
        check_number(limit, "limit", 1, 1000, integer=True)
        return (yield from store_audit.recent(limit, before))

    @operation
    def record_throughput(self, minutes: int = throughput.RECOUNT_MINUTES) -> Op[int]:
        """Count the tasks that finished in each of the last ``minutes`` whole minutes, per
        name, into the ``throughput`` collection (the dashboard's charts)."""
        check_number(minutes, "minutes", 1, throughput.KEEP_SECONDS // 60, integer=True)
        return (yield from throughput.record(self.core.clock.now(), minutes))

    @operation
    def throughput(self, minutes: int = 60) -> Op[builtins.list[dict[str, Any]]]:
        check_number(minutes, "minutes", 1, MAX_AGE_SECONDS // 60, integer=True)
        return (yield from throughput.recent(self.core.clock.now(), minutes))

    @operation
    def finished_since(self, since: dt.datetime) -> Op[dict[str, int]]:
        """Per name, the tasks that finished after ``since`` (a server time)."""
        return (yield from queries.finished_since(since))

    @operation
    def runs_by_worker(self, minutes: int = 60) -> Op[dict[str, dict[str, int]]]:
        check_number(minutes, "minutes", 1, MAX_AGE_SECONDS // 60, integer=True)
        return (yield from throughput.runs_by_worker(self.core.clock.now(), minutes))
