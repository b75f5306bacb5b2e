"""A task document as Django's ``TaskResult`` (``MtaskTaskResult``), and what a run's outcome
makes of the one a worker's handler holds.

Statuses: ``pending`` is READY (enqueued, or waiting for its next attempt), ``running``
RUNNING, ``succeeded`` SUCCESSFUL, ``failed``, ``cancelled`` and ``invalid`` FAILED; mtask's
own status is kept beside it (``mtask_status``: Django has no cancelled). One worker id per
run, so ``attempts`` counts runs (the runs the document keeps: it folds the oldest of a task
run very many times). ``errors``: one per failed run, its exception's class (``error_class``,
recorded by the worker) and its traceback; a run that raised nothing (its lease ran out, a
time limit, a result that could not be stored) names ``mtask.errors.LeaseLost`` or
``mtask.errors.MtaskError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.utils.module_loading import import_string

from mtask.contrib.django.compat import (
    TASK_REFRESH_ATTRS,
    InvalidTask,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
)
from mtask.contrib.django.tasks import parse_name
from mtask.models import Run
from mtask.models import Task as MtaskDocument
from mtask.vocabulary import RunState, TaskStatus

STATUSES = {
    TaskStatus.PENDING: TaskResultStatus.READY,
    TaskStatus.RUNNING: TaskResultStatus.RUNNING,
    TaskStatus.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    TaskStatus.FAILED: TaskResultStatus.FAILED,
    TaskStatus.CANCELLED: TaskResultStatus.FAILED,
    TaskStatus.INVALID: TaskResultStatus.FAILED,
}
NO_CLASS = {
    RunState.TIMEOUT: "mtask.errors.LeaseLost",
    RunState.FAIL: "mtask.errors.MtaskError",
}
"""The class an error names for a run that raised none."""
MIN_PRIORITY, MAX_PRIORITY = -100, 100


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MtaskTaskResult(TaskResult):  # type: ignore[misc]
    """Django's ``TaskResult`` with mtask's own status beside it."""

    mtask_status: str = ""
    """``pending``, ``running``, ``succeeded``, ``failed``, ``cancelled`` or ``invalid``."""

    def refresh(self) -> None:
        """Read the task again (Django's ``refresh``, ``mtask_status`` too)."""
        self._take(self.task.get_backend().get_result(self.id))

    async def arefresh(self) -> None:
        self._take(await self.task.get_backend().aget_result(self.id))

    def _take(self, fresh: MtaskTaskResult) -> None:
        for attr in (*TASK_REFRESH_ATTRS, "mtask_status"):
            object.__setattr__(self, attr, getattr(fresh, attr))


def django_task(name: str, doc: MtaskDocument, alias: str) -> Any:
    """The Django task a document of ``name`` was enqueued as: the module path's task, on the
    queue, priority and run_after the document holds."""
    queue, path = parse_name(name)
    try:
        declared = import_string(path)
    except ImportError as exc:
        raise TaskResultDoesNotExist(f"{doc.key}: its task {path} cannot be imported") from exc
    if not isinstance(declared, Task):
        raise TaskResultDoesNotExist(f"{doc.key}: {path} is not a task")
    priority = min(MAX_PRIORITY, max(MIN_PRIORITY, doc.options.priority or 0))
    changes: dict[str, Any] = {"queue_name": queue, "priority": priority, "backend": alias}
    run_at = doc.options.run_at
    if run_at is not None:
        changes["run_after"] = run_at
    try:
        return Task.using(declared, **changes)
    except InvalidTask as exc:  # e.g. a queue no longer in the backend's QUEUES
        raise TaskResultDoesNotExist(f"{doc.key}: {exc}") from exc


def errors_of(runs: list[Run]) -> list[Any]:
    return [
        TaskError(
            exception_class_path=run.error_class or NO_CLASS[run.state],
            traceback=run.error or "",
        )
        for run in runs
        if run.state in NO_CLASS
    ]


def result_of(doc: MtaskDocument, alias: str, task: Any = None) -> MtaskTaskResult:
    """Django's ``TaskResult`` of a task document (the module's docstring); ``task``: the
    Django task it is of, if known (else found by its module path)."""
    if doc.name is None or doc.status is None:
        raise TaskResultDoesNotExist(f"{doc.key}: not a task document")
    params = doc.params or {}
    runs = doc.runs
    status = STATUSES[doc.status]
    result = MtaskTaskResult(
        task=task if task is not None else django_task(doc.name, doc, alias),
        id=doc.key,
        status=status,
        enqueued_at=doc.created_at,
        started_at=runs[0].claimed_at if runs else None,
        last_attempted_at=runs[-1].claimed_at if runs else None,
        finished_at=doc.finished_at if doc.status.finished else None,
        args=list(params.get("args", [])),
        kwargs=dict(params.get("kwargs", {})),
        backend=alias,
        errors=errors_of(runs),
        worker_ids=[run.worker_id for run in runs],
        mtask_status=doc.status.value,
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", doc.result)
    return result


def finished(
    started: MtaskTaskResult,
    now: Any,
    value: Any = None,
    error: BaseException | None = None,
    retried: bool = False,
) -> MtaskTaskResult:
    """The result a run's handler ends with, as ``task_finished`` tells it (before the worker
    records it): SUCCESSFUL with ``value``, or FAILED with ``error`` added (``retried``: the
    task has retries left, its ``mtask_status`` is ``pending`` again)."""
    if error is None:
        done: MtaskTaskResult = _replace(
            started, status=TaskResultStatus.SUCCESSFUL, finished_at=now, mtask_status="succeeded"
        )
        object.__setattr__(done, "_return_value", value)
        return done
    import traceback

    kind = type(error)
    raised = TaskError(
        exception_class_path=f"{kind.__module__}.{kind.__qualname__}",
        traceback="".join(traceback.format_exception(error)),
    )
    return _replace(
        started,
        status=TaskResultStatus.FAILED,
        finished_at=now,
        errors=[*started.errors, raised],
        mtask_status="pending" if retried else "failed",
    )


def _replace(result: MtaskTaskResult, **changes: Any) -> MtaskTaskResult:
    """``dataclasses.replace`` of a result (its fields are Django's: mypy sees them as Any)."""
    replaced: MtaskTaskResult = dataclasses.replace(result, **changes)
    return replaced
