"""The ``mtask`` command line (and ``mtask-worker``, ``python -m mtask``).

Every command that touches tasks takes ``--uri`` (else ``MTASK_MONGODB_URI``, else the embedded
server), ``--database`` and ``--collection``. Bad input prints one clear line on stderr and exits
2; MongoDB trouble exits 1; nothing prints a traceback for a user's mistake.

**Adding a command.** Write one module ``mtask/cli/<group>.py`` that imports only
``mtask.cli.common`` (never another command module) and defines::

    commands = Commands()
    run = commands.run                      # (args) -> exit status

    @commands.command("wait")
    def cmd_wait(args): ...

    def register(sub):                      # sub: the parser's subparsers action
        p = sub.add_parser("wait", help="…")
        add_common(p)                       # --uri, --database, --collection, --json

then add ``(group.register, group.run)`` to ``command_modules`` below and its commands to
``MODULE_COMMANDS`` (a test says so if not).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mtask._version import __version__
from mtask.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    EXTRAS,
    Commands,
    Handler,
    err,
    missing_extra,
)
from mtask.errors import (
    InvalidTask,
    MtaskError,
    ScheduleNotFound,
    TaskNotFound,
    TriggerNotFound,
    UsageError,
    WorkerNotFound,
)

Register = Callable[[Any], None]
CommandModule = tuple[Register, Handler]

_builtin = Commands()


@_builtin.command("completion")
def cmd_completion(args: argparse.Namespace) -> int:
    from mtask.cli.common import require

    require("mtask completion", "shtab")
    import shtab

    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return 0


def _register_builtin(sub: Any) -> None:
    p = sub.add_parser("completion", help="print a shell completion script")
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell to complete for")


MODULE_COMMANDS = {
    "tasks": ("publish", "get", "list", "stats", "cancel", "retry", "workers", "pause", "resume"),
    "wait": ("wait",),
    "logs": ("logs",),
    "signal": ("signal",),
    "step": ("step", "steps"),
    "worker": ("worker",),
    "scheduling": ("limit", "limits", "schedule", "flow"),
    "budgets": ("usage", "budget"),
    "triggers": ("triggers",),
    "retention": ("purge", "retention"),
    "live": ("top",),
    "server": ("serve",),
    "local": ("demo", "mongod"),
    "collection": ("collection",),
}
"""The commands each module registers: ``main`` imports and builds the module of the command
it is given alone (``mtask get``: ``tasks``; the command line's start-up). Written
from the parsers and kept true by ``tests/unit/test_lazy_imports.py``; a command missing here
still runs, with every module's parser."""
_MODULE_OF = {command: module for module, names in MODULE_COMMANDS.items() for command in names}


def command_modules(command: str | None = None) -> list[CommandModule]:
    """The command modules, in the order of ``mtask --help``: (register, run) each; with a
    ``command`` that ``MODULE_COMMANDS`` places, its module alone. Imported when the parser is
    built, not with this package: ``mtask-worker`` loads ``mtask.cli.worker`` alone (a
    worker's start-up)."""
    if command in _MODULE_OF:
        module = importlib.import_module(f"mtask.cli.{_MODULE_OF[command]}")
        return [(module.register, module.run)]
    from mtask.cli import (
        budgets,
        collection,
        live,
        local,
        logs,
        retention,
        scheduling,
        server,
        signal,
        step,
        tasks,
        triggers,
        wait,
        worker,
    )

    return [
        (tasks.register, tasks.run),
        (wait.register, wait.run),  # mtask wait
        (logs.register, logs.run),  # mtask logs
        (signal.register, signal.run),  # mtask signal
        (step.register, step.run),  # mtask step reset
        (worker.register, worker.run),
        (scheduling.register, scheduling.run),
        (budgets.register, budgets.run),  # mtask usage, mtask budget
        (triggers.register, triggers.run),  # mtask triggers
        (retention.register, retention.run),
        (live.register, live.run),
        (server.register, server.run),
        (_register_builtin, _builtin.run),
        (local.register, local.run),
        (collection.register, collection.run),
    ]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or, given the ``command`` a line starts with, of its
    module's commands (``command_modules``: what ``main`` parses a command line with)."""
    parser = argparse.ArgumentParser(prog="mtask", description="MongoDB-backed task service.")
    parser.add_argument("--version", action="version", version=f"mtask {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register, run in command_modules(command):
        before = set(sub.choices)
        register(sub)
        for name in set(sub.choices) - before:
            sub.choices[name].set_defaults(run=run)
    return parser


def run_command(handler: Handler, args: argparse.Namespace) -> int:
    """Run a handler, turning mtask's errors into one line on stderr and an exit status."""
    try:
        return handler(args)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in EXTRAS:
            raise
        message = missing_extra(f"mtask {args.command}", exc.name.partition(".")[0])
        err.print(f"mtask: error: {message}", markup=False)
        return EXIT_USAGE
    except (UsageError, InvalidTask) as exc:
        err.print(f"mtask: error: {exc}", markup=False)
        return EXIT_USAGE
    except (TaskNotFound, ScheduleNotFound, TriggerNotFound, WorkerNotFound) as exc:
        err.print(f"mtask: {exc}", markup=False)
        return EXIT_NOT_FOUND
    except MtaskError as exc:  # InvalidTransition, StorageError, …
        err.print(f"mtask: {exc}", markup=False)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """``mtask``: with ``argv`` None, the process's own command line (then the process ends
    without waiting for the driver's threads: ``exit_unhindered``)."""
    line = hoisted(list(sys.argv[1:] if argv is None else argv))
    args = build_parser(line[0] if line else None).parse_args(line)
    status = run_command(args.run, args)
    if argv is None:
        exit_unhindered()
    return status


SHARED_OPTIONS = {"--uri": True, "--database": True, "--collection": True, "--json": False}
"""The options every command that reads or writes tasks takes (``common.add_common``), each
with whether it takes a value: given before the command (``mtask --uri X stats``, as
``kubectl -n x get`` reads), they are read as the command's."""


def hoisted(line: list[str]) -> list[str]:
    """``--uri X stats`` read as ``stats --uri X``: the shared options given before the
    command moved after it (a command that does not take one says so, as for any option)."""
    leading: list[str] = []
    rest = list(line)
    while rest and rest[0].split("=", 1)[0] in SHARED_OPTIONS:
        option = rest.pop(0)
        leading.append(option)
        if SHARED_OPTIONS[option.split("=", 1)[0]] and "=" not in option and rest:
            leading.append(rest.pop(0))
    if not leading or not rest:
        return line
    return [rest[0], *leading, *rest[1:]]


def worker_main(argv: Sequence[str] | None = None) -> int:
    """``mtask-worker`` (the same as ``mtask worker run``)."""
    from mtask.cli import worker

    status = worker.main(argv)
    if argv is None:
        exit_unhindered()
    return status


def exit_unhindered() -> None:
    """Once a command has ended (its clients closed), its process exits without PyMongo's
    exit hook, which joins each of the driver's monitor threads: daemon threads that sleep
    half a second at a time and notice the close only when they wake, so the hook added up
    to 0.5 s to every command (measured with ``bench/startup.py``). Every other
    exit hook runs (logging, an OpenTelemetry SDK's export). Nor do the collector's last passes
    walk everything the process loaded (its modules, pydantic's validators): it is frozen
    (``gc.freeze``), and the interpreter's final collections skip it (they were about a sixth
    of ``mtask get``'s CPU). A command has closed what it opened (its clients) by then."""
    gc.freeze()
    monitor = sys.modules.get("pymongo.synchronous.monitor")
    hook = getattr(monitor, "_shutdown_resources", None)
    if hook is not None:
        atexit.unregister(hook)


__all__ = [
    "MODULE_COMMANDS",
    "build_parser",
    "command_modules",
    "exit_unhindered",
    "main",
    "run_command",
    "worker_main",
]
