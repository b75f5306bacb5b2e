"""mtask for Django: ``MtaskBackend``, a backend of Django's built-in tasks (``django.tasks``;
the ``django-tasks`` backport on Django 5.2), ``manage.py mtask_worker`` (add
``"mtask.contrib.django"`` to ``INSTALLED_APPS``) and the dashboard under a prefix of the
project's URLs for staff (``mtask.contrib.django.asgi``). docs/integrations.md, "Django".

The names are imported on first use: ``INSTALLED_APPS`` loads this package before the
settings are ready."""

from __future__ import annotations

from mtask._version import lazy_exports

_WHERE = {
    "mtask.contrib.django.backend": ("MtaskBackend",),
    "mtask.contrib.django.tasks": ("MtaskTask",),
    "mtask.contrib.django.results": ("MtaskTaskResult",),
}
__getattr__, __dir__ = lazy_exports("mtask.contrib.django", _WHERE, globals())
__all__ = ["MtaskBackend", "MtaskTask", "MtaskTaskResult"]
