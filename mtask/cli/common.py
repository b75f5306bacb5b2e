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
import os
import re
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from mtask.errors import MissingExtra, UsageError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from mtask.client import TaskClient

EXIT_FAILED = 1
EXIT_NOT_FOUND = EXIT_FAILED
"""No task, schedule or worker has that key or id: 1, as ``kubectl get`` and ``gh`` exit, for
every command (``mtask wait`` exited 2); the one line on stderr names what is missing."""
EXIT_USAGE = 2
EXIT_STORAGE_WAIT = 3
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
EXIT_STATUSES = (
    (0, "done; `mtask wait`: the task succeeded"),
    (
        EXIT_FAILED,
        "not done: no task, schedule or worker has that key or id; the task's state does not "
        "allow it (`retry` of a pending task); MongoDB could not be reached or refused; "
        "`mtask wait`: the task failed, was cancelled or is invalid",
    ),
    (
        EXIT_USAGE,
        "the command line is wrong (bad JSON, a value out of range, a missing extra): "
        "nothing was written",
    ),
    (EXIT_STORAGE_WAIT, "`mtask wait` only: MongoDB could not be reached"),
    (
        EXIT_TIMEOUT,
        "`mtask wait --timeout`: the task did not finish in time (as coreutils' `timeout`)",
    ),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)
"""Every exit status of ``mtask``, in one place: ``docs/cli-reference.md`` shows them."""
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
        f"{what} needs the {extra!r} extra ({module} is not installed): {install_command(extra)}"
    )


def install_command(extra: str) -> str:
    """The command that installs ``extra`` where this mtask came from: its source tree
    (``pip install -e '.[server]'`` in a clone: no index has a distribution of it), the wheel
    or directory it was installed from, else the package index (``pip install
    'mtask[server]'``); with the pip of the interpreter that runs it."""
    return f"{_pip()} install {installed_from(extra)}"


def installed_from(extra: str) -> str:
    """The requirement that adds ``extra`` to the mtask that runs: pip's record of a direct
    install (``direct_url.json``: an editable or local directory, a wheel, a VCS URL), the
    source tree it is imported from (a checkout on ``PYTHONPATH``), else its name."""
    import importlib.metadata
    import shlex
    from pathlib import Path
    from urllib.parse import unquote, urlparse

    import mtask

    tree = Path(mtask.__file__).resolve().parent.parent
    source = tree if (tree / "pyproject.toml").is_file() else None
    try:
        record = importlib.metadata.distribution("mtask").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        record = None
    direct = json.loads(record) if record else {}
    url = str(direct.get("url", ""))
    local = Path(unquote(urlparse(url).path)) if url.startswith("file://") else None
    if source is not None and (local is None or local.resolve() != source):
        return f"-e {shlex.quote(f'{_shown(source)}[{extra}]')}"  # a checkout, imported as is
    if local is not None:
        editable = "-e " if direct.get("dir_info", {}).get("editable") else ""
        return f"{editable}{shlex.quote(f'{_shown(local)}[{extra}]')}"
    vcs = direct.get("vcs_info")
    if url and vcs:
        return shlex.quote(f"mtask[{extra}] @ {vcs.get('vcs', 'git')}+{url}")
    if url:
        return shlex.quote(f"mtask[{extra}] @ {url}")
    return f"'mtask[{extra}]'"


def _shown(path: Any) -> str:
    """A path as a user types it: relative to the working directory when under it."""
    here = os.getcwd()
    text = os.path.abspath(str(path))
    if text == here:
        return "."
    if text.startswith(here + os.sep):
        return os.path.relpath(text, here)
    return text


def _pip() -> str:
    """``pip`` when the one on ``PATH`` is this interpreter's, else ``<python> -m pip``."""
    import shlex
    import shutil

    found = shutil.which("pip")
    if found is not None and os.path.dirname(found) == os.path.dirname(sys.executable):
        return "pip"
    return f"{shlex.quote(_shown(sys.executable))} -m pip"


PIPE_WIDTH = 160
"""The width of the output written to a pipe or a file (``$COLUMNS`` when set): a table's
cells are not wrapped word by word at 80 columns."""


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

            console = Console(stderr=self._stderr, highlight=False, soft_wrap=self._stderr)
            if not console.is_terminal and not os.environ.get("COLUMNS"):
                # a pipe or a file: rich would take 80 columns and wrap a table's cells word
                # by word; lines as wide as a wide terminal's read (and grep) whole
                console.width = PIPE_WIDTH
            self._console = console
        return self._console

    @property
    def is_terminal(self) -> bool:
        return self.console.is_terminal if self.rich_available else False

    def print(self, *objects: Any, markup: bool | None = None) -> None:
        """Tables and other renderables fit the terminal's width; a line of text is never cut
        or wrapped into the next line (a path, a URI or a log line reads, and copies, whole
        at 80 columns and in a pipe)."""
        if self._console is not None or self.rich_available:
            line = all(isinstance(o, str) for o in objects)
            self.console.print(*objects, markup=markup, soft_wrap=line)
            return
        text = " ".join(str(o) for o in objects)
        if markup is not False:
            text = re.sub(r"\[/?[a-z ]*\]", "", text)
        stream = sys.stderr if self._stderr else sys.stdout
        stream.write(text + "\n")


out = Output()
err = Output(stderr=True)


def add_row(table: Table, *cells: object) -> None:
    """A row of data in a rich table, every cell shown as it is: a key, name or error such as
    ``a[/b]`` is text, never markup (rich would refuse it as an unmatched closing tag). Each
    table of the CLI adds its rows through here; a line of data is printed with
    ``markup=False``."""
    from rich.text import Text

    table.add_row(*(c if isinstance(c, Text) else Text(str(c)) for c in cells))


def fitting_table(
    *headers: str,
    fold: Collection[str] = (),
    left: Collection[str] = (),
    title: str | None = None,
    caption: str | None = None,
) -> Table:
    """A table that reads at 80 columns (a pipe's and CI's width): no vertical rules, two
    spaces between columns. The first column (a name, a key) and those in ``fold`` are never
    cut short: a value too long for the width folds onto the next line. The others are kept
    whole, right-aligned (counts) unless in ``left``."""
    from rich import box
    from rich.table import Table

    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
        title=title,
        caption=caption,
        title_justify="left",
        caption_justify="left",
    )
    for i, header in enumerate(headers):
        if i == 0 or header in fold:
            table.add_column(header, overflow="fold")
        else:
            table.add_column(header, justify="left" if header in left else "right", no_wrap=True)
    return table


def status_columns(counts: Mapping[str, Mapping[str, int]], statuses: Sequence[str]) -> list[str]:
    """The statuses some name has a task in, in ``statuses``' order: a status no task is in
    takes no column (so the names keep theirs at 80 columns)."""
    held = {status for row in counts.values() for status, n in row.items() if n}
    return [s for s in statuses if s in held]


class Commands:
    """A command module's table of handlers: ``@commands.command("get")`` registers one, and
    ``commands.run`` is the module's ``run`` for ``mtask.cli.command_modules``."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def command(self, name: str) -> Callable[[Handler], Handler]:
        def register(fn: Handler) -> Handler:
            self.handlers[name] = fn
            return fn

        return register

    def run(self, args: argparse.Namespace) -> int:
        return self.handlers[args.command](args)


class Choices(Sequence[str]):
    """An option's choices, read from their one definition on first use: building the parser
    (``mtask --help``) then imports no model, driver or worker, and only the command that runs
    loads what it needs (``tests/unit/test_lazy_imports.py``). Given with ``choose``."""

    def __init__(self, read: Callable[[], Iterable[str]]) -> None:
        self._read = read
        self._values: tuple[str, ...] | None = None

    @property
    def values(self) -> tuple[str, ...]:
        if self._values is None:
            self._values = tuple(self._read())
        return self._values

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self.values[index]

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __contains__(self, value: object) -> bool:
        return value in self.values


def statuses() -> list[str]:
    """The task statuses, in their order (``vocabulary.TaskStatus``)."""
    from mtask.vocabulary import TaskStatus

    return [s.value for s in TaskStatus]


STATUSES = Choices(statuses)


def choose(action: argparse.Action, choices: Choices) -> None:
    """Give an option its choices once it is added: argparse formats an option's choices as
    it adds it (to check its metavar), which would read them with the parser. They are checked
    and shown (``{a,b,c}``) as any option's."""
    action.choices = choices


# -- shared options (declared once) -----------------------------------------------------------


def add_uri(p: argparse.ArgumentParser) -> None:
    p.add_argument("--uri", help="MongoDB URI (default: $MTASK_MONGODB_URI, else embedded)")


def add_connection(p: argparse.ArgumentParser, *, collection: bool = True) -> None:
    """``--uri``, ``--database`` and ``--collection``."""
    add_uri(p)
    p.add_argument("--database", default="mtask", help="the database (default mtask)")
    if collection:
        p.add_argument("--collection", default="tasks", help="the tasks collection (default tasks)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_common(p: argparse.ArgumentParser) -> None:
    """The options of every command that reads or writes tasks."""
    add_connection(p)
    add_json(p)


def task_client(args: argparse.Namespace, *, reads: bool = False) -> TaskClient:
    """The command's client; with ``MTASK_ENCRYPTION_KEY_FILE`` set it decrypts encrypted
    params and results (``mtask.security.encryption``), else they read as ``encrypted``.
    ``reads``: a command that only reads and shows (``get``, ``list``, ``stats``): its clock
    is calibrated in one round trip (it shows times, and decides none), and it makes no
    index (a viewer's role may not: the workers and ``mtask collection init`` do)."""
    from mtask.client import TaskClient
    from mtask.clock import ServerClock
    from mtask.security.encryption import Encryption

    uri = mongodb_uri(args.uri)
    encryption = Encryption.from_env(uri, args.database)
    return TaskClient(
        uri,
        database=args.database,
        collection=args.collection,
        encryption=encryption,
        clock=ServerClock(samples=1) if reads else None,
        make_indexes=not reads,
    )


def mongodb_uri(given: str | None, who: str = "mtask") -> str | None:
    """``--uri``, else ``$MTASK_MONGODB_URI`` (None: the client reads it), else the embedded
    server's (``embedded.default_data_dir``): a command that has to start it says so on stderr,
    with where its data is, so a second server never starts unnoticed."""
    from mtask.connection.clients import ENV_URI

    if given or os.environ.get(ENV_URI):
        return given
    from mtask.embedded import EmbeddedMongo  # only for a command that may have to start it

    server = EmbeddedMongo()
    uri, started = server.launch()
    if started:
        err.print(
            f"{who}: started the embedded MongoDB in {server.data_dir} ({uri}); "
            "`mtask mongod stop` stops it",
            markup=False,
        )
    return uri


# -- JSON and times ---------------------------------------------------------------------------


def parse_json(text: str, what: str) -> Any:
    """A JSON argument (``what`` names it in the error): ``UsageError`` (exit 2) for anything
    Python's json cannot read, not only bad syntax: an integer of more than 4,300 digits, a
    value nested deeper than Python recurses."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except RecursionError:
        raise UsageError(f"{what} is nested too deeply to read") from None
    except ValueError as exc:  # int_max_str_digits
        reason = str(exc).split(";")[0]
        raise UsageError(f"{what} cannot be read: {reason}") from None


def parse_json_object(text: str, what: str) -> dict[str, Any]:
    value = parse_json(text, what)
    if not isinstance(value, dict):
        raise UsageError(f"{what} must be a JSON object, not {type(value).__name__}")
    return value


DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?")


def parse_duration(text: str, what: str) -> dt.timedelta:
    """``90`` (seconds), ``90s``, ``15m``, ``12h``, ``7d``, ``2w``, ``500ms``: at most 100
    years (``vocabulary.MAX_AGE_SECONDS``, as the API allows), else ``UsageError`` (exit 2)."""
    from mtask.vocabulary import MAX_AGE_SECONDS

    match = DURATION.fullmatch(text.strip())
    if match is None:
        raise UsageError(f"{what}: {text!r} is not a duration such as 500ms, 90s, 15m, 12h, 7d")
    seconds = float(match[1]) * DURATION_UNITS[match[2] or "s"]  # inf for 1e400 digits
    if seconds > MAX_AGE_SECONDS:
        raise UsageError(f"{what}: {text!r} is more than 100 years")
    return dt.timedelta(seconds=seconds)


def json_default(value: Any) -> Any:
    """A value ``json`` cannot write: a date in ISO 8601; a BSON value (an ObjectId, bytes, a
    Decimal128, a session's id on a run, …) as MongoDB Extended JSON, as the REST API writes it
    (``vocabulary.bson_json``); anything else as its text."""
    if isinstance(value, dt.datetime):
        return value.isoformat()
    from mtask.vocabulary import bson_json

    try:
        return bson_json(value)
    except (TypeError, ValueError):  # not a BSON value
        return str(value)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, default=json_default, indent=2) + "\n")


def when(value: dt.datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] if value else "-"
