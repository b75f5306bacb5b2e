"""mtask: a MongoDB-backed, multi-worker task service."""

from mtask.client import AsyncTaskClient, TaskClient
from mtask.errors import (
    EmbeddedUnavailable,
    InvalidTask,
    InvalidTransition,
    LeaseLost,
    MtaskError,
    StorageError,
    TaskNotFound,
)
from mtask.models import PublishResult, Run, RunState, Task, TaskOptions, TaskStatus

__version__ = "0.1.0"

__all__ = [
    "AsyncTaskClient",
    "EmbeddedUnavailable",
    "InvalidTask",
    "InvalidTransition",
    "LeaseLost",
    "MtaskError",
    "PublishResult",
    "Run",
    "RunState",
    "StorageError",
    "Task",
    "TaskClient",
    "TaskNotFound",
    "TaskOptions",
    "TaskStatus",
    "__version__",
]
