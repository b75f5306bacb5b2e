"""``MtaskBackend``: a ``django.tasks`` backend on mtask.

    TASKS = {
        "default": {
            "BACKEND": "mtask.contrib.django.MtaskBackend",
            "QUEUES": ["default", "emails"],
            "OPTIONS": {"database_alias": "default"},  # or {"uri": "mongodb://…"}
        }
    }

OPTIONS: ``database_alias`` (a Django database served by ``django-mongodb-backend``: its
MongoClient is reused, so an enqueue inside ``django_mongodb_backend.transaction.atomic()``
joins its transaction) or ``uri`` (neither: ``MTASK_MONGODB_URI``); ``database`` (mtask's
database, default ``mtask``) and ``collection`` (default ``tasks``).

Priorities: Django's -100..100 are mtask's priorities as they are (both run higher first).
``run_after`` is an absolute time, compared with the server's clock when a worker claims.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from mtask.client import AsyncTaskClient, TaskClient
from mtask.contrib.django import checking
from mtask.contrib.django.compat import (
    BaseTaskBackend,
    InvalidTask,
    TaskResultDoesNotExist,
    normalize_json,
    task_enqueued,
)
from mtask.contrib.django.results import MtaskTaskResult, result_of
from mtask.contrib.django.tasks import MtaskTask, name_of
from mtask.errors import InvalidTask as MtaskInvalidTask
from mtask.models import PublishResult, TaskOptions

OPTION_NAMES = ("database_alias", "uri", "database", "collection")
SUPERSEDE = ("drop_newer", "cancel_queued", "cancel_running")


class MtaskBackend(BaseTaskBackend):  # type: ignore[misc]
    """Django's tasks on mtask (the module's docstring)."""

    task_class = MtaskTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: Mapping[str, Any]) -> None:
        super().__init__(alias, params)
        unknown = sorted(set(self.options) - set(OPTION_NAMES))
        if unknown:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']: unknown option(s) {', '.join(unknown)} "
                f"(known: {', '.join(OPTION_NAMES)})"
            )
        self.database_alias: str | None = self.options.get("database_alias")
        self.uri: str | None = self.options.get("uri")
        if self.database_alias is not None and self.uri is not None:
            raise ImproperlyConfigured(
                f"TASKS[{alias!r}]['OPTIONS']: give database_alias or uri, not both"
            )
        self.database: str = self.options.get("database", "mtask")
        self.collection: str = self.options.get("collection", "tasks")
        self._client: TaskClient | None = None
        self._lock = threading.Lock()
        self._aclients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncTaskClient] = (
            weakref.WeakKeyDictionary()
        )

    # -- clients --------------------------------------------------------------------------------

    def connection(self) -> Any:
        """The Django database connection of ``database_alias`` (this thread's)."""
        from django.db import connections

        return connections[self.database_alias]

    def client(self) -> TaskClient:
        """This process's ``TaskClient``: on the database alias's MongoClient (its sessions
        join), or on ``uri``."""
        mongo = None
        if self.database_alias is not None:
            connection = self.connection()
            connection.ensure_connection()
            mongo = connection.connection
        with self._lock:
            if self._client is None or (mongo is not None and self._client.mongo is not mongo):
                self._client = TaskClient(
                    self.uri, database=self.database, collection=self.collection, mongo_client=mongo
                )
            return self._client

    def aclient(self) -> AsyncTaskClient:
        """An ``AsyncTaskClient`` for the running event loop (pymongo's native async client;
        with ``database_alias``, one made from that database's settings)."""
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            mongo = None
            if self.database_alias is not None:
                from pymongo import AsyncMongoClient

                from mtask.connection.clients import CLIENT_OPTIONS, mend_pymongo

                mend_pymongo()  # as mtask's own async clients
                params = self.connection().get_connection_params()
                mongo = AsyncMongoClient(**{**CLIENT_OPTIONS, **params})
            client = AsyncTaskClient(
                self.uri, database=self.database, collection=self.collection, mongo_client=mongo
            )
            self._aclients[loop] = client
        return client

    def session(self) -> Any:
        """The session of the transaction ``django_mongodb_backend.transaction.atomic()`` has
        open on ``database_alias`` in this thread, else None."""
        if self.database_alias is None:
            return None
        session = getattr(self.connection(), "session", None)
        return session if session is not None and session.in_transaction else None

    # -- validation -----------------------------------------------------------------------------

    def validate_task(self, task: Any) -> None:
        super().validate_task(task)
        if isinstance(task, MtaskTask):
            check_options(task)

    # -- enqueue --------------------------------------------------------------------------------

    def enqueue(self, task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Publish ``task``; inside ``django_mongodb_backend.transaction.atomic()`` on
        ``database_alias``, in its transaction (the task exists if and only if it commits, and
        ``task_enqueued`` is sent once it has)."""
        self.validate_task(task)
        session = self.session()
        published = _publishing(
            lambda request: self.client().publish(**request, session=session),
            self._request(task, args, kwargs),
        )
        result = self._result(published, task)

        def send() -> None:
            task_enqueued.send(sender=type(self), task_result=result)

        if session is not None:
            self.connection().on_commit(send)
        else:
            send()
        return result

    async def aenqueue(self, task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``enqueue`` on the native async client; in an open ``atomic()`` block of this
        context, ``enqueue`` in it (on its thread)."""
        if self.database_alias is not None and self.connection().session is not None:
            from asgiref.sync import sync_to_async

            return await sync_to_async(self.enqueue)(task, args, kwargs)
        self.validate_task(task)
        request = self._request(task, args, kwargs)
        try:
            published = await self.aclient().publish(**request)
        except MtaskInvalidTask as exc:
            raise InvalidTask(str(exc)) from exc
        result = self._result(published, task)
        await task_enqueued.asend(sender=type(self), task_result=result)
        return result

    def _request(
        self, task: MtaskTask | Any, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        """``publish``'s keywords for an enqueue of ``task``."""
        params = {"args": normalize_json(list(args)), "kwargs": normalize_json(dict(kwargs))}
        options: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        if isinstance(task, MtaskTask):
            options.update(task.options or {})
            if task.max_retries is not None:
                options["max_retries"] = task.max_retries
            group = _resolved(task.group, args, kwargs)
            if group is not None:
                options["group"] = group
            extra = {
                "supersede": task.supersede,
                "debounce": task.debounce,
                "debounce_max": task.debounce_max,
            }
            key = _resolved(task.key, args, kwargs)
        else:
            key = None
        options["priority"] = task.priority
        if task.run_after is not None:
            options["run_at"] = _aware(task.run_after)
        return {
            "name": name_of(task.module_path, task.queue_name),
            "key": key or str(uuid.uuid4()),
            "params": params,
            "options": options,
            **{k: v for k, v in extra.items() if v is not None},
        }

    def _result(self, published: PublishResult, task: Any) -> MtaskTaskResult:
        """The enqueue's result: of ``task`` for a new task, of the task as it was enqueued for
        an existing key."""
        return result_of(published.task, self.alias, task if published.created else None)

    # -- results --------------------------------------------------------------------------------

    def get_result(self, result_id: str) -> MtaskTaskResult:
        doc = _reading(lambda: self.client().get(result_id), result_id)
        return result_of(doc, self.alias)

    async def aget_result(self, result_id: str) -> MtaskTaskResult:
        try:
            doc = await self.aclient().get(result_id)
        except MtaskInvalidTask as exc:
            raise TaskResultDoesNotExist(result_id) from exc
        if doc is None:
            raise TaskResultDoesNotExist(result_id)
        return result_of(doc, self.alias)

    # -- checks ---------------------------------------------------------------------------------

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """Its configuration always; with ``manage.py check --database …`` (Django's own
        database checks' switch) also MongoDB: a replica set reached, mtask's indexes made."""
        return checking.check(self, kwargs.get("databases"))


def check_options(task: MtaskTask) -> None:
    """``task``'s mtask options, checked as mtask checks them; Django's ``InvalidTask`` names
    what is wrong."""
    for field in ("key", "group"):
        value = getattr(task, field)
        if value is not None and not (isinstance(value, str) or callable(value)):
            raise InvalidTask(f"{field} must be a string or a callable of the task's arguments")
    if task.supersede is not None and task.supersede not in SUPERSEDE:
        raise InvalidTask(f"supersede must be one of {', '.join(SUPERSEDE)}")
    options = dict(task.options or {})
    if task.max_retries is not None:
        options["max_retries"] = task.max_retries
    from mtask.registry import Registry

    try:
        TaskOptions.model_validate(options)  # its errors: mtask's wording, below
        Registry().task(  # a handler's declarations, checked as the worker will
            "check",
            time_limit=task.time_limit,
            soft_time_limit=task.soft_time_limit,
            uses=task.uses,
            units=task.units,
        )
    except MtaskInvalidTask as exc:
        raise InvalidTask(str(exc)) from exc
    except ValueError as exc:  # pydantic's ValidationError
        raise InvalidTask(f"options: {exc}") from exc


def _resolved(value: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    return value(*args, **kwargs) if callable(value) else value


def _aware(when: Any) -> Any:
    from django.utils import timezone

    return when if timezone.is_aware(when) else timezone.make_aware(when)


def _publishing(publish: Callable[[dict[str, Any]], PublishResult], request: dict[str, Any]) -> Any:
    try:
        return publish(request)
    except MtaskInvalidTask as exc:
        raise InvalidTask(str(exc)) from exc


def _reading(get: Callable[[], Any], result_id: str) -> Any:
    try:
        doc = get()
    except MtaskInvalidTask as exc:  # not a key at all ("", too long)
        raise TaskResultDoesNotExist(result_id) from exc
    if doc is None:
        raise TaskResultDoesNotExist(result_id)
    return doc
