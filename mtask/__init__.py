"""mtask: a MongoDB-backed, multi-worker task service."""

from mtask._version import __version__
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
from mtask.models import PublishResult, Run, RunState, Task, TaskOptions, TaskStatus
from mtask.registry import Fail, Registry, Retry, TaskContext
from mtask.spawn import ChildFailed, Spawn
from mtask.step_policy import StepPolicy, StepTimeout
from mtask.worker import Worker

__all__ = [
    "AsyncTaskClient",
    "ChildFailed",
    "EmbeddedUnavailable",
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
]
