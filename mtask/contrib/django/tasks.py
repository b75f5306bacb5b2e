"""``MtaskTask``: Django's ``Task`` with mtask's own options, and the names its tasks have in
mtask.

``MtaskBackend.task_class`` is this class, so ``@task(...)`` of ``django.tasks`` (Django 6.1
forwards its extra keywords to the task class) and ``MtaskTask.using(...)`` (any version) take:

- publish options: ``key`` (the idempotency key: a string, or a callable of the enqueue's
  arguments returning one; an enqueue of an existing key returns the existing task's result),
  ``group`` (the fairness group, a string or a callable likewise), ``max_retries``,
  ``supersede`` (``drop_newer``, ``cancel_queued``, ``cancel_running``), ``debounce`` and
  ``debounce_max`` (seconds), and ``options`` (any other ``mtask.TaskOptions`` field);
- handler declarations, at ``@task`` only (the worker registers them once): ``time_limit``
  and ``soft_time_limit`` (seconds), ``uses`` (shared resources) and ``units``.

A task's mtask name is its module path (``shop.tasks.ship``) on Django's default queue and
``<queue>:<module path>`` on any other: a queue is part of the name, so a worker claims the
tasks of its queues only (``mtask.contrib.django.worker``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mtask.contrib.django.compat import DEFAULT_TASK_QUEUE_NAME, Task

PUBLISH_OPTIONS = (
    "key",
    "group",
    "max_retries",
    "supersede",
    "debounce",
    "debounce_max",
    "options",
)
"""What ``MtaskTask.using`` may change per enqueue."""
HANDLER_OPTIONS = ("time_limit", "soft_time_limit", "uses", "units")
"""What a worker declares once per task (``@task`` only)."""

KNOWN: dict[str, MtaskTask] = {}
"""Every ``MtaskTask`` declared in this process, by module path (the first made of each: the
``@task``-decorated one); the worker registers them."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MtaskTask(Task):  # type: ignore[misc]
    """Django's ``Task`` with mtask's options (the module's docstring)."""

    key: str | Callable[..., str] | None = None
    group: str | Callable[..., str] | None = None
    max_retries: int | None = None
    supersede: str | None = None
    debounce: float | None = None
    debounce_max: float | None = None
    options: Mapping[str, Any] | None = None
    time_limit: float | None = None
    soft_time_limit: float | None = None
    uses: Sequence[str] = ()
    units: int = 1

    def __post_init__(self) -> None:
        Task.__post_init__(self)  # the backend's validate_task
        KNOWN.setdefault(self.module_path, self)

    def using(  # type: ignore[override]
        self,
        *,
        priority: int | None = None,
        queue_name: str | None = None,
        run_after: Any = None,
        backend: str | None = None,
        **mtask: Any,
    ) -> MtaskTask:
        """Django's ``using`` (priority, queue, run_after, backend), and mtask's publish
        options (``PUBLISH_OPTIONS``): ``ship.using(key=f"ship-{order.pk}").enqueue(order.pk)``."""
        unknown = sorted(set(mtask) - set(PUBLISH_OPTIONS))
        if unknown:
            raise TypeError(
                f"using() got option(s) it does not take: {', '.join(unknown)} (per enqueue: "
                f"{', '.join(PUBLISH_OPTIONS)}; {', '.join(HANDLER_OPTIONS)} at @task only)"
            )
        task = Task.using(
            self, priority=priority, queue_name=queue_name, run_after=run_after, backend=backend
        )
        return dataclasses.replace(task, **mtask) if mtask else task  # type: ignore[no-any-return]


def name_of(module_path: str, queue: str) -> str:
    """A task's mtask name (the module's docstring)."""
    return module_path if queue == DEFAULT_TASK_QUEUE_NAME else f"{queue}:{module_path}"


def parse_name(name: str) -> tuple[str, str]:
    """``(queue, module path)`` of an mtask name ``name_of`` made (a module path has no
    ``:``)."""
    queue, sep, path = name.rpartition(":")
    return (queue if sep else DEFAULT_TASK_QUEUE_NAME), path
