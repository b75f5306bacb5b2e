"""``mtask demo`` and ``mtask mongod``: things for a laptop (the embedded MongoDB)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from mtask.cli.common import Commands, add_json, add_uri, err, mongodb_uri, out, print_json
from mtask.errors import ConfigError, UsageError

commands = Commands()
run = commands.run


@commands.command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from mtask.client import TaskClient
    from mtask.demo import DATABASE, run_demo

    uri = mongodb_uri(args.uri)
    status = run_demo(uri, seconds=args.seconds)
    from mtask.cli.render import state_table

    with TaskClient(uri, database=DATABASE) as client:
        out.print()
        out.print(state_table(client.state_counts(), title=f"tasks in {DATABASE}, by state"))
    given = f" --uri {shlex.quote(args.uri)}" if args.uri else ""
    out.print(
        f"\nThe demo's tasks are in database {DATABASE} (the commands read mtask unless told):",
        markup=False,
    )
    for line in (
        f"mtask stats --database {DATABASE}{given}",
        f"mtask list --database {DATABASE} --state failed{given}",
        f"mtask get doomed --database {DATABASE}{given}",
        f"mtask serve --database {DATABASE}{given}   # the dashboard: http://127.0.0.1:8080/",
    ):
        out.print(f"  {line}", markup=False)
    return status


@commands.command("mongod")
def cmd_mongod(args: argparse.Namespace) -> int:
    from mtask.embedded import EmbeddedMongo

    server = EmbeddedMongo(args.data_dir, port=args.port)
    if args.action == "start":
        return _start(server, remembering=args.data_dir is not None)
    if args.action == "stop":
        out.print("stopped" if server.stop() else "not running")
        return 0
    status = server.status()
    if args.json:
        print_json(
            {
                "running": status.running,
                "pid": status.pid,
                "port": status.port,
                "uri": status.uri,
                "data_dir": str(status.data_dir),
            }
        )
    elif status.running:
        out.print(f"running: pid {status.pid}, {status.uri} (data in {status.data_dir})")
    else:
        out.print(f"not running (data in {status.data_dir})")
    return 0 if status.running else 3


def _start(server: Any, *, remembering: bool) -> int:
    """Start (or attach to) the server and print its URI; a ``--data-dir`` given is
    remembered for the commands run from this directory, and stderr says where the server is
    and who uses it."""
    from mtask.embedded import remember

    try:
        uri = server.start()
    except ConfigError as exc:  # the --port given is taken: the command line's mistake
        raise UsageError(str(exc)) from None
    print(uri)
    said = f"mtask: the embedded MongoDB runs in {server.data_dir}"
    if remembering and (pointer := remember(server.data_dir)) is not None:
        said += (
            f"; remembered in {pointer}: mtask commands run from this directory use it (from "
            f"elsewhere: export MTASK_DATA_DIR={server.data_dir})"
        )
    err.print(said, markup=False)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="sample tasks, three workers, one killed mid-run")
    add_uri(p)
    p.add_argument("--seconds", type=float, default=120.0, help="give up after this long")

    p = sub.add_parser("mongod", help="the embedded MongoDB: start, stop, status")
    p.add_argument(
        "action",
        choices=["start", "stop", "status"],
        help="start (or attach to) it and print its URI; stop it; say whether it runs (exit 3 "
        "if not)",
    )
    p.add_argument(
        "--data-dir",
        help="where its data lives (default: $MTASK_DATA_DIR, else the directory a `start "
        "--data-dir` run from here remembered in ./.mtask/data-dir, else ./.mtask/mongodb); "
        "start remembers it for the commands run from this directory",
    )
    p.add_argument(
        "--port", type=int, help="the port to listen on (default: the last one, else a free one)"
    )
    add_json(p)
