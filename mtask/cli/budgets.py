"""``mtask usage`` and ``mtask budget``: what task names and groups spent (``ctx.record_usage``)
and their budgets (docs/usage.md), as ``GET /usage`` and ``PUT /budgets/…`` give them.

``mtask usage [--name N] [--group G]``: the totals of every name and group (or of those
given), with each one's budget and what it spent of it in the current period. ``mtask budget
set (--name N | --group G) [--tokens T] [--cost X] [--period P]``, ``mtask budget clear (--name
N | --group G)`` and ``mtask budget list``. Exit 2 for a bad budget (nothing written), 1 to
clear a budget that is not there.
"""

from __future__ import annotations

import argparse
import datetime as dt
from collections.abc import Mapping
from typing import Any

from mtask.cli.common import Commands, add_common, add_row, out, print_json, task_client
from mtask.errors import UsageError

commands = Commands()
run = commands.run

PERIODS = ("hour", "day", "week", "month")


@commands.command("usage")
def cmd_usage(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        found = client.usage(args.name, args.group)
        now = client.now() if found else None
    if args.json:
        print_json(found)
        return 0
    if not found:
        out.print("no usage recorded yet (ctx.record_usage)", markup=False)
        return 0
    assert now is not None
    _table(found, now)
    return 0


@commands.command("budget")
def cmd_budget(args: argparse.Namespace) -> int:
    if args.action == "list":
        if args.name is not None or args.group is not None or _limits_given(args):
            raise UsageError("budget list takes no --name, --group, --tokens, --cost or --period")
        with task_client(args) as client:
            found = [s for s in client.usage() if "budget" in s]
            now = client.now() if found else None
        if args.json:
            print_json(found)
        elif not found:
            out.print("no budgets (mtask budget set --name N --tokens T)", markup=False)
        else:
            assert now is not None
            _table(found, now)
        return 0
    if (args.name is None) == (args.group is None):
        raise UsageError(f"budget {args.action} takes --name N or --group G (one of them)")
    scope = f"name {args.name}" if args.name is not None else f"group {args.group}"
    if args.action == "clear":
        if _limits_given(args):
            raise UsageError("budget clear takes no --tokens, --cost or --period")
        with task_client(args) as client:
            cleared = client.clear_budget(args.name, group=args.group)
        if args.json:
            print_json({"scope": scope, "cleared": cleared})
        else:
            out.print(f"{scope}: {'budget removed' if cleared else 'had no budget'}", markup=False)
        return 0 if cleared else 1
    with task_client(args) as client:
        doc = client.set_budget(
            args.name,
            group=args.group,
            tokens=args.tokens,
            cost=args.cost,
            period=None if args.period is None else _period(args.period),
        )
    if args.json:
        print_json(doc)
    else:
        said = f"{scope}: at most {_budget(doc['budget'])} (workers apply it within 5 s)"
        out.print(said, markup=False)
    return 0


def _limits_given(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.tokens, args.cost, args.period))


def _period(text: str) -> str | float:
    """``--period``: hour, day, week, month, or a number of seconds."""
    if text in PERIODS:
        return text
    try:
        return float(text)
    except ValueError:
        raise UsageError(
            f"--period: {text!r} is not hour, day, week, month or a number of seconds"
        ) from None


def _budget(budget: Mapping[str, Any]) -> str:
    from mtask.models import Budget

    return Budget.model_validate({k: v for k, v in budget.items() if k != "cost_nanos"}).describe()


def _spent(view: Mapping[str, Any]) -> str:
    from mtask.usage.rules import from_nanos

    tokens = int(view.get("input_tokens") or 0) + int(view.get("output_tokens") or 0)
    cached = int(view.get("cached_tokens") or 0)
    said = f"{tokens:,} ({view.get('input_tokens') or 0:,} in"
    said += f", {cached:,} cached" if cached else ""
    said += f", {view.get('output_tokens') or 0:,} out)"
    cost = from_nanos(view.get("cost_nanos"))
    return said if cost is None else f"{said}, cost {cost.normalize():f}"


def _of_budget(view: Mapping[str, Any], now: dt.datetime) -> str:
    """A scope's budget and what it spent of it: in the current period (a window of an earlier
    period spent nothing of it), or in all for a budget without a period."""
    from mtask.usage.rules import from_nanos, period_start

    budget = view.get("budget")
    if not isinstance(budget, Mapping):
        return ""
    period = budget.get("period")
    if period is None:
        spent: Mapping[str, Any] = view
        when = ""
    else:
        window = view.get("window")
        start = period_start(period, now)
        current = isinstance(window, Mapping) and window.get("start") == start
        spent = window if current and isinstance(window, Mapping) else {}
        when = " this period"
    tokens = int(spent.get("input_tokens") or 0) + int(spent.get("output_tokens") or 0)
    parts = [f"{tokens:,} tokens"] if budget.get("tokens") is not None else []
    if budget.get("cost") is not None:
        parts.append(f"a cost of {from_nanos(spent.get('cost_nanos')) or 0:f}")
    return f"{_budget(budget)}: {' and '.join(parts)} spent{when}"


def _table(found: list[dict[str, Any]], now: dt.datetime) -> None:
    from rich.table import Table

    table = Table("scope", "tokens", "requests", "budget")
    table.columns[3].ratio = 1
    for view in found:
        scope = f"{view['scope']} {view['id']}"
        add_row(table, scope, _spent(view), f"{view.get('requests') or 0:,}", _of_budget(view, now))
    out.print(table)


def register(sub: Any) -> None:
    p = sub.add_parser("usage", help="what task names and groups spent, and their budgets")
    add_common(p)
    p.add_argument("--name", help="this task name's totals only")
    p.add_argument("--group", help="this group's totals only (across names)")

    p = sub.add_parser("budget", help="a task name's or group's budget: set, clear, list")
    add_common(p)
    p.add_argument(
        "action",
        choices=["set", "clear", "list"],
        help="set or clear the budget of --name or --group; list every budget",
    )
    p.add_argument("--name", help="the task name whose budget it is")
    p.add_argument("--group", help="the group whose budget it is (across names)")
    p.add_argument("--tokens", type=int, help="at most this many tokens (input + output)")
    p.add_argument("--cost", type=float, help="at most this cost (in the prices' currency)")
    p.add_argument(
        "--period",
        help="per hour, day, week or month (UTC, the server's clock) or a number of seconds; "
        "none: in all",
    )
