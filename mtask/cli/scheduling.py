"""``mtask limit``, ``mtask limits``, ``mtask schedule …`` and ``mtask flow``: the scheduling
features of the command line."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mtask.cli.common import (
    Choices,
    Commands,
    add_common,
    add_row,
    choose,
    out,
    parse_json_object,
    print_json,
    task_client,
    when,
)
from mtask.errors import ScheduleNotFound, TaskNotFound, UsageError

if TYPE_CHECKING:
    from mtask.limits.rules import GroupOverride, Limit


def _overlaps() -> tuple[str, ...]:
    from mtask.schedules.definition import OVERLAP_CHOICES

    return OVERLAP_CHOICES


def _catch_up() -> tuple[str, ...]:
    from mtask.schedules.definition import CATCH_UP_CHOICES

    return CATCH_UP_CHOICES


commands = Commands()
run = commands.run


@commands.command("limit")
def cmd_limit(args: argparse.Namespace) -> int:
    if (args.name is None) == (args.resource is None):
        raise UsageError("give a task name, or --resource NAME (a shared resource), not both")
    if args.resource is not None:
        return _resource_limit(args)
    if args.names is not None or args.tokens is not None:
        flag = "--names" if args.names is not None else "--tokens"
        raise UsageError(f"{flag} belongs to a shared resource's limit: give --resource")
    if args.group is not None:
        return _group_limit(args)
    if args.weight is not None:
        raise UsageError("--weight is a group's share of turns: give its --group")
    with task_client(args) as client:
        given = (
            args.concurrency, args.rate, args.group_concurrency, args.group_rate, args.overflow
        )  # fmt: skip
        if args.clear:
            if any(v is not None for v in given):
                raise UsageError("--clear takes no --concurrency, --rate or --group-…")
            found = client.clear_limit(args.name)
            said = f"limit of {args.name} removed" if found else f"{args.name} had no limit"
            out.print(said, markup=False)
            return 0
        from mtask.limits.rules import parse_rate

        rate = parse_rate(args.rate) if args.rate is not None else None
        group_rate = parse_rate(args.group_rate) if args.group_rate is not None else None
        doc = client.set_limit(
            args.name,
            concurrency=args.concurrency,
            rate=rate,
            burst=args.burst,
            group_concurrency=args.group_concurrency,
            group_rate=group_rate,
            group_burst=args.group_burst,
            overflow=args.overflow,
        )
    if args.json:
        print_json(doc)
    else:
        described = _describe_limit(doc)
        out.print(f"limit of {args.name}: {described} (applies within a second)", markup=False)
    return 0


def _resource_limit(args: argparse.Namespace) -> int:
    """``mtask limit --resource R …``: a shared resource's limit (or ``--clear``)."""
    given = (args.group, args.group_concurrency, args.group_rate, args.group_burst, args.weight)
    if any(v is not None for v in given):
        raise UsageError("a resource has no groups: --concurrency, --rate and --burst only")
    with task_client(args) as client:
        if args.clear:
            settings = (
                args.concurrency, args.rate, args.burst, args.overflow, args.names, args.tokens
            )  # fmt: skip
            if any(v is not None for v in settings):
                raise UsageError(
                    "--clear takes no --concurrency, --rate, --burst, --overflow, --names or "
                    "--tokens"
                )
            found = client.clear_limit(resource=args.resource)
            said = "limit removed" if found else "had no limit"
            out.print(f"resource {args.resource}: {said}", markup=False)
            return 0
        from mtask.limits import measured
        from mtask.limits.rules import parse_rate

        doc = client.set_limit(
            resource=args.resource,
            tokens_per=None if args.tokens is None else measured.parse(args.tokens),
            concurrency=args.concurrency,
            rate=parse_rate(args.rate) if args.rate is not None else None,
            burst=args.burst,
            overflow=args.overflow,
            names=None
            if args.names is None
            else [n.strip() for n in args.names.split(",") if n.strip()],
        )
    if args.json:
        print_json(doc)
    else:
        said = f"resource {args.resource}: {_describe_limit(doc)} (applies within a second)"
        out.print(said, markup=False)
    return 0


def _group_limit(args: argparse.Namespace) -> int:
    """``mtask limit NAME --group G …``: one group's own limit and weight (or ``--clear``)."""
    if any(
        v is not None
        for v in (args.group_concurrency, args.group_rate, args.group_burst, args.overflow)
    ):
        raise UsageError(
            "--group takes --concurrency, --rate, --burst and --weight (not --group-…, and "
            "--overflow is the name's)"
        )
    with task_client(args) as client:
        if args.clear:
            if any(v is not None for v in (args.concurrency, args.rate, args.burst, args.weight)):
                raise UsageError("--clear takes no --concurrency, --rate, --burst or --weight")
            found = client.clear_group_limit(args.name, args.group)
            said = "override removed" if found else "had no override"
            out.print(f"group {args.group} of {args.name}: {said}", markup=False)
            return 0
        from mtask.limits.rules import parse_rate

        doc = client.set_group_limit(
            args.name,
            args.group,
            concurrency=args.concurrency,
            rate=parse_rate(args.rate) if args.rate is not None else None,
            burst=args.burst,
            weight=args.weight,
        )
    if args.json:
        print_json(doc)
    else:
        from mtask.limits.rules import group_limit_for, group_override

        override = group_override(doc, args.group)
        described = _describe_override(override, group_limit_for(doc, args.group))
        said = f"group {args.group} of {args.name}: {described} (applies within a second)"
        out.print(said, markup=False)
    return 0


def _describe_override(found: GroupOverride | None, limit: Limit) -> str:
    """A group's override: the limit its group runs under (``limit``: the override's fields
    over the name's group limit, ``limits.group_limit_for``) if it sets one, and its weight."""
    if found is None:
        return "no override"
    parts = []
    if found.limits:
        if limit.concurrency is not None:
            parts.append(f"at most {limit.concurrency} at once")
        if limit.rate is not None:
            parts.append(f"{limit.rate:g}/s (bursts of {limit.burst or 1:g})")
    if found.weight is not None:
        parts.append(f"weight {found.weight:g}")
    return ", ".join(parts) or "the name's group limit"


def _describe_limit(doc: Mapping[str, Any]) -> str:
    parts = []
    if doc.get("concurrency") is not None:
        parts.append(f"at most {doc['concurrency']} at once")
    if doc.get("rate") is not None:
        parts.append(f"{doc['rate']:g}/s (bursts of {doc.get('burst') or 1:g})")
    if doc.get("group_concurrency") == 1:
        parts.append("each group a sequence (one at a time, in publish order)")
    elif doc.get("group_concurrency") is not None:
        parts.append(f"at most {doc['group_concurrency']} at once per group")
    if doc.get("group_rate") is not None:
        burst = doc.get("group_burst") or 1
        parts.append(f"{doc['group_rate']:g}/s per group (bursts of {burst:g})")
    if doc.get("measured_limit") is not None and doc.get("measured_window_ms") is not None:
        window = doc["measured_window_ms"] / 1000
        parts.append(f"at most {doc['measured_limit']} tokens each {window:g} s")
    if doc.get("overflow") in ("drop", "fail"):
        parts.append(f"the excess {'dropped' if doc['overflow'] == 'drop' else 'failed'} at once")
    if isinstance(found := doc.get("group_overrides"), list) and found:
        parts.append(f"{len(found)} group{'s' if len(found) != 1 else ''} with an override")
    return ", ".join(parts) or "none"


@commands.command("limits")
def cmd_limits(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        uses = client.limit_use()
    if args.json:
        print_json([{**u.limit, "use": _use_json(u)} for u in uses])
        return 0
    if not uses:
        out.print("no limits (mtask limit NAME --concurrency N | --rate 10/s | …)", markup=False)
        return 0
    from rich.table import Table

    table = Table("name", "limit", "in use", "due", "blocked")
    table.columns[1].ratio = 1
    for u in uses:
        if u.resource:  # a shared resource: its tasks are counted under the names using it
            said = _describe_limit(u.limit) + _window_of(u) + _holds_of(u) + _users_of(u)
            add_row(table, f"resource {u.name}", said, _in_use(u), u.due, u.blocked)
            continue
        said = _describe_limit(u.limit) + _holds_of(u) + _state_of(u)
        add_row(table, u.name, said, _in_use(u), u.due, u.blocked)
    out.print(table)
    for u in uses:
        _print_groups(u)
        _print_overrides(u)
    return 0


def _use_json(u: Any) -> dict[str, Any]:
    import dataclasses

    found = dataclasses.asdict(u)
    found.pop("limit")
    return found


SHOWN_USERS = 5
"""The names a shared resource's row says take its slot (``--json``: all of them)."""


def _window_of(u: Any) -> str:
    """A shared resource's current window of tokens: what it charged, and until when it is
    full (its limit, ``tokens_per``, is in ``_describe_limit``)."""
    window = u.token_window
    if window is None:
        return ""
    full = f", full until {window.end:%H:%M:%S} UTC" if window.full else ""
    return f" ({window.charged} charged in this window{full})"


def _users_of(u: Any) -> str:
    """The task names that take a shared resource's slot, or that none is known."""
    if not u.users:
        return " (no live worker's name takes it)"
    more = len(u.users) - SHOWN_USERS
    rest = f" and {more} more" if more > 0 else ""
    return f" (taken by {', '.join(u.users[:SHOWN_USERS])}{rest})"


def _holds_of(u: Any) -> str:
    """A handler's back-off holding the name (or resource), or some of its groups, back."""
    parts = []
    if u.held_until is not None:
        parts.append(f"backing off until {u.held_until:%H:%M:%S} UTC")
    if u.held_groups:
        groups = ", ".join(sorted(u.held_groups)[:3]) + (" …" if len(u.held_groups) > 3 else "")
        parts.append(f"backing off: group {groups}")
    return "".join(f" ({p})" for p in parts)


def _state_of(u: Any) -> str:
    if u.paused:
        return " (paused)"
    return "" if u.handled else " (no live worker)"


def _in_use(u: Any) -> str:
    """The name's runs at once in use out of its limit, and its sequences' locks held."""
    parts = []
    if u.own.concurrency is not None:
        parts.append(f"{u.in_use} of {u.own.concurrency}")
    if u.per_group.concurrency == 1 and u.per_group.rate is None:
        parts.append(f"{u.locks} lock{'s' if u.locks != 1 else ''}")
    elif u.per_group.set:
        parts.append(f"{sum(g.in_use for g in u.groups)} in groups")
    return ", ".join(parts) or "-"


def _print_groups(u: Any) -> None:
    """The groups of a name whose groups are limited: in use, open, running, blocked, head."""
    groups = [g for g in u.groups if g.group is not None]
    weighted = any(g.weight != 1.0 for g in groups)
    if not groups or not (u.per_group.set or weighted or any(g.overridden for g in groups)):
        return
    from rich.table import Table

    kind = "a sequence each" if u.per_group.concurrency == 1 else "limited each"
    if not u.per_group.set:
        kind = "limited where overridden"
    columns = ["group", "in use", "open", "running", "blocked", "head (runs next)"]
    if weighted:  # a share of turns other than the even one: said only then
        columns.insert(5, "weight")
    table = Table(*columns, title=f"groups of {u.name} ({kind})", title_justify="left")
    table.columns[0].overflow = "fold"
    table.columns[-1].overflow = "fold"
    for g in groups:
        status = f" ({g.head_status}{', holds the lock' if g.holds_lock else ''})"
        head = f"{g.head}{status}" if g.head else "-"
        in_use = "-" if g.limit is None else f"{g.in_use} of {g.limit}"
        if g.overridden:
            in_use += " (own)"
        row = [g.group, in_use, g.open, g.running, g.blocked, head]
        if weighted:
            row.insert(5, f"{g.weight:g}")
        add_row(table, *row)
    out.print(table)
    if u.more_groups:
        out.print(f"and {u.more_groups} smaller groups", markup=False)


def _print_overrides(u: Any) -> None:
    """Every group override of a name, whether or not its group has open tasks: a line each,
    the first ``SHOWN_OVERRIDES`` in group order, then how many more."""
    if not u.overrides:
        return
    from mtask.store.occupancy import SHOWN_OVERRIDES

    out.print(f"group overrides of {u.name}:", markup=False)
    for group, found, limit in u.shown_overrides:
        out.print(f"  {group}: {_describe_override(found, limit)}", markup=False)
    if u.more_overrides:
        out.print(
            f"  and {u.more_overrides} more (the first {SHOWN_OVERRIDES} shown; all of them: "
            "mtask limits --json)",
            markup=False,
        )


@commands.command("schedule")
def cmd_schedule(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        if args.action == "add":
            return _schedule_add(client, args)
        if args.action == "list":
            docs = client.schedules()
            if args.json:
                print_json(docs)
            else:
                _print_schedules(docs)
            return 0
        if args.id is None:
            raise UsageError(f"mtask schedule {args.action} needs the schedule's id")
        if args.action == "remove":
            if not client.remove_schedule(args.id):
                raise ScheduleNotFound(args.id)
            out.print(f"removed: {args.id}", markup=False)
            return 0
        doc = (client.pause_schedule if args.action == "pause" else client.resume_schedule)(args.id)
        out.print(f"{'paused' if doc['paused'] else 'resumed'}: {args.id}", markup=False)
        return 0


def _schedule_add(client: Any, args: argparse.Namespace) -> int:
    if args.id is None or args.task is None:
        raise UsageError("usage: mtask schedule add ID TASK (--cron EXPR | --every SECONDS)")
    doc = client.add_schedule(
        args.id,
        args.task,
        cron=args.cron,
        every=args.every,
        timezone=args.timezone,
        params=parse_json_object(args.params, "--params") if args.params else None,
        options=parse_json_object(args.options, "--options") if args.options else None,
        catch_up=args.catch_up,
        overlap=args.overlap,
    )
    if args.json:
        print_json(doc)
    else:
        tick = when(doc.get("next_tick_at"))
        out.print(f"schedule {doc['_id']}: next tick {tick} UTC", markup=False)
    return 0


def _overlap(doc: dict[str, Any]) -> str:
    """A schedule's overlap policy, and what it skipped or holds."""
    said = str(doc.get("overlap") or "all")
    if doc.get("skipped"):
        said += f", {doc['skipped']} skipped"
    if doc.get("buffered_tick"):
        said += ", 1 buffered"
    return said


def _print_schedules(docs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(
        "id", "task", "when", "catch up", "overlap", "state", "next tick (UTC)", "last task"
    )
    for doc in docs:
        spec = doc.get("cron") or f"every {doc.get('every_s'):g}s"
        state = "error" if doc.get("error") else "paused" if doc.get("paused") else "active"
        add_row(
            table,
            doc["_id"],
            str(doc.get("task")),
            f"{spec} ({doc.get('timezone')})",
            str(doc.get("catch_up")),
            _overlap(doc),
            state,
            when(doc.get("next_tick_at")),
            str(doc.get("last_key") or "-"),
        )
    out.print(table)


@commands.command("flow")
def cmd_flow(args: argparse.Namespace) -> int:
    with task_client(args) as client:
        tree = client.flow(args.key)
    if tree is None:
        raise TaskNotFound(args.key)
    if args.json:
        print_json(tree)
        return 0
    from mtask.cli.render import flow_tree

    out.print(flow_tree(tree))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("limit", help="limit a task name across all workers")
    add_common(p)
    p.add_argument("name", nargs="?", help="the task name (or give --resource)")
    p.add_argument(
        "--resource",
        help="a shared resource's limit instead (an API quota): every task whose handler "
        "uses it (@registry.task(uses=[...])) takes a slot of it",
    )
    p.add_argument(
        "--names",
        help="with --resource: the task names that take a slot of it besides those whose "
        "handler declares uses=, comma-separated (replaces the list; '' empties it)",
    )
    p.add_argument(
        "--tokens",
        help="with --resource: at most this many tokens charged (ctx.record_usage) in each "
        "window, e.g. 90000/m, 5000/s, 500/30 (a window of 30 s); a run takes the resource "
        "only while its window's count is below it",
    )
    p.add_argument("--concurrency", type=int, help="at most this many runs at once")
    p.add_argument("--rate", help="at most this many claims, e.g. 10/s, 600/m, 3600/h")
    p.add_argument("--burst", type=int, help="tokens the rate may save up (default: 1 s worth)")
    p.add_argument(
        "--group-concurrency",
        type=int,
        help="at most this many runs at once in each group (options.group); 1: each group is "
        "a sequence, run one at a time in publish order",
    )
    p.add_argument("--group-rate", help="at most this many claims per group, e.g. 5/s")
    p.add_argument("--group-burst", type=int, help="tokens each group's rate may save up")
    p.add_argument(
        "--group",
        help="one group's own limit instead (a tier, a tenant): --concurrency, --rate and "
        "--burst override the name's --group-… values for it; --clear removes it",
    )
    p.add_argument(
        "--weight",
        type=float,
        help="with --group: its share of turns among the name's groups (default 1; 3 takes "
        "three turns for every one of a group of weight 1)",
    )
    p.add_argument(
        "--overflow",
        choices=("queue", "drop", "fail"),
        help="what the limit does with a task it refuses: queue (the default: it waits for a "
        "slot), drop (cancelled at once) or fail (failed for good at once)",
    )
    p.add_argument("--clear", action="store_true", help="remove the limit")

    p = sub.add_parser("limits", help="list the limits")
    add_common(p)

    p = sub.add_parser("schedule", help="repeatable tasks: add, list, pause, resume, remove")
    add_common(p)
    p.add_argument(
        "action",
        choices=["add", "list", "pause", "resume", "remove"],
        help="add ID TASK (--cron or --every); list; pause, resume or remove ID",
    )
    p.add_argument("id", nargs="?", help="the schedule's id (all but list)")
    p.add_argument("task", nargs="?", help="the task name to publish (add)")
    p.add_argument("--cron", help="a cron expression, e.g. '0 * * * *'")
    p.add_argument("--every", type=float, help="an interval in seconds")
    p.add_argument("--timezone", default="UTC", help="e.g. Europe/Paris (default UTC)")
    p.add_argument("--params", help="JSON object")
    p.add_argument("--options", help="JSON object of task options")
    catch_up = p.add_argument(
        "--catch-up",
        default="latest",
        help="the ticks missed while nothing ran: run none, the latest, or all",
    )
    choose(catch_up, Choices(_catch_up))
    overlap = p.add_argument(
        "--overlap",
        default="all",
        help="a tick while the previous task is still open: publish it anyway, skip it, or "
        "buffer one until the previous one finished",
    )
    choose(overlap, Choices(_overlaps))

    p = sub.add_parser("flow", help="a task and the steps below it, as a tree")
    add_common(p)
    p.add_argument("key", help="the task's key")
