"""Integrations with the frameworks Python's MongoDB users already run (docs/integrations.md).

- ``mtask.contrib.django``: a backend for Django's built-in tasks (``django.tasks``, and the
  ``django-tasks`` backport on Django 5.2), its worker command and the dashboard in a Django
  project's URLs;
- ``mtask.contrib.fastapi``: a lifespan that opens a client (and, if asked, a worker), a
  dependency that hands the client to a route, and the REST API, SSE and dashboard as a router.

Nothing here is imported by mtask itself: each module needs its framework (the ``django`` and
``fastapi`` extras).
"""
