"""A changed limit applies on its event, for every kind: three real worker
processes, their periodic read of the limits set to an hour so that only the change's event
can apply it (or, with the shared stream, the read of every limit a worker makes when its relay
says ``OPEN``: a subscription begun again under load, after a relay's takeover or after being
let go, heard no event meanwhile), with an own change stream each and with the shared one.

Each scenario changes a limit while runs are in flight, waits until every worker says it
applies the change (``limits_applied`` in its log) and every run claimed so far has started,
then checks, from the handlers' own start and end times (the execution log, the server's
clock), that every run started from then on respects the new limit: at its start, no more runs
of its name or group were running than the limit allows (the runs in flight at the change
count towards it and finish), or its rate's tokens allow. A raised or cleared limit must be
used: more runs at once than the old limit allowed. The time from the change to the last run
started under the old limit is measured in the bench (``python -m bench --only WL``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from harness import Cluster, until_finished, wait_for

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

WORKERS = ("a", "b", "c")
APPLIED = "limits_applied name=work"
Span = tuple[dt.datetime, dt.datetime, str]
"""A run's start and end (the handler's own, on the server's clock) and its key."""
NOT_YET = dt.datetime.max.replace(tzinfo=dt.UTC)
"""The end of a run that has not ended yet."""


def spawn(cluster: Cluster, stream: str) -> None:
    for worker in WORKERS:
        cluster.spawn(
            worker,
            *("--concurrency", "4", "--prefetch", "0", "--stream", stream),
            *("--limits-refresh", "3600"),  # no periodic read: only the change's event applies it
        )


def applied(cluster: Cluster) -> dict[str, int]:
    """How many times each worker said it applies a change of ``work``'s limit."""
    return {w: cluster.log_of(w).count(APPLIED) for w in WORKERS}


async def until_applied(cluster: Cluster, before: dict[str, int]) -> None:
    """Wait until every worker has said it applies one more change than ``before``."""
    try:
        await wait_for(lambda: all(n > before[w] for w, n in applied(cluster).items()), timeout=30)
    except TimeoutError:
        late = [w for w, n in applied(cluster).items() if n <= before[w]]
        raise AssertionError(f"workers {late} never said they apply the change") from None


def spans(mongo: Any, db_name: str) -> dict[str, Span]:
    """Every handler run so far, by run id (one that has not ended yet ends ``NOT_YET``)."""
    runs: dict[str, dict[str, Any]] = {}
    for entry in mongo[db_name]["execlog"].find():
        run = runs.setdefault(entry["run_id"], {"key": entry["key"]})
        run["start" if entry["event"] == "start" else "end"] = entry["at"]
    return {
        rid: (r["start"], r.get("end", NOT_YET), r["key"])
        for rid, r in runs.items()
        if "start" in r
    }


async def cut(client: TaskClient, mongo: Any, db_name: str) -> dt.datetime:
    """Once the workers apply the change: wait until every run claimed so far has started its
    handler (a run claimed before the change, under the old limit, is one of the runs in flight
    it counts), and return the server's time. Every run that starts after it was claimed after
    every worker applied the change."""
    claimed = {
        run["run_id"]
        for doc in client.collection.find({}, {"runs": 1})
        for run in doc["runs"]
        if run["state"] != "RELEASED"
    }
    await wait_for(lambda: claimed <= spans(mongo, db_name).keys(), timeout=30)
    return client.now()


def crowd(runs: list[Span], at: dt.datetime) -> int:
    """Runs at once at ``at`` (a run that ended at that instant is not counted)."""
    return sum(1 for start, end, _ in runs if start <= at < end)


def peak(runs: list[Span]) -> int:
    return max((crowd(runs, start) for start, _, _ in runs), default=0)


def respects(runs: list[Span], after: dt.datetime, limit: int) -> list[str]:
    """The runs started after ``after`` beside more runs than ``limit`` (with who they met)."""
    return [
        f"{key} at {start:%H:%M:%S.%f} met {crowd(runs, start) - 1} runs: "
        + ", ".join(k for s, e, k in runs if s <= start < e and k != key)
        for start, _, key in runs
        if start > after and crowd(runs, start) > limit
    ]


def over_in_groups(runs: dict[str, Span], after: dt.datetime, limit: int) -> dict[str, list[str]]:
    """Per group, its runs started after ``after`` beside more runs of it than ``limit``."""
    return {
        g: over for g, spans in by_group(runs).items() if (over := respects(spans, after, limit))
    }


def by_group(runs: dict[str, Span]) -> dict[str, list[Span]]:
    groups: dict[str, list[Span]] = {}
    for span in runs.values():
        groups.setdefault(span[2].partition("/")[0], []).append(span)
    return groups


def publish(client: TaskClient, tasks: int, ms: int, groups: int | None = None) -> None:
    client.publish_many(
        [
            {
                "name": "work",
                "key": f"t{i:03d}" if groups is None else f"g{i % groups}/{i:03d}",
                "params": {"ms": ms},
                **({} if groups is None else {"options": {"group": f"g{i % groups}"}}),
            }
            for i in range(tasks)
        ]
    )


@dataclass
class Scenario:
    """Runs of ``work`` in flight, then a limit changed: what a test judges."""

    tasks: int
    ms: int
    groups: int | None
    """Spread over this many groups (``g0``, ``g1``, …), or none."""
    before: dict[str, Any] | None
    """The limit before (``None``: none)."""
    change: Callable[[TaskClient], object]
    ready: Callable[[dict[str, Span]], bool]
    """When the runs so far make the change worth judging."""


async def changed(
    cluster: Cluster,
    client: TaskClient,
    mongo: Any,
    db_name: str,
    stream: str,
    scenario: Scenario,
) -> tuple[dt.datetime, dt.datetime, dict[str, Span]]:
    """Run ``scenario`` to its end on three workers: the server's time just before the change,
    the cut after which runs are judged, and every run."""
    if scenario.before is not None:
        client.set_limit("work", **scenario.before)
    spawn(cluster, stream)
    if scenario.before is not None:
        await until_applied(cluster, dict.fromkeys(WORKERS, 0))  # the first read
    publish(client, scenario.tasks, scenario.ms, scenario.groups)
    await wait_for(lambda: scenario.ready(spans(mongo, db_name)), timeout=60)
    before = applied(cluster)
    changed_at = client.now()
    scenario.change(client)
    await until_applied(cluster, before)
    after = await cut(client, mongo, db_name)
    await until_finished(client, scenario.tasks, timeout=120, explain=cluster.explainer(client))
    return changed_at, after, spans(mongo, db_name)


STREAMS = pytest.mark.parametrize("stream", ["own", "shared"])


def running(runs: dict[str, Span] | list[Span]) -> int:
    """Runs that have started and not ended yet."""
    return sum(1 for s in (runs.values() if isinstance(runs, dict) else runs) if s[1] == NOT_YET)


@STREAMS
async def test_a_lowered_concurrency_starts_no_run_while_the_runs_in_flight_exceed_it(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str, stream: str
) -> None:
    scenario = Scenario(
        24, 300, None, {"concurrency": 4}, lambda c: c.set_limit("work", concurrency=1),
        lambda runs: running(runs) >= 3,
    )  # fmt: skip
    changed_at, after, by_run = await changed(cluster, client, mongo, db_name, stream, scenario)
    runs = list(by_run.values())
    assert crowd(runs, changed_at) >= 3, "runs in flight exceeded the new limit at the change"
    assert not respects(runs, after, 1), respects(runs, after, 1)
    assert sum(1 for s, _, _ in runs if s > after) >= 5, "runs started under the new limit"


def recording_slots(mongo: Any, db_name: str) -> Any:
    """Keep the post-image of every change to the ``limits`` collection from now on, and
    return the cluster time to read them from (``taken_at``)."""
    db = mongo[db_name]
    images = {"changeStreamPreAndPostImages": {"enabled": True}}
    if "limits" in db.list_collection_names():
        db.command("collMod", "limits", **images)
    else:
        db.create_collection("limits", **images)
    return db.command("ping")["operationTime"]


def taken_at(mongo: Any, db_name: str, since: Any) -> dict[str, dt.datetime]:
    """When each run first held a place in a slot (the server's time of the write that put it
    among the holders), from the ``limits`` collection's changes since ``since``."""
    first: dict[str, dt.datetime] = {}
    with mongo[db_name]["limits"].watch(
        start_at_operation_time=since, full_document="required", max_await_time_ms=200
    ) as stream:
        while (event := stream.try_next()) is not None:
            for holder in (event.get("fullDocument") or {}).get("holders") or ():
                first.setdefault(holder["run_id"], event["wallTime"])
    return first


@STREAMS
async def test_a_limit_set_where_there_was_none_counts_the_runs_in_flight(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str, stream: str
) -> None:
    """Each worker counts its own runs in flight in (``limits_applied``): a place taken before
    the last of them did may be taken beside runs not counted in yet, so the runs judged are
    those whose place was taken once every worker applied the change."""
    since = recording_slots(mongo, db_name)
    scenario = Scenario(
        36, 400, None, None, lambda c: c.set_limit("work", concurrency=2),
        lambda runs: running(runs) >= 6,
    )  # fmt: skip
    changed_at, after, by_run = await changed(cluster, client, mongo, db_name, stream, scenario)
    taken = taken_at(mongo, db_name, since)
    runs = list(by_run.values())
    assert crowd(runs, changed_at) >= 6
    # every run started after the cut held a place (the recording saw each take)
    assert all(rid in taken for rid, span in by_run.items() if span[0] > after), taken
    early = {span[2] for rid, span in by_run.items() if rid in taken and taken[rid] <= after}
    over = [said for said in respects(runs, after, 2) if said.split(" ", 1)[0] not in early]
    assert not over, (over, sorted(early))
    assert sum(1 for s, _, k in runs if s > after and k not in early) >= 5


@STREAMS
async def test_a_group_concurrency_lowered_to_a_sequence_applies_to_every_group(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str, stream: str
) -> None:
    """The issue's case: lowered from 3 to 1, each group ran 3 at once for another 18-24 s."""
    scenario = Scenario(
        36, 300, 3, {"group_concurrency": 3}, lambda c: c.set_limit("work", group_concurrency=1),
        lambda runs: any(running(g) >= 2 for g in by_group(runs).values()),
    )  # fmt: skip
    changed_at, after, by_run = await changed(cluster, client, mongo, db_name, stream, scenario)
    assert max(crowd(g, changed_at) for g in by_group(by_run).values()) >= 2
    assert not over_in_groups(by_run, after, 1), over_in_groups(by_run, after, 1)
    assert sum(1 for s, _, _ in by_run.values() if s > after) >= 6


@STREAMS
@pytest.mark.parametrize(
    ("change", "limit"),
    [
        (lambda c: c.set_limit("work", group_concurrency=3), 3),
        (lambda c: c.clear_limit("work"), None),
    ],
    ids=["raised", "cleared"],
)
async def test_a_raised_or_cleared_group_limit_is_used(
    cluster: Cluster,
    client: TaskClient,
    mongo: Any,
    db_name: str,
    stream: str,
    change: Callable[[TaskClient], object],
    limit: int | None,
) -> None:
    """From a sequence to 3 at once (the task that holds a group's lock counts towards the
    3), or to no limit: more runs of a group at once than one, never more than the limit."""
    scenario = Scenario(36, 300, 3, {"group_concurrency": 1}, change, lambda runs: len(runs) >= 3)
    _, after, by_run = await changed(cluster, client, mongo, db_name, stream, scenario)
    if limit is not None:
        assert not over_in_groups(by_run, after, limit), over_in_groups(by_run, after, limit)
    later = [[s for s in g if s[0] > after] for g in by_group(by_run).values()]
    assert max(peak(g) for g in later) > 1, "the new limit was used"


@STREAMS
async def test_a_lowered_group_rate_applies(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str, stream: str
) -> None:
    """20 claims a second per group, lowered to 2 (a bucket of one): the starts after the
    change keep to 2 a second in each group."""
    rate, burst = 2.0, 1
    scenario = Scenario(
        28, 20, 2, {"group_rate": 20.0, "group_burst": 1},
        lambda c: c.set_limit("work", group_rate=rate, group_burst=burst),
        lambda runs: all(len(g) >= 4 for g in by_group(runs).values()),
    )  # fmt: skip
    _, after, by_run = await changed(cluster, client, mongo, db_name, stream, scenario)
    for group, runs in by_group(by_run).items():
        starts = sorted(s for s, _, _ in runs if s > after)
        assert len(starts) >= 4, (group, starts)
        # a token bucket: in any t seconds at most burst + rate * t starts. The starts are the
        # handlers', each some milliseconds after its claim, more on a loaded host (as the
        # claims' times in test_cluster_limits.py; two starts 0.23 s apart beside another
        # suite): one token's interval of slack, so two starts pass however close, three
        # need a quarter of a second and four three quarters (the old 20 a second made four
        # starts in 0.15 s)
        slack = 1 / rate
        for i in range(len(starts)):
            for j in range(i, len(starts)):
                window = (starts[j] - starts[i]).total_seconds() + slack
                assert j - i + 1 <= burst + rate * window, (group, starts[i], starts[j])
