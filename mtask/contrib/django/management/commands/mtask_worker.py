"""``manage.py mtask_worker``: an mtask worker for this project's tasks (``--queue``, repeated:
the queues it serves, all of the backend's by default), with mtask's worker options
(``mtask-worker --help``, but the registry and the connection: those come from ``TASKS``).
SIGTERM drains (the runs in flight finish within ``--grace``); a second signal stops at once."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from mtask.cli.worker import add_run_options, run_worker


class Command(BaseCommand):
    help = "Run an mtask worker for this project's tasks (docs/integrations.md, Django)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--backend", default="default", help="the TASKS alias of an MtaskBackend (default)"
        )
        parser.add_argument(
            "--queue",
            action="append",
            dest="queues",
            metavar="QUEUE",
            help="a queue to serve (repeat it; default: every queue of the backend's QUEUES)",
        )
        add_run_options(parser, names=False)

    def handle(self, *args: Any, **options: Any) -> None:
        from mtask.contrib.django.backend import MtaskBackend
        from mtask.contrib.django.compat import DEFAULT_TASK_QUEUE_NAME, task_backends
        from mtask.contrib.django.worker import build_worker, uri_of

        try:
            backend = task_backends[options["backend"]]
        except Exception as exc:  # noqa: BLE001 - Django's InvalidTaskBackend, said plainly
            raise CommandError(f"--backend: {exc}", returncode=2) from None
        if not isinstance(backend, MtaskBackend):
            raise CommandError(f"--backend {options['backend']}: not an MtaskBackend", returncode=2)
        served = sorted(backend.queues or {DEFAULT_TASK_QUEUE_NAME})
        queues = options["queues"] or served
        unknown = sorted(set(queues) - set(served))
        if unknown and backend.queues:
            raise CommandError(
                f"--queue: {', '.join(unknown)} not in the backend's QUEUES ({', '.join(served)})",
                returncode=2,
            )
        if options["pool"] == "process":
            raise CommandError(
                "--pool process: not for Django tasks (their handlers are made at start-up); "
                "use threads, or async def tasks",
                returncode=2,
            )
        namespace = argparse.Namespace(
            **options, uri=uri_of(backend), database=backend.database,
            collection=backend.collection,
        )  # fmt: skip
        status = run_worker(
            namespace, build=lambda a: build_worker(backend, queues, a), prog="mtask_worker"
        )
        if status:
            raise SystemExit(status)
