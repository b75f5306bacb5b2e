"""``MtaskBackend.check``: Django system checks of the backend.

Always: ``database_alias`` names a configured database served by ``django-mongodb-backend``.
With databases to check (``manage.py check --database default``, the switch of Django's own
checks that touch a database): MongoDB is reached, is a replica set (transactions and change
streams need one), and the tasks collection has mtask's indexes (``manage.py migrate`` or a
worker's start makes them).
"""

from __future__ import annotations

from typing import Any, Protocol

from django.core import checks

from mtask.client import TaskClient


class Backend(Protocol):
    """What the checks read of a backend (``MtaskBackend``)."""

    alias: str
    database_alias: str | None

    def client(self) -> TaskClient: ...


ID = "mtask"


def check(backend: Backend, databases: Any) -> list[checks.CheckMessage]:
    found = _alias(backend)
    if found or not databases:
        return found
    return _server(backend)


def _alias(backend: Backend) -> list[checks.CheckMessage]:
    alias = backend.database_alias
    if alias is None:
        return []
    from django.conf import settings

    where = f"TASKS[{backend.alias!r}]['OPTIONS']['database_alias']"
    if alias not in settings.DATABASES:
        return [checks.Error(f"{where}: no database {alias!r} in DATABASES", id=f"{ID}.E001")]
    engine = settings.DATABASES[alias].get("ENGINE", "")
    if engine != "django_mongodb_backend":
        return [
            checks.Error(
                f"{where}: database {alias!r} is not a MongoDB one (ENGINE {engine!r})",
                hint="use ENGINE 'django_mongodb_backend', or give OPTIONS a 'uri' instead",
                id=f"{ID}.E002",
            )
        ]
    return []


def _server(backend: Backend) -> list[checks.CheckMessage]:
    try:
        client = backend.client()
        hello = client.mongo.admin.command("hello")
        indexes = client.collection.index_information()
    except Exception as exc:  # noqa: BLE001 - whatever stops it, said as a check
        return [checks.Error(f"MongoDB cannot be reached: {exc}", id=f"{ID}.E003")]
    found: list[checks.CheckMessage] = []
    if "setName" not in hello:
        found.append(
            checks.Error(
                "MongoDB is not a replica set: mtask needs one (transactions, change streams)",
                hint="a single server can be a one-member replica set (docs/deploy.md)",
                id=f"{ID}.E004",
            )
        )
    if len(indexes) <= 1:
        found.append(
            checks.Warning(
                f"{client.database_name}.{client.collection.name} has no mtask index yet",
                hint="run manage.py migrate (or start manage.py mtask_worker) before the first "
                "enqueue in a transaction",
                id=f"{ID}.W001",
            )
        )
    return found
