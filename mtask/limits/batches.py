"""Batch handlers: ``@registry.task("index", batch=100, batch_timeout=1.0)`` receives
up to ``batch`` claimed tasks of its name in one call (pure: the declaration's checks, and how a
call's answer is read back item by item; the item a handler receives, ``BatchItem``, is
``mtask.registry``'s).

Each task is still claimed, leased, fenced and recorded on its own: the batch changes only how
its handler is called (``mtask.worker.running.batches``). The handler takes one argument, the
list of ``BatchItem`` (``key``, ``params`` as stored, ``ctx``), and returns a list with one
entry per item, in order: a result, or an exception instance, which is that task's outcome as
if its own handler had raised it (``Retry``, ``Fail``, ``Snooze`` or any error: the others are
untouched). A call that raises, or returns something else, fails every task of the batch, each
by its own retry budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mtask.errors import InvalidTask

MAX_BATCH = 10_000
MAX_BATCH_TIMEOUT = 3600.0
DEFAULT_BATCH_TIMEOUT = 1.0


def check(batch: object, batch_timeout: object) -> tuple[int, float]:
    """A batch declaration's size (1 to ``MAX_BATCH``) and timeout (seconds, above 0), or
    ``InvalidTask`` naming the bad one."""
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        raise InvalidTask(f"must be an integer from 1 to {MAX_BATCH}", field="batch")
    if (
        isinstance(batch_timeout, bool)
        or not isinstance(batch_timeout, int | float)
        or not math.isfinite(batch_timeout)
        or not 0 < batch_timeout <= MAX_BATCH_TIMEOUT
    ):
        raise InvalidTask(
            f"must be a number of seconds above 0, at most {MAX_BATCH_TIMEOUT:g}",
            field="batch_timeout",
        )
    return batch, float(batch_timeout)


class BatchAnswerError(Exception):
    """A batch handler's answer is not one entry per item."""


def answers(returned: object, count: int) -> Sequence[Any]:
    """The handler's answer as one entry per item, or ``BatchAnswerError`` saying why not."""
    if not isinstance(returned, list | tuple):
        raise BatchAnswerError(
            f"a batch handler returns a list with one entry per item, not {type(returned).__name__}"
        )
    if len(returned) != count:
        raise BatchAnswerError(
            f"a batch handler returns one entry per item: {count} items, {len(returned)} entries"
        )
    return returned
