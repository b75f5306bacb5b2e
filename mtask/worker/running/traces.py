"""A task's trace context kept by its first run (``RunTraces``): a task published without
one (its publisher had no tracer) gets the context of a ``mtask.task`` span its first traced
run made (``mtask.tracing.run_span``), stored with one update fenced by the run, so that
every later run (a retry, the end of a sleep, a takeover, another worker) joins that trace."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from mtask.driver import AsyncDriver
from mtask.store.tasks import keep_trace

log = logging.getLogger(__name__)


class RunTraces:
    """Stores a task's trace context for its runs (``keep``)."""

    def __init__(self, driver: AsyncDriver) -> None:
        self.driver = driver

    async def keep(self, key: str, run_id: str, trace: Mapping[str, str]) -> None:
        """One update, fenced by run ``run_id``; a failure loses the trace's continuity (the
        next run begins another), never the run."""
        try:
            await self.driver.run(keep_trace(key, run_id, trace))
        except Exception:  # tracing never fails a run
            log.warning("the trace context of %s could not be stored", key, exc_info=True)
