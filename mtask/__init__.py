"""mtask: a MongoDB-backed, multi-worker task service.

The public names are imported on first use (PEP 562): ``import mtask`` costs nothing, ``from
mtask import Registry`` loads the registry's modules only, and ``mtask`` (the command line) or a
client never loads the worker's code (``tests/unit/test_lazy_imports.py`` keeps it so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtask._version import __version__, lazy_exports

if TYPE_CHECKING:
    from mtask.client import AsyncTaskClient, TaskClient
    from mtask.errors import (
        EmbeddedUnavailable,
        InvalidTask,
        InvalidTransition,
        LeaseLost,
        MtaskError,
        StorageError,
        TaskNotFound,
        WorkerCrashed,
    )
    from mtask.flows import Next
    from mtask.limits.holds import BackOff
    from mtask.limits.snooze import Snooze
    from mtask.models import PublishResult, Run, Task, TaskOptions
    from mtask.registry import BatchItem, BudgetExceeded, Fail, Registry, Retry, TaskContext
    from mtask.security.encryption import Encryption, rotate_local
    from mtask.steps.children import ChildFailed, Spawn
    from mtask.steps.policy import StepPolicy, StepTimeout
    from mtask.vocabulary import RunState, TaskStatus
    from mtask.worker import Worker


_WHERE = {
    "mtask.limits.holds": ("BackOff",),
    "mtask.client": ("AsyncTaskClient", "TaskClient"),
    "mtask.errors": (
        "EmbeddedUnavailable",
        "InvalidTask",
        "InvalidTransition",
        "LeaseLost",
        "MtaskError",
        "StorageError",
        "TaskNotFound",
        "WorkerCrashed",
    ),
    "mtask.flows": ("Next",),
    "mtask.models": ("PublishResult", "Run", "Task", "TaskOptions"),
    "mtask.vocabulary": ("RunState", "TaskStatus"),
    "mtask.registry": ("BatchItem", "BudgetExceeded", "Fail", "Registry", "Retry", "TaskContext"),
    "mtask.security.encryption": ("Encryption", "rotate_local"),
    "mtask.limits.snooze": ("Snooze",),
    "mtask.steps.children": ("ChildFailed", "Spawn"),
    "mtask.steps.policy": ("StepPolicy", "StepTimeout"),
    "mtask.worker": ("Worker",),
}
__getattr__, __dir__ = lazy_exports("mtask", _WHERE, globals())


__all__ = [
    "AsyncTaskClient",
    "BackOff",
    "BatchItem",
    "BudgetExceeded",
    "ChildFailed",
    "EmbeddedUnavailable",
    "Encryption",
    "Fail",
    "InvalidTask",
    "InvalidTransition",
    "LeaseLost",
    "MtaskError",
    "Next",
    "PublishResult",
    "Registry",
    "Retry",
    "Run",
    "RunState",
    "Snooze",
    "Spawn",
    "StepPolicy",
    "StepTimeout",
    "StorageError",
    "Task",
    "TaskClient",
    "TaskContext",
    "TaskNotFound",
    "TaskOptions",
    "TaskStatus",
    "Worker",
    "WorkerCrashed",
    "__version__",
    "rotate_local",
]
