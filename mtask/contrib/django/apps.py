"""The Django app of mtask (``INSTALLED_APPS = [..., "mtask.contrib.django"]``): its
``mtask_worker`` command, and mtask's indexes made after ``migrate``."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate

_MADE: set[str] = set()
"""The task backends whose indexes this process made (once per ``migrate``)."""


def make_indexes(**kwargs: Any) -> None:
    """mtask's indexes, for every ``MtaskBackend`` of ``TASKS``: an index made while a
    transaction is open makes that transaction's snapshot unusable, so they are made ahead of
    the first enqueue in ``atomic()`` (docs/transactions.md, "Indexes")."""
    from mtask.contrib.django.backend import MtaskBackend
    from mtask.contrib.django.compat import task_backends

    for backend in task_backends.all():
        if isinstance(backend, MtaskBackend) and backend.alias not in _MADE:
            backend.client().ensure_indexes()
            _MADE.add(backend.alias)


class MtaskConfig(AppConfig):
    name = "mtask.contrib.django"
    label = "mtask"
    verbose_name = "mtask"

    def ready(self) -> None:
        post_migrate.connect(make_indexes, dispatch_uid="mtask.make_indexes")
