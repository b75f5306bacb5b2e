"""``mtask.testing.TimeSkippingEnv``: the embedded MongoDB under libfaketime, time skipped for
every decision. A 30-day workflow skipped through in seconds ends as the same workflow on real
time with its days scaled down; ``skip`` never makes a task due early nor a lease end late."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
from harness import running_worker, wait_for
from needs import missing

from mtask import AsyncTaskClient, BackOff, Registry, Snooze, Spawn, TaskContext
from mtask.errors import ConfigError
from mtask.models import Task
from mtask.testing import TimeSkippingEnv, find_libfaketime

DAY = dt.timedelta(days=1)
SCALED_DAY = 0.25
"""A day of the real-time run, in seconds."""

registry = Registry()
clients: dict[str, AsyncTaskClient] = {}
"""The client the approver signals with (the run's own)."""
bills: dict[str, int] = {}
"""How often ``bill`` was called, per workflow: its first call fails."""
held = asyncio.Event()
"""Released by the lease test: the first run of ``hold`` waits for it."""


def bill(run: str) -> str:
    bills[run] = bills.get(run, 0) + 1
    if bills[run] == 1:
        raise RuntimeError("the payment service is down")
    return f"invoice-{run.rsplit('/', 1)[1]}"


@registry.task("onboard")
async def onboard(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """A month of onboarding: a check-in a day for a week, a bill (its first try fails: the
    task is retried after its back-off), a report by a child task, an approval (a signal sent
    on day 20), and the end of the month."""
    day = params["day"]
    for n in range(1, 8):
        await ctx.step(f"checkin-{n}", lambda n=n: n)
        await ctx.sleep(day)
    invoice = await ctx.step("bill", bill, f"{params['db']}/{ctx.key}")
    [report] = await ctx.spawn_and_wait([Spawn("report", {"invoice": invoice})])
    approval = await ctx.wait_for("approved")
    await ctx.sleep(dt.datetime.fromisoformat(params["end"]))
    return {"invoice": invoice, "report": report, "by": approval["by"]}


@registry.task("report")
async def report(params: dict[str, Any], ctx: TaskContext) -> str:
    return f"report on {params['invoice']}"


@registry.task("approve")
async def approve(params: dict[str, Any], ctx: TaskContext) -> None:
    await clients[params["db"]].signal(params["workflow"], "approved", {"by": "ann"})


@registry.task("hold")
async def hold(params: dict[str, Any], ctx: TaskContext) -> int:
    if ctx.attempt == 1:
        await held.wait()
    return ctx.attempt


naps: dict[str, int] = {}
"""How often ``nap`` was called, per key: its first call snoozes for a day."""


@registry.task("nap")
async def nap(params: dict[str, Any], ctx: TaskContext) -> int:
    naps[ctx.key] = naps.get(ctx.key, 0) + 1
    if naps[ctx.key] == 1:
        raise Snooze(DAY, "back tomorrow")
    return naps[ctx.key]


@registry.task("polite")
async def polite(params: dict[str, Any], ctx: TaskContext) -> int:
    naps[ctx.key] = naps.get(ctx.key, 0) + 1
    if params.get("back_off") and naps[ctx.key] == 1:
        raise BackOff(DAY.total_seconds(), group=True, reason="429 from the provider")
    return naps[ctx.key]


@registry.task("shy")
async def shy(params: dict[str, Any], ctx: TaskContext) -> int:
    naps[ctx.key] = naps.get(ctx.key, 0) + 1
    if params.get("back_off") and naps[ctx.key] == 1:
        raise BackOff(3600, name=True, reason="429 from the provider")
    return naps[ctx.key]


@registry.task("overdue")
async def overdue(params: dict[str, Any], ctx: TaskContext) -> None:
    await ctx.sleep(2 * DAY.total_seconds())  # its deadline, a day away, ends the sleep


ticking = Registry()
ticking.schedule("daily", cron="0 9 * * *")
ticking.schedule("pulse", every=dt.timedelta(hours=12))


@ticking.task("daily")
async def daily(params: Any, ctx: TaskContext) -> str:
    return ctx.key


@ticking.task("pulse")
async def pulse(params: Any, ctx: TaskContext) -> str:
    return ctx.key


def needs_libfaketime() -> None:
    try:
        find_libfaketime()
    except ConfigError as exc:
        missing(str(exc))


@pytest.fixture
async def env(db_name: str) -> AsyncIterator[TimeSkippingEnv]:
    needs_libfaketime()
    async with TimeSkippingEnv(registry, database=db_name) as skipping:
        clients[db_name] = skipping.client
        yield skipping


async def month(client: AsyncTaskClient, db: str, key: str, day: float, now: dt.datetime) -> None:
    """The workflow ``key`` published at ``now``, its days ``day`` seconds long, and the approver
    due on day 20."""
    end = now + dt.timedelta(seconds=30 * day)
    retry = {"retry_delay_ms": int(day * 500), "retry_backoff": 1.0}  # half a day
    await client.publish(
        "onboard", key, {"day": day, "end": end.isoformat(), "db": db}, options=retry
    )
    await client.publish("approve", f"{key}-approval", {"db": db, "workflow": key}, delay=20 * day)


async def documents(client: AsyncTaskClient, key: str) -> dict[str, Any]:
    """What the run left, free of times and ids: each task's status and result, its steps'
    names, kinds and states, its runs' states."""
    tasks = [t for t in await client.list(limit=100) if t.key.startswith(key)]
    return {
        t.key: (
            t.status,
            t.result,
            [(s.name, s.kind, s.state) for s in t.steps],
            [r.state for r in t.runs],
        )
        for t in tasks
    }


async def test_a_month_skipped_through_ends_as_on_real_time(
    env: TimeSkippingEnv, mongo_uri: str, db_name: str
) -> None:
    start = await env.now()
    await month(env.client, db_name, "m", DAY.total_seconds(), start)
    task = await env.wait("m", timeout=90)  # every wait skipped: no real day passes
    assert task.finished_at is not None
    took = task.finished_at - start
    assert dt.timedelta(days=30) <= took < dt.timedelta(days=30, hours=1)
    skipped = await documents(env.client, "m")
    # each check-in a day after the one before (by the server's clock, skipped)
    checkins = [s.started_at for s in task.steps if s.name.startswith("checkin-")]
    gaps = [b - a for a, b in itertools.pairwise(checkins)]
    assert len(checkins) == 7 and all(DAY <= gap < DAY + dt.timedelta(minutes=5) for gap in gaps)
    failed = [r for r in task.runs if r.state == "FAIL"]
    assert len(failed) == 1 and "payment service is down" in (failed[0].error or "")

    # the same month on real time (the suite's server), a day a quarter of a second
    real_db = f"{db_name}_real"
    async with (
        AsyncTaskClient(mongo_uri, database=real_db) as client,
        running_worker(registry, mongo_uri, real_db),
    ):
        clients[real_db] = client
        try:
            await month(client, real_db, "m", SCALED_DAY, await client.now())
            await client.wait("m", timeout=60)
            real = await documents(client, "m")
        finally:
            await client.mongo.drop_database(real_db)
    assert skipped == real, f"{skipped}\n{real}"
    assert skipped["m"][1] == {
        "invoice": "invoice-m",
        "report": "report on invoice-m",
        "by": "ann",
    }


async def test_skip_never_makes_a_task_due_early(env: TimeSkippingEnv) -> None:
    """Due in an hour: not claimed after a skip of 59 minutes (a task due now, published after
    the skip, is run first: the claimer, woken by the skip, pops due keys soonest first), and
    claimed after one more minute, with no further skip. A skip back is refused, and the
    workers live on through a skip of a month."""
    published = await env.now()
    await env.client.publish("report", "later", {"invoice": "x"}, delay=dt.timedelta(hours=1))
    before = await env.skip(dt.timedelta(minutes=59))
    assert dt.timedelta(minutes=59) <= before - published < dt.timedelta(hours=1)
    await env.client.publish("report", "now", {"invoice": "y"})
    await env.client.wait("now", timeout=30)
    assert (await env.client.get("later")).runs == []  # type: ignore[union-attr]
    await env.skip(dt.timedelta(minutes=1))
    task = await env.client.wait("later", timeout=30)
    assert task.runs[0].claimed_at >= published + dt.timedelta(hours=1)
    for wrong in (-1, dt.timedelta(seconds=-5), float("nan")):  # never backward
        with pytest.raises(ValueError, match="forward only"):
            await env.skip(wrong)
    # a month in one skip: the workers' change streams and sessions live on
    month_later = await env.skip(dt.timedelta(days=30))
    await env.client.publish("report", "next-month", {"invoice": "z"})
    after = await env.client.wait("next-month", timeout=30)
    assert after.runs[0].claimed_at >= month_later
    # a name held back for an hour (its handler's BackOff), another of its tasks due: the
    # automatic mode skips to the hold's end, not past it
    await env.client.set_limit("shy", concurrency=10)  # the take reads the hold at once
    naps.pop("shy-1", None)
    await env.client.publish("shy", "shy-1", {"back_off": True})

    async def released() -> Task | None:
        task = await env.client.get("shy-1")
        return task if task is not None and task.runs and task.runs[0].finished_at else None

    backed = (await wait_for(released, timeout=30)).runs[0]
    assert backed.finished_at is not None
    await env.client.publish("shy", "shy-2", {})
    second = await env.wait("shy-2", timeout=30)
    claimed = second.runs[0].claimed_at
    assert backed.claimed_at + dt.timedelta(hours=1) <= claimed  # the hold began after it
    assert claimed < backed.finished_at + dt.timedelta(hours=1, minutes=1)


async def test_skip_ends_a_lease_when_the_clock_passes_it(env: TimeSkippingEnv) -> None:
    """A run's lease of a minute, pinged every 50 s of real time: a skip of half a minute
    leaves it running; once the clock passes its end, another worker takes the task over at
    once (no further skip), and the first run's lease had ended by then."""
    held.clear()
    lease = {"worker_timeout_ms": 60_000, "ping_interval_ms": 50_000}
    await env.client.publish("hold", "held", {}, options=lease)

    async def claimed() -> Task | None:
        task = await env.client.get("held")
        return task if task is not None and task.runs else None

    first = (await wait_for(claimed, timeout=30)).runs[0]
    assert first.state == "RUNNING" and first.lease_expires_at is not None
    assert await env.skip(30) < first.lease_expires_at
    await env.skip(31)
    try:
        await env.start_worker()  # its scan finds the task claimable: the lease ended
        done = await env.client.wait("held", timeout=30)
    finally:
        held.set()
    assert done.result == 2
    assert done.runs[-1].claimed_at >= first.lease_expires_at


async def test_a_snooze_a_hold_a_debounce_window_and_a_deadline_end_after_their_day(
    env: TimeSkippingEnv, db_name: str
) -> None:
    """A handler snoozing for a day, one holding its group back for a day (``BackOff``), a
    publish debounced for a day and a task whose deadline is a day away (its handler sleeping
    for two): a skip to a minute before the day leaves all four as they were, and the group's
    other task unclaimed (a task due now, published then, runs meanwhile); a skip past it runs
    the snoozed task again, the held group's two and the debounced one, and fails the task
    past its deadline."""
    naps.pop("napper", None)
    naps.pop("polite", None)
    naps.pop("sibling", None)
    start = await env.now()
    await env.client.publish("nap", "napper", {})
    await env.client.publish("polite", "polite", {"back_off": True}, options={"group": "acme"})
    window = await env.client.publish("report", "debounced", {"invoice": "d"}, debounce=DAY)
    debounced_key = window.task.key  # the window's own key
    deadline = {"deadline": start + DAY}
    await env.client.publish("overdue", "overdue", {}, options=deadline)

    async def settled() -> bool | None:
        """The snooze raised and the sleep begun, each by its run's end."""
        ran = [await env.client.get(key) for key in ("napper", "polite", "overdue")]
        ended = [t is not None and t.runs and t.runs[0].finished_at for t in ran]
        return True if all(ended) else None

    await wait_for(settled, timeout=30)
    assert naps["napper"] == 1 and naps["polite"] == 1
    await env.client.publish("polite", "sibling", {}, options={"group": "acme"})
    before = await env.skip(start + DAY - dt.timedelta(minutes=1) - await env.now())
    assert before < start + DAY
    await env.client.publish("report", "probe", {"invoice": "p"})
    await env.client.wait("probe", timeout=30)
    assert naps["napper"] == 1 and naps["polite"] == 1
    assert (await env.client.get("sibling")).runs == []  # type: ignore[union-attr]
    assert (await env.client.get(debounced_key)).runs == []  # type: ignore[union-attr]
    assert (await env.client.get("overdue")).status not in ("succeeded", "failed")  # type: ignore[union-attr]

    after = await env.skip(dt.timedelta(minutes=5))
    napped = await env.client.wait("napper", timeout=30)
    assert napped.result == 2 and napped.runs[-1].claimed_at >= start + DAY
    for key in ("polite", "sibling"):  # the group's hold ended: both run
        held_back = await env.client.wait(key, timeout=30)
        assert held_back.status == "succeeded" and held_back.runs[-1].claimed_at >= start + DAY
    debounced = await env.client.wait(debounced_key, timeout=30)
    assert debounced.status == "succeeded" and debounced.runs[0].claimed_at >= start + DAY
    late = await env.client.wait("overdue", timeout=30)
    assert late.status == "failed" and "deadline passed" in (late.runs[-1].error or "")
    assert late.finished_at is not None and start + DAY <= late.finished_at
    assert after >= start + DAY


async def test_a_daily_schedule_ticks_once_a_skipped_day(db_name: str) -> None:
    """A cron schedule at 09:00 every day and an interval one every twelve hours, skipped through
    by themselves for three days: one task a day, one each twelve hours, each published at its
    tick by the server's clock (never before)."""
    needs_libfaketime()
    async with TimeSkippingEnv(ticking, database=db_name) as env:
        start = await env.now()

        async def three_days() -> list[Task] | None:
            done = await env.client.list(name="daily", status="succeeded")
            return done if len(done) >= 3 else None

        done = await env.run_until(wait_for(three_days, timeout=90), timeout=90)
        pulsed = await env.client.list(name="pulse", status="succeeded", limit=100)
    ticks = sorted(t.created_at for t in done if t.created_at is not None)
    assert len(ticks) >= 3 and all(t > start for t in ticks)
    assert all((t.hour, t.minute) == (9, 0) for t in ticks[:3])
    gaps = [b - a for a, b in itertools.pairwise(ticks[:3])]
    assert all(abs(gap - DAY) < dt.timedelta(minutes=5) for gap in gaps)
    pulses = sorted(t.created_at for t in pulsed if t.created_at is not None)
    assert len(pulses) >= 4  # the first when the schedule was created, then one each 12 h
    half_day = dt.timedelta(hours=12)
    gaps = [b - a for a, b in itertools.pairwise(pulses)]
    assert all(abs(gap - half_day) < dt.timedelta(minutes=5) for gap in gaps), gaps
