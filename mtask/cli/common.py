"""What every command module shares: the consoles, the shared options (declared once here),
JSON helpers, a typed client factory, and the check for optional extras.

Nothing here imports rich at import time: ``mtask-worker`` and ``mtask serve`` must start in an
install without the ``cli`` extra. The consoles make a rich ``Console`` on first use, or print
plain text when rich is missing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mtask.errors import MissingExtra, UsageError

if TYPE_CHECKING:
    from rich.console import Console

    from mtask.client import TaskClient

EXIT_USAGE = 2
Handler = Callable[[argparse.Namespace], int]

# The optional dependencies, by the extra that brings them (pyproject's optional-dependencies).
EXTRAS = {
    "rich": "cli",
    "shtab": "cli",
    "fastapi": "server",
    "uvicorn": "server",
    "jinja2": "server",
    "starlette": "server",
    "fastapi_offline": "server",
}


def require(what: str, *modules: str) -> None:
    """Raise ``MissingExtra`` (one line, exit 2) unless every module is importable."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise missing_extra(what, module)


def missing_extra(what: str, module: str) -> MissingExtra:
    extra = EXTRAS.get(module, "cli")
    return MissingExtra(
        f"{what} needs the {extra!r} extra ({module} is not installed): "
        f"pip install 'mtask[{extra}]'"
    )


class Output:
    """A console on stdout or stderr: rich's when the ``cli`` extra is installed, else plain."""

    def __init__(self, *, stderr: bool = False) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    @property
    def rich_available(self) -> bool:
        return importlib.util.find_spec("rich") is not None

    @property
    def console(self) -> Console:
        if self._console is None:
            require("this command", "rich")
            from rich.console import Console

            self._console = Console(stderr=self._stderr, highlight=False, soft_wrap=self._stderr)
        return self._console

    @property
    def is_terminal(self) -> bool:
        return self.console.is_terminal if self.rich_available else False

    def print(self, *objects: Any, markup: bool | None = None) -> None:
        if self._console is not None or self.rich_available:
            self.console.print(*objects, markup=markup)
            return
        text = " ".join(str(o) for o in objects)
        if markup is not False:
            text = re.sub(r"\[/?[a-z ]*\]", "", text)
        stream = sys.stderr if self._stderr else sys.stdout
        stream.write(text + "\n")


out = Output()
err = Output(stderr=True)


class Commands:
    """A command module's table of handlers: ``@commands.command("get")`` registers one, and
    ``commands.run`` is the module's ``run`` for ``mtask.cli.COMMAND_MODULES``."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def command(self, name: str) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            self.handlers[name] = fn
            return fn

        return register

    def run(self, args: argparse.Namespace) -> int:
        return self.handlers[args.command](args)


# -- shared options (declared once) -----------------------------------------------------------


def add_uri(p: argparse.ArgumentParser) -> None:
    p.add_argument("--uri", help="MongoDB URI (default: $MTASK_MONGODB_URI, else embedded)")


def add_connection(p: argparse.ArgumentParser, *, collection: bool = True) -> None:
    """``--uri``, ``--database`` and ``--collection``."""
    add_uri(p)
    p.add_argument("--database", default="mtask")
    if collection:
        p.add_argument("--collection", default="tasks")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_common(p: argparse.ArgumentParser) -> None:
    """The options of every command that reads or writes tasks."""
    add_connection(p)
    add_json(p)


def task_client(args: argparse.Namespace) -> TaskClient:
    from mtask.client import TaskClient

    return TaskClient(args.uri, database=args.database, collection=args.collection)


# -- JSON and times ---------------------------------------------------------------------------


def parse_json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return str(value)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, default=json_default, indent=2) + "\n")


def when(value: dt.datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if value else "-"
