"""The worker of a Django project's tasks (``manage.py mtask_worker``): the tasks of
``INSTALLED_APPS`` found, each registered under its mtask name on each queue the worker
serves, and run with Django's signals.

Found: every ``tasks`` module of ``INSTALLED_APPS`` is imported (as Celery's
``autodiscover_tasks`` does), and every ``MtaskTask`` of the backend declared by then (in those
modules, models, anywhere ``django.setup()`` imported) is registered. A queue is a claim
filter: the worker registers ``name_of(path, queue)`` for its queues only, so it never claims
another queue's task.

A run of a plain function runs on a thread (a new one per run: Django's database connections
are per thread, and closed at the run's end), an ``async def`` on the worker's event loop.
Each run reads its task once (``task_started``'s ``TaskResult``, the ``TaskContext`` of a task
that ``takes_context``); ``task_finished`` is sent when the function returns or raises, before
the worker records the outcome (inside the ``except``, so Django's logging has the traceback).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from mtask.contrib.django.compat import (
    TaskContext,
    normalize_json,
    task_finished,
    task_started,
)
from mtask.contrib.django.results import MtaskTaskResult, finished, result_of
from mtask.contrib.django.tasks import KNOWN, MtaskTask, name_of
from mtask.errors import ConfigError
from mtask.registry import Registry
from mtask.registry import TaskContext as RunContext

if TYPE_CHECKING:
    from mtask.contrib.django.backend import MtaskBackend
    from mtask.models import Task as MtaskDocument
    from mtask.worker import Worker


def discover() -> None:
    """Import every ``tasks`` module of ``INSTALLED_APPS`` (those that have one)."""
    from django.utils.module_loading import autodiscover_modules

    autodiscover_modules("tasks")


def tasks_of(backend: MtaskBackend) -> list[MtaskTask]:
    """The backend's tasks declared in this process, by module path."""
    discover()
    return [task for _, task in sorted(KNOWN.items()) if task.backend == backend.alias]


def build_registry(backend: MtaskBackend, queues: Sequence[str]) -> Registry:
    """A registry of the backend's tasks on ``queues`` (``ConfigError`` if there is none)."""
    registry = Registry()
    for task in tasks_of(backend):
        for queue in queues:
            registry.task(
                name_of(task.module_path, queue),
                time_limit=task.time_limit,
                soft_time_limit=task.soft_time_limit,
                uses=task.uses,
                units=task.units,
            )(handler(backend, task))
    if not registry.names:
        raise ConfigError(
            f"no task of backend {backend.alias!r} found: declare them with @task in a tasks "
            "module of an installed app",
            field="queues",
        )
    return registry


def handler(backend: MtaskBackend, task: MtaskTask) -> Callable[..., Any]:
    """The mtask handler of a Django task: an ``async def`` for a coroutine function."""
    import inspect

    sender = type(backend)

    if inspect.iscoroutinefunction(task.func):

        async def run_async(params: dict[str, Any], ctx: RunContext) -> Any:
            client = backend.aclient()
            doc = await client.get(ctx.key)
            started = _started(doc, backend, task)
            await task_started.asend(sender=sender, task_result=started)
            args, kwargs = _arguments(task, started, params)
            try:
                value = normalize_json(await task.func(*args, **kwargs))
            except BaseException as exc:
                ended = finished(started, await client.now(), error=exc, retried=_retried(doc))
                await task_finished.asend(sender=sender, task_result=ended)
                raise
            ended = finished(started, await client.now(), value)
            await task_finished.asend(sender=sender, task_result=ended)
            return value

        return run_async

    def run(params: dict[str, Any], ctx: RunContext) -> Any:
        from django.db import close_old_connections, connections

        close_old_connections()
        try:
            client = backend.client()
            doc = client.get(ctx.key)
            started = _started(doc, backend, task)
            task_started.send(sender=sender, task_result=started)
            args, kwargs = _arguments(task, started, params)
            try:
                value = normalize_json(task.func(*args, **kwargs))
            except BaseException as exc:
                ended = finished(started, client.now(), error=exc, retried=_retried(doc))
                task_finished.send(sender=sender, task_result=ended)
                raise
            task_finished.send(sender=sender, task_result=finished(started, client.now(), value))
            return value
        finally:
            connections.close_all()  # this run's thread ends with it

    return run


def _started(doc: MtaskDocument | None, backend: MtaskBackend, task: MtaskTask) -> MtaskTaskResult:
    if doc is None:  # purged between its claim and this read
        raise ConfigError("the task document is gone", field="key")
    return result_of(doc, backend.alias, task)


def _retried(doc: MtaskDocument | None) -> bool:
    """Whether a failure of this run leaves the task retries (it will be READY again)."""
    if doc is None:
        return False
    limit = doc.options.max_retries
    return limit is not None and (doc.failures or 0) + 1 <= limit


def _arguments(
    task: MtaskTask, started: MtaskTaskResult, params: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    args = list(params.get("args", []))
    if task.takes_context:
        args.insert(0, TaskContext(task_result=started))
    return args, dict(params.get("kwargs", {}))


def uri_of(backend: MtaskBackend) -> str | None:
    """The MongoDB URI of the backend's worker: ``uri``, or the database alias's settings
    (``HOST`` a URI or a host, ``PORT``, ``USER``, ``PASSWORD``, ``OPTIONS`` as URI options)."""
    if backend.database_alias is None:
        return backend.uri
    from django.conf import settings

    given = settings.DATABASES[backend.database_alias]
    host = given.get("HOST") or "localhost"
    if not host.startswith(("mongodb://", "mongodb+srv://")):
        port = given.get("PORT")
        host = f"mongodb://{host}{f':{port}' if port else ''}/"
    scheme, _, rest = host.partition("://")
    user = given.get("USER")
    if user and "@" not in rest.partition("/")[0]:
        password = given.get("PASSWORD") or ""
        rest = f"{quote(user, safe='')}:{quote(password, safe='')}@{rest}"
    options = {
        k: (str(v).lower() if isinstance(v, bool) else v)
        for k, v in (given.get("OPTIONS") or {}).items()
        if isinstance(v, str | int | float | bool)
    }
    if options:
        if "/" not in rest:
            rest += "/"
        rest += ("&" if "?" in rest else "?") + urlencode(options)
    return f"{scheme}://{rest}"


def build_worker(backend: MtaskBackend, queues: Sequence[str], args: argparse.Namespace) -> Worker:
    """The worker ``manage.py mtask_worker`` runs."""
    from mtask.cli.worker import run_settings
    from mtask.worker import Worker

    return Worker(
        build_registry(backend, queues),
        uri=uri_of(backend),
        database=backend.database,
        collection=backend.collection,
        **run_settings(args),
    )
