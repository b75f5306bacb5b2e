"""``mtask wait KEY [--timeout S]``: block until a task is finished, print it like ``mtask get``.

Exit status: 0 succeeded; 1 failed, cancelled or invalid, or no task has that key (as every
command, ``common.EXIT_NOT_FOUND``); 124 the timeout passed first (as coreutils' ``timeout``);
2 the command line is wrong; 3 MongoDB could not be reached. All of it rides on
``TaskClient.wait`` (one change stream, see mtask.follow.events).
"""

from __future__ import annotations

import argparse
import math
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "wait",
        help="wait until a task is finished and show it (exit 0 succeeded, 1 failed, 124 timeout)",
    )
    p.add_argument("--uri", help="MongoDB URI (default: $MTASK_MONGODB_URI, else embedded)")
    p.add_argument("--database", default="mtask", help="the database (default mtask)")
    p.add_argument("--collection", default="tasks", help="the tasks collection (default tasks)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("key", help="the task's key")
    p.add_argument(
        "--timeout", type=_seconds, metavar="S", help="give up after S seconds (default: never)"
    )


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative number of seconds: {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from mtask.cli.common import (
        EXIT_FAILED,
        EXIT_STORAGE_WAIT,
        EXIT_TIMEOUT,
        err,
        print_json,
        task_client,
    )
    from mtask.cli.render import print_task
    from mtask.errors import StorageError, WaitTimeout

    try:  # TaskNotFound: run_command's one line and EXIT_NOT_FOUND, as for every command
        with task_client(args) as client:
            task = client.wait(args.key, timeout=args.timeout)
    except WaitTimeout as exc:
        err.print(f"mtask: {exc}", markup=False)
        return EXIT_TIMEOUT
    except StorageError as exc:
        err.print(f"mtask: {exc}", markup=False)
        return EXIT_STORAGE_WAIT
    if args.json:
        print_json(task.model_dump(by_alias=True))
    else:
        print_task(task)
    return 0 if task.status == "succeeded" else EXIT_FAILED
