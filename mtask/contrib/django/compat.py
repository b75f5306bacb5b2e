"""Django's tasks framework, wherever it comes from: ``django.tasks`` (Django 6.0 and later, on
Python 3.12+) or the ``django-tasks`` backport (``django_tasks``, on Django 5.2: Python 3.11).
Both have the same classes (DEP 14); the backport names one exception differently. The rest of
``mtask.contrib.django`` imports them from here only."""

from __future__ import annotations

from typing import Any

try:
    from django.tasks import (
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        default_task_backend,
        task_backends,
    )
    from django.tasks import signals as task_signals
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TASK_REFRESH_ATTRS, TaskError
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.utils.json import normalize_json

    SOURCE = "django.tasks"
except ImportError:  # Django 5.2: the backport
    from django_tasks import (  # type: ignore[no-redef]
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_QUEUE_NAME,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        default_task_backend,
        task_backends,
    )
    from django_tasks import signals as task_signals  # type: ignore[no-redef]
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[no-redef]
    from django_tasks.base import (  # type: ignore[no-redef]
        TASK_REFRESH_ATTRS,
        Task,
        TaskError,
    )
    from django_tasks.exceptions import (  # type: ignore[no-redef]
        InvalidTaskError as InvalidTask,
    )
    from django_tasks.exceptions import TaskResultDoesNotExist  # type: ignore[no-redef]
    from django_tasks.utils import normalize_json  # type: ignore[no-redef]

    SOURCE = "django_tasks"

task_enqueued: Any = task_signals.task_enqueued
task_started: Any = task_signals.task_started
task_finished: Any = task_signals.task_finished

__all__ = [
    "DEFAULT_TASK_BACKEND_ALIAS",
    "DEFAULT_TASK_QUEUE_NAME",
    "SOURCE",
    "TASK_REFRESH_ATTRS",
    "BaseTaskBackend",
    "InvalidTask",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultStatus",
    "default_task_backend",
    "normalize_json",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]
