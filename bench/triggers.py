"""Bench WT, tasks that react to data (docs/triggers.md), on a mongod of the bench's
own (its CPU, read from ``/proc``, is this workload's alone):

- **change → task**: one worker follows a trigger on ``orders`` (its tasks are not run: the
  figure is the trigger's). A trickle of paid orders, one every 20 ms: each change's latency to
  its task (the task's ``created_at``, the worker's estimate of the server's clock, against the
  writer's clock, the same host's); then a burst of inserts, half of them paid: changes
  handled a second, mongod's CPU and the server's operations per matching change;
- **waits on data**: ``settle`` tasks each wait (``ctx.wait_until``) until their invoice is
  settled, one worker following ``invoices`` and two running the tasks. Once all wait: the
  change streams open on ``invoices`` (one); half the invoices are settled one by one, 20 a
  second, while the tasks' workers run (settle → the task's resumed run, and mongod's CPU and
  operations per woken task with its run); then the tasks' workers stop and the other half is
  settled (settle → the task woken, and mongod's CPU and operations per wake-up alone: the
  follower's read of the tasks, the predicates' check, the waking update, and what the woken
  task's change costs the other streams). CPU is all of mongod's while a phase lasts (the idle
  rate, measured before, is given beside it: it is not subtracted);
- **idle cost**: 16 worker processes (a host each, for mtask: a lease contender each; not
  network namespaces), first with no trigger, then with 10 triggers on 10 idle collections:
  mongod's CPU and the server's operations a second, and the difference.
"""

from __future__ import annotations

import datetime as dt
import os
import statistics
import subprocess
import time
from typing import TYPE_CHECKING, Any

from pymongo import MongoClient

from bench.support import QUICK, ROOT, Result, pct, stop_process, wait_until
from mtask.client import TaskClient
from mtask.registry import Registry, TaskContext
from mtask.testing import worker_argv

if TYPE_CHECKING:
    from bench.workloads import Bench

Doc = dict[str, Any]
IDLE_TRIGGERS = 10
HOSTS = 16
NEVER_SOON = dt.datetime(9000, 1, 1, tzinfo=dt.UTC)
"""Before this: a wait's ``next_claim_at`` once woken (a wait without a timeout waits until
9999)."""


async def _noop(params: Doc) -> None:
    return None


async def _settle(params: Doc, ctx: TaskContext) -> Any:
    invoice = await ctx.wait_until("invoices", {"_id": params["invoice"], "status": "settled"})
    return invoice.get("total")


def _registry(triggers: int = 0, live: bool = False) -> Registry:
    registry = Registry()
    registry.task("noop")(_noop)
    for i in range(triggers):
        registry.trigger(f"idle{i}", task="noop", name=f"idle{i}", match={"status": "paid"})
    if live:
        registry.task("ship")(_noop)
        registry.task("settle")(_settle)
        registry.trigger("orders", task="ship", match={"status": "paid"}, params=["t"])
        registry.waits_on("invoices")
    return registry


plain = _registry()
idle_triggers = _registry(triggers=IDLE_TRIGGERS)
live = _registry(live=True)


def _spawn(uri: str, database: str, app: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        worker_argv(f"bench.triggers:{app}", uri, database, *extra),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _ops(mongo: MongoClient[Doc]) -> int:
    counters = mongo.admin.command("serverStatus")["opcounters"]
    return sum(int(counters[k]) for k in ("insert", "query", "update", "getmore", "command"))


def _held(mongo: MongoClient[Doc], database: str, count: int) -> bool:
    now = mongo.admin.command("hello")["localTime"]
    return mongo[database].triggers.count_documents({"expires_at": {"$gt": now}}) >= count


def _change_to_task(uri: str, pid: int, n_trickle: int, n_burst: int) -> Doc:
    from bench.scale import _cpu_s

    database = "wt_changes"
    mongo: MongoClient[Doc] = MongoClient(uri, tz_aware=True)
    mongo.drop_database(database)
    db = mongo[database]
    proc = _spawn(uri, database, "live", "--names", "noop")
    try:
        wait_until(lambda: _held(mongo, database, 2), timeout=120)
        time.sleep(1.0)
        for i in range(n_trickle):  # one every 20 ms
            db.orders.insert_one({"_id": f"t{i}", "status": "paid", "t": time.time()})
            time.sleep(0.02)
        trickled = {"name": "ship", "params.change.op": "insert"}
        wait_until(lambda: db.tasks.count_documents(trickled) >= n_trickle, timeout=300)
        lags = [
            (d["created_at"].timestamp() - d["params"]["t"]) * 1000
            for d in db.tasks.find(trickled, {"created_at": 1, "params.t": 1})
        ]
        cpu0, ops0, began = _cpu_s(pid), _ops(mongo), time.monotonic()
        docs = [{"_id": f"b{i}", "status": "paid" if i % 2 else "new"} for i in range(n_burst)]
        for start in range(0, n_burst, 500):
            db.orders.insert_many(docs[start : start + 500])
        matching = n_burst // 2
        wait_until(lambda: db.tasks.count_documents({}) >= n_trickle + matching, timeout=600)
        wall = time.monotonic() - began
        cpu, ops = _cpu_s(pid) - cpu0, _ops(mongo) - ops0 - n_burst // 500
    finally:
        stop_process(proc)
    mongo.drop_database(database)
    mongo.close()
    return {
        "trickle_p50_ms": statistics.median(lags),
        "trickle_p95_ms": pct(lags, 0.95),
        "burst_changes_per_s": n_burst / wall,
        "burst_tasks_per_s": matching / wall,
        "mongod_us_per_task": cpu * 1e6 / matching,
        "ops_per_task": ops / matching,
    }


def _settle_at(db: Any, ids: range, rate: float) -> dict[int, float]:
    """Settle these invoices one by one, ``rate`` a second; when each was settled."""
    settled: dict[int, float] = {}
    for i in ids:
        settled[i] = time.time()
        db.invoices.update_one({"_id": i}, {"$set": {"status": "settled"}})
        time.sleep(1 / rate)
    return settled


def _cpu_rate(pid: int, seconds: float) -> float:
    from bench.scale import _cpu_s

    cpu0, began = _cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (_cpu_s(pid) - cpu0) / (time.monotonic() - began)


def _wakes(uri: str, pid: int, n: int) -> Doc:
    """Half the waits settled while their workers run (each wake-up and its task's resumed run),
    the other half once those workers stopped (the wake-up alone: the follower's read of the
    waiting tasks, the predicates' check, the waking update)."""
    from bench.scale import _cpu_s, _streams

    database = "wt_waits"
    mongo: MongoClient[Doc] = MongoClient(uri, tz_aware=True)
    mongo.drop_database(database)
    db = mongo[database]
    db.invoices.insert_many([{"_id": i, "status": "open", "total": i} for i in range(n)])
    holder = _spawn(uri, database, "live", "--names", "noop")
    runners = []
    try:
        wait_until(lambda: _held(mongo, database, 2), timeout=120)
        runners = [
            _spawn(uri, database, "live", "--names", "settle", "--concurrency", "32")
            for _ in range(2)
        ]
        with TaskClient(uri, database=database) as client:
            client.publish_many(
                {"name": "settle", "key": f"s{i}", "params": {"invoice": i}} for i in range(n)
            )
            waiting = {"status": "pending", "waiting.data.collection": "invoices"}
            wait_until(lambda: db.tasks.count_documents(waiting) == n, timeout=600)
            streams = _streams(mongo, database, "invoices")
            half = n // 2
            idle = _cpu_rate(pid, 10.0)
            cpu0, ops0 = _cpu_s(pid), _ops(mongo)
            settled = _settle_at(db, range(half), 20)
            done = {"name": "settle", "status": "succeeded"}
            wait_until(lambda: db.tasks.count_documents(done) == half, timeout=600)
            run_cpu = _cpu_s(pid) - cpu0
            run_ops = _ops(mongo) - ops0 - half  # less the bench's own updates
            ran = [
                (d["runs"][-1]["claimed_at"].timestamp() - settled[int(d["_id"][1:])]) * 1000
                for d in db.tasks.find(done, {"runs.claimed_at": 1})
            ]
            for runner in runners:
                stop_process(runner)
            cpu0, ops0 = _cpu_s(pid), _ops(mongo)
            settled = _settle_at(db, range(half, n), 20)
            due = {"name": "settle", "status": "pending", "next_claim_at": {"$lt": NEVER_SOON}}
            wait_until(lambda: db.tasks.count_documents(due) == n - half, timeout=600)
            wake_cpu = _cpu_s(pid) - cpu0
            wake_ops = _ops(mongo) - ops0 - (n - half)
            woke = [
                (d["updated_at"].timestamp() - settled[int(d["_id"][1:])]) * 1000
                for d in db.tasks.find(due, {"updated_at": 1})
            ]
    finally:
        for proc in [holder, *runners]:
            stop_process(proc)
    mongo.drop_database(database)
    mongo.close()
    return {
        "wait_streams": float(streams),
        "wake_p50_ms": statistics.median(woke),
        "wake_p95_ms": pct(woke, 0.95),
        "wake_max_ms": max(woke),
        "mongod_idle_pct": idle * 100,
        "mongod_us_per_wake": wake_cpu * 1e6 / (n - half),
        "ops_per_wake": wake_ops / (n - half),
        "resumed_p50_ms": statistics.median(ran),
        "resumed_p95_ms": pct(ran, 0.95),
        "mongod_us_per_resumed_task": run_cpu * 1e6 / half,
        "ops_per_resumed_task": run_ops / half,
    }


def _idle(uri: str, pid: int, app: str, seconds: float) -> Doc:
    from bench.scale import _cpu_s

    database = f"wt_idle_{app}"
    mongo: MongoClient[Doc] = MongoClient(uri, tz_aware=True)
    mongo.drop_database(database)
    procs = [_spawn(uri, database, app, "--concurrency", "4") for _ in range(HOSTS)]
    try:
        with TaskClient(uri, database=database) as client:
            wait_until(lambda: len(client.workers()) >= HOSTS, timeout=300)
            if app != "plain":
                wait_until(lambda: _held(mongo, database, IDLE_TRIGGERS), timeout=120)
            time.sleep(10.0)  # startups, first scans and looks done
            cpu0, ops0, began = _cpu_s(pid), _ops(mongo), time.monotonic()
            time.sleep(seconds)
            wall = time.monotonic() - began
            cpu, ops = _cpu_s(pid) - cpu0, _ops(mongo) - ops0
    finally:
        for proc in procs:
            stop_process(proc)
    mongo.drop_database(database)
    mongo.close()
    return {"cpu_pct": cpu / wall * 100, "ops_per_s": ops / wall}


def reacting(bench: Bench) -> None:
    from bench.scale import _own_mongod

    quick = bench.sizes is QUICK
    trickle, burst, waits = (100, 2_000, 200) if quick else (300, 10_000, 1_000)
    idle_s = 15.0 if quick else 60.0
    load = os.getloadavg()[0]
    with _own_mongod() as (uri, pid, _port):
        changes = _change_to_task(uri, pid, trickle, burst)
        wakes = _wakes(uri, pid, waits)
        without = _idle(uri, pid, "plain", idle_s)
        with_triggers = _idle(uri, pid, "idle_triggers", idle_s)
    load = max(load, os.getloadavg()[0])
    extra_cpu = with_triggers["cpu_pct"] - without["cpu_pct"]
    extra_ops = with_triggers["ops_per_s"] - without["ops_per_s"]
    figure = (
        f"change → task p50 {changes['trickle_p50_ms']:.1f} ms (p95 "
        f"{changes['trickle_p95_ms']:.1f}); burst {changes['burst_changes_per_s']:.0f} changes/s "
        f"({changes['burst_tasks_per_s']:.0f} tasks/s), mongod {changes['mongod_us_per_task']:.0f}"
        f" µs and {changes['ops_per_task']:.2f} ops a task; {waits} data waits: "
        f"{wakes['wait_streams']:.0f} change stream; settle → woken p50 "
        f"{wakes['wake_p50_ms']:.0f} ms (p95 {wakes['wake_p95_ms']:.0f}, max "
        f"{wakes['wake_max_ms']:.0f}), mongod {wakes['mongod_us_per_wake']:.0f} µs and "
        f"{wakes['ops_per_wake']:.1f} ops a wake-up (idle: {wakes['mongod_idle_pct']:.2f} % of "
        f"a core); settle → resumed run p50 "
        f"{wakes['resumed_p50_ms']:.0f} ms (p95 {wakes['resumed_p95_ms']:.0f}), mongod "
        f"{wakes['mongod_us_per_resumed_task']:.0f} µs and "
        f"{wakes['ops_per_resumed_task']:.1f} ops a woken task with its run; "
        f"idle, {HOSTS} hosts: {without['cpu_pct']:.2f} % CPU, {without['ops_per_s']:.1f} ops/s "
        f"without triggers, {with_triggers['cpu_pct']:.2f} % and "
        f"{with_triggers['ops_per_s']:.1f} ops/s with {IDLE_TRIGGERS} (+{extra_cpu:.2f} % CPU, "
        f"+{extra_ops:.1f} ops/s)"
    )
    bench.record(
        Result(
            "WT triggers and waits on data",
            figure,
            "a wake-up within a second; one stream for all waits; idle cost stated",
            wakes["resumed_p95_ms"] < 1000 and wakes["wait_streams"] == 1,
            f"own mongod; {trickle} trickled changes, {burst} burst writes, {waits} waits; "
            f"load average up to {load:.1f} (the machine is shared)",
            {
                **changes,
                **wakes,
                **{f"idle_plain_{k}": v for k, v in without.items()},
                **{f"idle_triggers_{k}": v for k, v in with_triggers.items()},
                "load": load,
            },
        )
    )
