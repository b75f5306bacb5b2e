"""Bench WB, the cost budget per task: what one task costs the worker and the
server, line by line, and each feature's share of it, found by turning it off in the same run.

Two shapes, on a mongod of the bench's own (its CPU, read from ``/proc``, is this workload's):

- ``drain`` (W1's shape): ``n`` no-op tasks published at once, one worker at concurrency 64;
- ``trickle`` (W2's shape): no-op tasks published one at a time, 10 ms apart, to one idle
  worker at concurrency 16.

Per task, from publish to finish: the worker's CPU µs (its process tree), mongod's CPU µs, the
server's operations by kind (``opcounters``; the bench's own reads are not counted), the index
keys written (``keysInserted + keysDeleted`` of mongod's profiler, in a second pass: the
profiler costs CPU of its own), and the bytes of a finished task document (``$bsonSize``).

Each shape runs ``as shipped`` and once per feature turned off (``VARIANTS``): the tasks
collection's listing, operator and flow indexes, each group dropped once the worker has made
them; the worker's metrics, its local deadline per run (one timer for all) and its claim's
client-side time limit, turned off in the bench's worker process (``bench.features_off``: the
product has no switch for them); and retention (tasks published to be kept for ever). A share
is what turning the feature off saved, as a part of the shipped figure.

The figures are printed beside the committed baseline (``bench/budget.json``, the same size on
this machine) with the lines that grew; nothing here is judged (CI runs on a shared machine).
``MTASK_BUDGET_WRITE=1`` writes the run as the new baseline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pymongo import MongoClient

from bench import features_off
from bench.support import ROOT, Result, spawn_worker, stop_process, wait_for_worker, wait_until
from mtask.client import TaskClient

if TYPE_CHECKING:
    from bench.workloads import Bench

BASELINE = ROOT / "bench" / "budget.json"
KINDS = ("insert", "query", "update", "delete", "getmore", "command")


@dataclass(frozen=True)
class Variant:
    """What one variant turns off: indexes of the tasks collection dropped once the worker has
    made them, features of the worker's process (``bench.features_off``), options each task is
    published with."""

    drop: tuple[str, ...] = ()
    off: tuple[str, ...] = ()
    options: Mapping[str, Any] | None = None


VARIANTS: dict[str, Variant] = {
    "as shipped": Variant(),
    # the tasks collection's indexes (store/schema.py) that no claim, run or outcome reads:
    # each group's share of the budget
    "no listing indexes": Variant(drop=("newest", "name_status_newest")),
    "no finished index": Variant(drop=("finished",)),  # operators' and `mtask top`'s
    "no flow indexes": Variant(drop=("parent", "waiting_on", "outbox", "expire_held")),
    # what the run path does per task that a plain worker could be asked to do without
    "no metrics": Variant(off=("metrics",)),
    "no lease timer": Variant(off=("lease timer",)),
    "no claim timeout": Variant(off=("claim timeout",)),
    "no retention": Variant(options={"keep_succeeded_ms": -1}),  # kept for ever: no expire_at
}
SHAPES = ("drain", "trickle")
METRICS = (
    "worker µs",
    "mongod µs",
    *(f"{kind} ops" for kind in KINDS),
    "index keys",
    "bytes per document",
)
"""Each case's lines: the CPU pass's, then the counting pass's."""
GREW_CPU = 0.15
"""CPU lines: growth past this share is named (the machine's own spread is about 10 %)."""
GREW_COUNT = 0.05
"""Counted lines (operations, index keys, bytes): growth past this share is named."""


@dataclass(frozen=True)
class Sizes:
    drain: int
    trickle: int


QUICK_SIZES = Sizes(drain=2_000, trickle=150)
FULL_SIZES = Sizes(drain=10_000, trickle=300)


# -- the pure part: lines, and what grew -----------------------------------------------------


def lines(figures: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """One flat ``{"shape/variant: figure": value}`` per measured line."""
    return {f"{case}: {key}": value for case, row in figures.items() for key, value in row.items()}


def grew(
    now: Mapping[str, float], baseline: Mapping[str, float]
) -> list[tuple[str, float, float, float]]:
    """The lines that grew past their tolerance: ``(line, before, now, change)``, the largest
    change first. A line absent from the baseline is not named (nothing to compare)."""
    out = []
    for line, value in now.items():
        before = baseline.get(line)
        if before is None:
            continue
        tolerance = GREW_CPU if line.endswith(" µs") else GREW_COUNT
        floor = 0.05 if not line.endswith(" µs") else 5.0  # an absolute step too small to name
        if value - before > max(floor, tolerance * abs(before)):
            change = (value - before) / before if before else float("inf")
            out.append((line, before, value, change))
    return sorted(out, key=lambda row: -row[3])


# -- measuring ---------------------------------------------------------------------------------


def _counters(mongo: MongoClient[dict[str, Any]]) -> dict[str, int]:
    status = mongo.admin.command("serverStatus")
    return {k: int(status["opcounters"][k]) for k in KINDS}


@dataclass
class Probe:
    """The bench's own reads while it waits: counted, so that they can be taken off."""

    mongo: MongoClient[dict[str, Any]]
    database: str
    reads: int = 0

    def drained(self) -> bool:
        """Whether no task is open (all were published before the first call); if some are,
        a pause first (few reads to take off). Counted on the ``claim`` index, which no
        variant drops (a count by status would scan the collection without the listing
        indexes, and charge that to the tasks)."""
        self.reads += 1  # a count is one ``aggregate`` command
        tasks = self.mongo[self.database]["tasks"]
        if tasks.count_documents({"name": "noop", "next_claim_at": {"$type": "date"}}) == 0:
            return True
        time.sleep(0.15)
        return False


def _drop_indexes(
    mongo: MongoClient[dict[str, Any]], database: str, names: tuple[str, ...]
) -> None:
    present = set(mongo[database]["tasks"].index_information())
    for name in names:
        if name in present:
            mongo[database]["tasks"].drop_index(name)


def _publish(
    client: TaskClient, shape: str, n: int, options: Mapping[str, Any] | None = None
) -> None:
    given = {} if options is None else {"options": dict(options)}
    if shape == "drain":
        client.publish_many({"name": "noop", "key": f"b{i}", **given} for i in range(n))
        return
    for i in range(n):
        client.publish("noop", f"b{i}", options=options)
        time.sleep(0.01)


def _profile_on(mongo: MongoClient[dict[str, Any]], database: str) -> None:
    db = mongo[database]
    db.command("profile", 0)
    db.drop_collection("system.profile")
    db.create_collection("system.profile", capped=True, size=256 * 2**20)
    db.command("profile", 2)


def _index_keys(mongo: MongoClient[dict[str, Any]], database: str) -> int:
    mongo[database].command("profile", 0)
    rows = mongo[database]["system.profile"].aggregate(
        [
            {"$match": {"ns": f"{database}.tasks", "appName": "mtask"}},
            {
                "$group": {
                    "_id": None,
                    "k": {
                        "$sum": {
                            "$add": [
                                {"$ifNull": ["$keysInserted", 0]},
                                {"$ifNull": ["$keysDeleted", 0]},
                            ]
                        }
                    },
                }
            },
        ]
    )
    return int(next(rows, {"k": 0})["k"])


def _one(
    uri: str, mongod_pid: int, shape: str, variant: str, n: int, profile: bool
) -> dict[str, float]:
    """One pass: the CPU pass (``profile`` False) or the counting pass."""
    from bench.cpu import tree_cpu_seconds
    from bench.scale import _cpu_s

    database = f"wb_{shape}_{variant.replace(' ', '_')}_{'p' if profile else 'c'}"
    mongo: MongoClient[dict[str, Any]] = MongoClient(uri, appname="mtask-bench")
    concurrency = "64" if shape == "drain" else "16"
    what = VARIANTS[variant]
    proc = spawn_worker(
        uri, database, "--concurrency", concurrency, env={features_off.ENV: ",".join(what.off)}
    )
    try:
        with TaskClient(uri, database=database) as client:
            wait_for_worker(client, proc)
            _drop_indexes(mongo, database, what.drop)
            probe = Probe(mongo, database)
            if profile:
                _profile_on(mongo, database)
            w0, m0, o0 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid), _counters(mongo)
            _publish(client, shape, n, what.options)
            wait_until(probe.drained, 600)
            w1, m1, o1 = tree_cpu_seconds(proc.pid), _cpu_s(mongod_pid), _counters(mongo)
            done = mongo[database]["tasks"].count_documents({"status": "succeeded"})
            if done != n:
                raise RuntimeError(f"bench WB: {done} of {n} tasks succeeded")
            if profile:
                keys = _index_keys(mongo, database)
                size = next(
                    mongo[database]["tasks"].aggregate(
                        [{"$group": {"_id": None, "b": {"$avg": {"$bsonSize": "$$ROOT"}}}}]
                    )
                )["b"]
                return {"index keys": keys / n, "bytes per document": float(size)}
            ops = {k: o1[k] - o0[k] for k in KINDS}
            ops["command"] -= probe.reads + 1  # the bench's counts, and its last serverStatus
            return {
                "worker µs": (w1 - w0) * 1e6 / n,
                "mongod µs": (m1 - m0) * 1e6 / n,
                **{f"{kind} ops": ops[kind] / n for kind in KINDS},
            }
    finally:
        stop_process(proc)
        mongo.drop_database(database)
        mongo.close()


def measure(uri: str, mongod_pid: int, sizes: Sizes) -> dict[str, dict[str, float]]:
    # a drain not counted first: the first pass on a new mongod measured a third dearer than
    # the same pass later (its caches, the first worker's start), and would have made the
    # shipped column the dearest for that reason alone
    _one(uri, mongod_pid, "drain", "as shipped", sizes.drain, profile=False)
    figures: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        n = getattr(sizes, shape)
        for variant in VARIANTS:
            row = _one(uri, mongod_pid, shape, variant, n, profile=False)
            row.update(_one(uri, mongod_pid, shape, variant, n, profile=True))
            figures[f"{shape}, {variant}"] = row
    return figures


def _shares(figures: Mapping[str, Mapping[str, float]]) -> Iterator[str]:
    """Each feature's share of the shipped budget: what turning it off saved."""
    for shape in SHAPES:
        on = figures[f"{shape}, as shipped"]
        parts = []
        for variant in list(VARIANTS)[1:]:
            off = figures[f"{shape}, {variant}"]
            saved = ", ".join(
                f"{key} {(on[key] - off[key]) / on[key]:.0%}"
                for key in ("mongod µs", "worker µs", "index keys")
                if on.get(key)
            )
            parts.append(f"{variant.removeprefix('no ')} {saved}")
        yield f"{shape}: " + "; ".join(parts)


SHOWN = 15
PER_TABLE = 4


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def _print(
    bench: Bench, figures: Mapping[str, Mapping[str, float]], baseline: dict[str, float]
) -> None:
    """Tables per shape: a metric a row, a variant a column (the shipped one first, then
    ``PER_TABLE`` variants, so that a table fits 80 columns), each cell the figure now and the
    baseline's (``now / baseline``)."""
    from rich.table import Table

    others = list(VARIANTS)[1:]
    for shape in SHAPES:
        for start in range(0, len(others), PER_TABLE):
            shown = ["as shipped", *others[start : start + PER_TABLE]]
            table = Table(
                "per task",
                *(v.removeprefix("no ").removesuffix(" indexes") for v in shown),
                title=f"WB {shape}: now / baseline, as shipped and without each feature",
            )
            for metric in METRICS:
                cells = []
                for variant in shown:
                    case = f"{shape}, {variant}"
                    value, before = figures[case][metric], baseline.get(f"{case}: {metric}")
                    cells.append(_fmt(value) + ("" if before is None else f" / {_fmt(before)}"))
                table.add_row(metric, *cells)
            bench.console.print(table)
    named = grew(lines(figures), baseline)
    if named:
        bench.console.print(f"[yellow]{len(named)} line(s) grew against bench/budget.json:[/]")
        for line, before, value, change in named[:SHOWN]:
            bench.console.print(f"  {line}: {_fmt(before)} → {_fmt(value)} ({change:+.0%})")
        if len(named) > SHOWN:
            bench.console.print(f"  and {len(named) - SHOWN} more")
    elif baseline:
        bench.console.print("no line grew against bench/budget.json")


def cost_budget(bench: Bench) -> None:
    from bench.scale import _own_mongod

    size_name = "quick" if bench.sizes.scale_large < 1_000_000 else "full"  # by value
    sizes = QUICK_SIZES if size_name == "quick" else FULL_SIZES
    with _own_mongod() as (uri, pid, _port):
        figures = measure(uri, pid, sizes)
    now = lines(figures)
    stored: dict[str, dict[str, float]] = (
        json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    )
    baseline = stored.get(size_name, {})
    _print(bench, figures, baseline)
    if os.environ.get("MTASK_BUDGET_WRITE") == "1":
        stored[size_name] = {k: round(v, 3) for k, v in now.items()}
        BASELINE.write_text(json.dumps(stored, indent=1, ensure_ascii=False) + "\n")
    named = grew(now, baseline)
    bench.record(
        Result(
            "WB cost budget",
            "; ".join(_shares(figures)),
            "measured, not judged",
            None,
            f"per task; {sizes.drain} drained at c64 and {sizes.trickle} one at a time at c16; "
            f"{len(named)} line(s) grew against bench/budget.json"
            + (": " + ", ".join(line for line, *_ in named) if named else ""),
            now,
        )
    )
