"""Benchmark W1T: the W1 drain with a transactional no-op handler (docs/transactions.md).

The handler writes nothing itself, so the figure is what mtask's transactional completion
costs per task against the plain W1 drain: a session, ``startTransaction``, the fenced SUCCESS
as one ``find_one_and_update`` with the general pipeline (plain SUCCESSes are grouped into one
``update_many`` per batch), and a ``commitTransaction`` with majority write concern — one more
round trip and one more majority wait per task, none of them shared between tasks.
"""

from __future__ import annotations

from typing import Any

from mtask.registry import Registry, TaskContext

TASK = "txn_noop"


async def txn_noop(params: dict[str, Any], ctx: TaskContext) -> None:
    return None


def register(registry: Registry) -> None:
    registry.task(TASK, transactional=True)(txn_noop)


def summary(rate: float, w0: float, w1: float | None, n: int) -> tuple[str, str, dict[str, float]]:
    """The figure, the notes and the values of the W1T result."""
    ratio = rate / w0 if w0 else 0.0
    versus = rate / w1 if w1 else 0.0
    figure = f"{rate:,.0f} tasks/s = {ratio:.1%} of W0" + (f", {versus:.1%} of W1" if w1 else "")
    notes = (
        f"{n:,} transactional no-op tasks, one mtask-worker process, concurrency 64; each "
        "SUCCESS is its own fenced update and majority commit (no grouping across tasks)"
    )
    return figure, notes, {"per_s": rate, "ratio": ratio, "of_w1": versus}
