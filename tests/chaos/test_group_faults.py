"""Per-group limits and sequences, held by three real worker processes through
kills and freezes, checked from the execution log (server times) and the task documents' run
arrays."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import signal
from collections import defaultdict
from typing import Any

import pytest
from harness import Cluster, in_groups, until_finished, wait_for
from test_cluster_limits import crowd, peak

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

FAST = {"worker_timeout_ms": 2000, "ping_interval_ms": 300, "retry_delay_ms": 50}


Span = tuple[dt.datetime, dt.datetime, str]


def runs_of(mongo: Any, db_name: str) -> dict[str, list[Span]]:
    """Per task, (start, end, state) of each run that counts: its entry in the task's run
    array is SUCCESS or FAIL (a run taken over after its lease ran out is TIMEOUT: fenced, it
    does not count), its times from the execution log (the server's clock)."""
    starts: dict[str, dt.datetime] = {}
    ends: dict[str, dt.datetime] = {}
    for entry in mongo[db_name]["execlog"].find():
        if entry["event"] == "start":
            starts[entry["run_id"]] = entry["at"]
        elif entry["event"] in ("finish", "fail"):
            ends[entry["run_id"]] = entry["at"]
    out: dict[str, list[Span]] = defaultdict(list)
    for doc in mongo[db_name]["tasks"].find({}, {"runs": 1}):
        for run in doc["runs"]:
            if run["state"] in ("SUCCESS", "FAIL"):
                rid = run["run_id"]
                out[doc["_id"]].append((starts[rid], ends[rid], run["state"]))
    return out


def ends_of_frozen(log: Any, stopped: dt.datetime) -> dict[str, str]:
    """How each run of worker ``b`` running when it was frozen (at ``stopped``) ended (``""``:
    not yet)."""
    runs: dict[str, dict[str, Any]] = defaultdict(dict)
    for entry in log.find({"worker_id": "b"}):
        runs[entry["run_id"]][entry["event"]] = entry["at"]
    return {
        rid: next((e for e in r if e != "start"), "")
        for rid, r in runs.items()
        if r["start"] < stopped and all(at > stopped for e, at in r.items() if e != "start")
    }


async def kill_a_and_freeze_b(
    cluster: Cluster, client: TaskClient, log: Any
) -> tuple[dict[str, dt.datetime], dt.datetime, dt.datetime]:
    """The faults of this file's and test_shared_resources.py's runs: worker ``a`` killed
    with SIGKILL (``d`` takes its place); ``b``, once it runs something, frozen with SIGSTOP
    past its leases (its runs last long: on waking, they are past their leases and not done),
    woken, and killed once each run frozen mid-run ended. Returns when each killed worker was
    killed (``cuts``, the server's clock) and the times read just before the freeze and just
    after it."""
    cluster.signal("a", signal.SIGKILL)
    cuts = {"a": client.now()}
    cluster.spawn("d", "--concurrency", "8")

    def b_running() -> bool:
        started = {e["run_id"] for e in log.find({"worker_id": "b", "event": "start"})}
        ended = {e["run_id"] for e in log.find({"worker_id": "b", "event": {"$ne": "start"}})}
        return bool(started - ended)

    await wait_for(b_running, timeout=120)
    stopped = client.now()
    cluster.signal("b", signal.SIGSTOP)
    await asyncio.sleep(FAST["worker_timeout_ms"] / 1000 + 1.5)  # the fault: past its leases
    resumed = client.now()
    cluster.signal("b", signal.SIGCONT)
    await wait_for(lambda: all(ends_of_frozen(log, stopped).values()), timeout=60)
    cluster.signal("b", signal.SIGKILL)
    cuts["b"] = client.now()
    return cuts, stopped, resumed


def publish_groups(client: TaskClient, groups: int, each: int, **params: Any) -> None:
    """``each`` tasks in each of ``groups`` groups, published interleaved (g0/0, g1/0, …,
    g0/1, …) in one call; a task of every seventh index fails once."""
    client.publish_many(
        [
            {
                "name": "work",
                "key": f"g{g:02d}/{i:02d}",
                "params": {**params, "fail_attempts": 1 if (g + i) % 7 == 0 else 0},
                "options": {**FAST, "group": f"g{g:02d}"},
            }
            for i in range(each)
            for g in range(groups)
        ]
    )


async def test_sequences_run_one_at_a_time_in_publish_order_through_kills_and_freezes(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    """20 groups x 10 tasks, ``group_concurrency=1``, 3 workers; some tasks fail once; one
    worker is killed with SIGKILL and one frozen past its leases. In every group no two
    counted runs overlap, and the successes come in publish order."""
    client.set_limit("work", group_concurrency=1)
    for worker in ("a", "b", "c"):
        cluster.spawn(worker, "--concurrency", "8")
    publish_groups(client, 20, 10, ms=60)
    tasks = mongo[db_name]["tasks"]
    await wait_for(lambda: tasks.count_documents({"status": "succeeded"}) >= 30, timeout=120)
    cluster.signal("a", signal.SIGKILL)
    await wait_for(lambda: tasks.count_documents({"status": "succeeded"}) >= 70, timeout=120)
    cluster.signal("b", signal.SIGSTOP)
    await asyncio.sleep(FAST["worker_timeout_ms"] / 1000 + 1.5)  # the fault: past its leases
    cluster.signal("b", signal.SIGCONT)
    await until_finished(client, 200, timeout=300, explain=cluster.explainer(client))
    assert client.stats()["work"] == {"succeeded": 200}

    runs = runs_of(mongo, db_name)
    for g in range(20):
        keys = [f"g{g:02d}/{i:02d}" for i in range(10)]  # in publish order
        spans = sorted(span for key in keys for span in runs[key])
        for before, after in itertools.pairwise(spans):
            assert before[1] <= after[0], f"g{g:02d}: two runs at once: {before} and {after}"
        ends = [next(end for _, end, state in runs[key] if state == "SUCCESS") for key in keys]
        assert ends == sorted(ends), f"g{g:02d}: successes out of publish order"
    took_over = tasks.count_documents({"runs.state": "TIMEOUT"})
    assert took_over >= 1, "the kill and the freeze left runs to take over"


async def test_group_concurrency_holds_across_three_workers(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    """``group_concurrency=2`` over 5 groups x 40 tasks on 3 workers: never more than two
    runs at once in a group (and two are reached)."""
    client.set_limit("work", group_concurrency=2)
    for worker in ("a", "b", "c"):
        cluster.spawn(worker, "--concurrency", "8")
    client.publish_many(in_groups("work", "e", groups=5, each=40, params={"ms": 30}))
    await until_finished(client, 200, timeout=300, explain=cluster.explainer(client))
    assert client.stats()["work"] == {"succeeded": 200}
    runs = runs_of(mongo, db_name)
    for g in range(5):
        spans = [(a, b) for key, got in runs.items() if key.startswith(f"e{g}/") for a, b, _ in got]
        assert len(spans) == 40
        counted = {
            run["run_id"]
            for doc in mongo[db_name]["tasks"].find({"options.group": f"e{g}"}, {"runs": 1})
            for run in doc["runs"]
            if run["state"] in ("SUCCESS", "FAIL")
        }
        assert peak(spans) == 2, (
            f"e{g}: at most two at once, and two reached",
            crowd(mongo, db_name, counted),
        )

    # every slot was given back, and the groups' documents say so: a worker gives a run's slot
    # back once its outcome is written, a moment after the last success shows (a rehearsal
    # read one still held), and well before a slot's lease (30 s) could have run out
    def given_back() -> bool:
        groups = list(mongo[db_name]["limits"].find({"group": {"$exists": True}}))
        assert sorted(d["group"] for d in groups) == [f"e{g}" for g in range(5)]
        return all(d["holders"] == [] for d in groups)

    await wait_for(given_back, timeout=10)


def effective_spans(
    mongo: Any, db_name: str, cuts: dict[str, dt.datetime], frozen: tuple[str, Any, Any]
) -> dict[str, list[tuple[dt.datetime, dt.datetime]]]:
    """Per group, when each run's handler was running, from the execution log (the server's
    clock), zombies and runs taken over included: a run of a killed worker ends at the kill
    (``cuts``: worker id to its kill's time, read once the process was gone); a run of the
    frozen worker (``frozen``: its id, and the times read just before the SIGSTOP and just
    before the SIGCONT) ran nothing while frozen, and nothing after it either when it ended
    ``cancelled``: its handler was asleep until the cancel (its only work is that sleep), and
    the entry lands as late as a woken, loaded process writes it."""
    worker, stopped, resumed = frozen
    runs: dict[str, dict[str, Any]] = {}
    for entry in mongo[db_name]["execlog"].find():
        run = runs.setdefault(entry["run_id"], {"key": entry["key"], "w": entry["worker_id"]})
        if entry["event"] == "start":
            run["start"] = entry["at"]
        else:
            run["end"], run["how"] = entry["at"], entry["event"]
    out: dict[str, list[tuple[dt.datetime, dt.datetime]]] = defaultdict(list)
    for run in runs.values():
        group = run["key"].partition("/")[0]
        end = run.get("end") or cuts[run["w"]]  # no end: its worker was killed
        if run["w"] == worker and run["start"] < stopped < end:
            out[group].append((run["start"], stopped))
            if end > resumed and run.get("how") != "cancelled":
                out[group].append((resumed, end))
        else:
            out[group].append((run["start"], end))
    return out


async def test_group_concurrency_above_one_and_a_group_rate_hold_through_kills_and_freezes(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    """``group_concurrency=2`` and ``group_rate=5/s`` over 4 groups x 30 tasks on three
    workers; one is killed with SIGKILL (another takes its place), one frozen with SIGSTOP past
    its leases, then killed too. From the handlers' own start and end times, zombies included:
    never more than two runs at once in a group (and two reached); from each take's own time,
    never more claims than the group's bucket allows; a frozen run is stopped at its first
    step after the freeze (it logs ``cancelled``: nothing of its work runs beside the runs that
    took its place)."""
    rate, burst = 5.0, 2
    client.set_limit("work", group_concurrency=2, group_rate=rate, group_burst=burst)
    for worker in ("a", "b", "c"):
        cluster.spawn(worker, "--concurrency", "8")
    # the frozen worker's runs last long: on waking, its run is past its lease and not done
    client.publish_many(
        [
            {
                "name": "work",
                "key": f"r{g}/{i:02d}",
                "params": {"ms": 150, "ms_by_worker": {"b": 20_000}},
                "options": {**FAST, "group": f"r{g}"},
            }
            for i in range(30)
            for g in range(4)
        ]
    )
    tasks, log = mongo[db_name]["tasks"], mongo[db_name]["execlog"]
    await wait_for(lambda: tasks.count_documents({"status": "succeeded"}) >= 20, timeout=120)
    cuts, stopped, resumed = await kill_a_and_freeze_b(cluster, client, log)
    await until_finished(client, 120, timeout=300, explain=cluster.explainer(client))
    assert client.stats()["work"] == {"succeeded": 120}
    # the runs frozen mid-run were stopped at their first step after the freeze
    frozen = ends_of_frozen(log, stopped)
    assert frozen and set(frozen.values()) == {"cancelled"}, frozen
    spans = effective_spans(mongo, db_name, cuts, ("b", stopped, resumed))
    # every run's take of its group's token, at the take's own time (its claimed_at), zombies'
    # and killed runs' included: a handler starts as long after its claim as the machine's
    # load makes it, so starts bunch up and would read as more than the bucket granted
    claims: dict[str, list[dt.datetime]] = defaultdict(list)
    for doc in tasks.find({}, {"runs.claimed_at": 1}):
        for run in doc["runs"]:
            claims[doc["_id"].partition("/")[0]].append(run["claimed_at"])
    for g in range(4):
        group = f"r{g}"
        assert peak(spans[group]) == 2, (f"{group}: two at once at most", crowd(mongo, db_name))
        # a token bucket: at most burst + rate * t claims in t seconds (the workers' readings
        # of the server's clock may disagree: a quarter of a second, test_cluster_limits.py)
        ordered, slack = sorted(claims[group]), 0.25
        for i in range(len(ordered)):
            for j in range(i, len(ordered)):
                window = (ordered[j] - ordered[i]).total_seconds() + slack
                assert j - i + 1 <= burst + rate * window, (group, ordered[i], ordered[j])
    took_over = tasks.count_documents({"runs.state": "TIMEOUT"})
    assert took_over >= 1, "the kill and the freeze left runs to take over"

    # no run keeps a slot: each holder is given back or runs out with its lease (2 s). One
    # may be seen for a moment after the last success: a worker still trying a key whose
    # task another worker finished takes its slot before its claim, which misses and gives
    # it back (seen: a holder 40 ms old, of a run id no task has, gone a moment later); a
    # holder kept alive (pinged on by a run that ended, or never given back) stays past it
    def nothing_held() -> bool:
        now = client.now()
        groups = mongo[db_name]["limits"].find({"group": {"$exists": True}})
        return all(h["expires"] <= now for doc in groups for h in doc["holders"])

    try:
        await wait_for(nothing_held, timeout=FAST["worker_timeout_ms"] / 1000 * 5)
    except TimeoutError:
        held = list(mongo[db_name]["limits"].find({"holders.expires": {"$gt": client.now()}}))
        raise AssertionError(f"a slot still held past its lease: {held}") from None
