"""The workloads W0-W8, as methods of one ``Bench`` (they share its client, sizes and the W0
figure every throughput is compared with)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pymongo import MongoClient, UpdateOne
from rich.console import Console
from rich.table import Table

from bench import txn
from bench.app import registry
from bench.support import (
    LOOP,
    ROOT,
    Result,
    Sizes,
    mem_gib,
    pct,
    peak_rss_kb,
    spawn_worker,
    stop_process,
    wait_for_worker,
    wait_until,
)
from mtask import store
from mtask.cli.worker import loop_factory
from mtask.client import AsyncTaskClient, TaskClient
from mtask.models import NewTask


class Bench:
    def __init__(self, uri: str, sizes: Sizes, console: Console) -> None:
        self.uri = uri
        self.sizes = sizes
        self.console = console
        self.mongo: MongoClient[dict[str, Any]] = MongoClient(uri, w="majority", tz_aware=True)
        self.results: list[Result] = []
        self.w0 = 0.0
        self.validator = False

    def db(self) -> str:
        name = f"mtask_bench_{uuid.uuid4().hex[:8]}"
        if self.validator:  # --validator: the task document's $jsonSchema
            with TaskClient(self.uri, database=name) as client:
                client.init_collection(validator=True)
        return name

    def drop(self, name: str) -> None:
        self.mongo.drop_database(name)

    def record(self, result: Result) -> None:
        self.results.append(result)
        mark = {True: "[green]met[/]", False: "[red]not met[/]", None: ""}[result.met]
        self.console.print(f"{result.name}: {result.figure} (target {result.target}) {mark}")

    # -- W0 ------------------------------------------------------------------------------------

    def w0_baseline(self) -> None:
        name = self.db()
        coll = self.mongo[name]["raw"]
        n, batch = self.sizes.baseline, 64
        now = dt.datetime.now(dt.UTC)
        for start in range(0, n, 1000):
            coll.insert_many(
                [
                    {"_id": f"k{i}", "s": 0, "p": {}, "t": now}
                    for i in range(start, min(n, start + 1000))
                ]
            )
        ids = [f"k{i}" for i in range(n)]
        began = time.perf_counter()
        for start in range(0, n, batch):
            chunk = ids[start : start + batch]
            coll.update_many(
                {"_id": {"$in": chunk}, "s": 0}, {"$set": {"s": 1, "w": "raw", "l": now}}
            )
            list(coll.find({"_id": {"$in": chunk}, "s": 1}))
            coll.bulk_write(
                [UpdateOne({"_id": k, "s": 1}, {"$set": {"s": 2, "r": None}}) for k in chunk],
                ordered=False,
            )
        elapsed = time.perf_counter() - began
        self.drop(name)
        self.w0 = n / elapsed
        self.record(
            Result(
                "W0 baseline",
                f"{self.w0:,.0f} cycles/s",
                "the limit",
                None,
                "raw PyMongo: update_many claim + find + bulk completion, batches of 64",
                {"per_s": self.w0},
            )
        )

    # -- W1 and W7 ------------------------------------------------------------------------------

    def drain(self, task: str, n: int | None = None) -> tuple[float, float]:
        """Publish ``n`` (``sizes.drain``) tasks named ``task``, drain them with one worker
        process of concurrency 64: tasks per second (first claim to last finish) and peak RSS
        in MB."""
        name = self.db()
        n = self.sizes.drain if n is None else n
        with TaskClient(self.uri, database=name) as client:
            client.publish_many(
                {"name": task, "key": f"d{i}", "params": {"i": i} if task == "echo" else {}}
                for i in range(n)
            )
        proc = spawn_worker(self.uri, name, "--concurrency", "64")
        peak_kb = 0
        try:
            counts = self.mongo[name]["tasks"]
            polls = 0
            done = {"name": task, "status": "succeeded"}  # by name: a COUNT_SCAN
            while polls % 5 or counts.count_documents(done) < n:
                # RSS every 0.2 s; the count (an index scan of up to n keys, load on the server
                # being measured) only every second: the rate comes from the runs' own times
                peak_kb = max(peak_kb, peak_rss_kb(proc.pid))
                if proc.poll() is not None:
                    raise RuntimeError("the worker exited during a drain")
                time.sleep(0.2)
                polls += 1
            peak_kb = max(peak_kb, peak_rss_kb(proc.pid))
        finally:
            stop_process(proc)
        span = next(
            self.mongo[name]["tasks"].aggregate(
                [
                    {"$unwind": "$runs"},
                    {
                        "$group": {
                            "_id": None,
                            "a": {"$min": "$runs.claimed_at"},
                            "b": {"$max": "$runs.finished_at"},
                        }
                    },
                ]
            )
        )
        seconds = (span["b"] - span["a"]).total_seconds()
        self.drop(name)
        return n / seconds, peak_kb / 1024

    def w1_drain(self) -> None:
        rate, mb = self.drain("noop")
        ratio = rate / self.w0 if self.w0 else 0.0
        self.record(
            Result(
                "W1 drain",
                f"{rate:,.0f} tasks/s = {ratio:.1%} of W0",
                "≥ 60% of W0",
                ratio >= 0.6,
                f"{self.sizes.drain:,} no-op tasks, one mtask-worker process, concurrency 64",
                {"per_s": rate, "ratio": ratio},
            )
        )
        self.record(
            Result(
                "W7 memory",
                f"{mb:.0f} MB peak RSS",
                "≤ 150 MB",
                mb <= 150,
                "the W1 worker",
                {"mb": mb},
            )
        )
        rate, _ = self.drain("echo")
        ratio = rate / self.w0 if self.w0 else 0.0
        self.record(
            Result(
                "W1 drain, with results",
                f"{rate:,.0f} tasks/s = {ratio:.1%} of W0",
                "(no target)",
                None,
                "as W1, each handler returning its own small result",
                {"per_s": rate, "ratio": ratio},
            )
        )

    def w1_txn(self) -> None:
        rate, _ = self.drain(txn.TASK)
        w1 = next((r.values["per_s"] for r in self.results if r.name == "W1 drain"), None)
        figure, notes, values = txn.summary(rate, self.w0, w1, self.sizes.drain)
        self.record(Result("W1T transactional drain", figure, "(no target)", None, notes, values))

    # -- W2 -------------------------------------------------------------------------------------

    def latencies(self, n: int, floor: list[float] | None = None) -> list[float]:
        """``n`` tasks published 20 ms apart to one idle worker (concurrency 16): publish call
        → handler start, in ms. With ``floor`` (a list to fill), the floor's ``n`` raw writes
        go in between, 10 ms after each publish: both see the same machine, whose state moves
        a W2 figure by more than the target's margin from one minute to the next."""
        name = self.db()
        floor_db = self.db() if floor is not None else None
        proc = spawn_worker(self.uri, name, "--concurrency", "16")
        helper: subprocess.Popen[str] | None = None
        raw: Any = None
        try:
            with TaskClient(self.uri, database=name) as client:
                wait_for_worker(client, proc)
                if floor_db is not None:
                    helper, raw = self._floor_helper(floor_db, n)
                published: dict[str, float] = {}
                for i in range(n):
                    key = f"l{i}"
                    published[key] = time.time()
                    client.publish("stamp", key)
                    if raw is None:
                        time.sleep(0.02)
                        continue
                    time.sleep(0.01)
                    raw.insert_one({"_id": i, "t": time.time(), "s": 0})
                    time.sleep(0.01)
                wait_until(
                    lambda: client.stats(exact=True).get("stamp", {}).get("succeeded", 0) == n
                )
                if helper is not None and floor is not None:
                    out, _ = helper.communicate(timeout=60)
                    floor.extend(json.loads(out.strip().splitlines()[-1]))
                return [
                    (t.result - published[t.key]) * 1000
                    for t in client.list(name="stamp", limit=10_000)
                ]
        finally:
            if helper is not None and helper.poll() is None:
                helper.kill()
            stop_process(proc)
            self.drop(name)
            if floor_db is not None:
                self.drop(floor_db)

    def w2_latency(self) -> None:
        floor_lat: list[float] = []
        lat = self.latencies(self.sizes.latency, floor_lat)
        p50, p99, worst = pct(lat, 0.5), pct(lat, 0.99), max(lat)
        floor = statistics.median(floor_lat)
        self.record(
            Result(
                "W2 latency",
                f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms; floor p50 {floor:.1f} ms",
                "p50 ≤ 5 ms, p99 ≤ 15 ms",
                p50 <= 5 and p99 <= 15,
                f"{len(lat)} tasks published 20 ms apart to one idle worker; publish call → "
                "handler start. Floor, the same minutes (its writes between the publishes): "
                "raw insert → raw change event in another process → one raw claim write",
                {"p50": p50, "p99": p99, "max": worst, "floor": floor},
            )
        )

    def _floor_helper(self, name: str, n: int) -> tuple[subprocess.Popen[str], Any]:
        """What any change-stream-driven queue pays here: insert (majority), the event in
        another process, one find-and-update (majority). Raw PyMongo, no mtask code: the
        helper process, its stream open, and the collection to insert into."""
        helper = subprocess.Popen(
            [sys.executable, "-m", "bench", "--floor-helper", self.uri, name, str(n)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        assert helper.stdout is not None
        helper.stdout.readline()  # "ready": its change stream is open
        return helper, self.mongo[name]["floor"]

    # -- W3 -------------------------------------------------------------------------------------

    def w3_takeover(self) -> None:
        name = self.db()
        n = self.sizes.takeover
        victim = spawn_worker(self.uri, name, "--concurrency", str(n), "--worker-id", "victim")
        rescuer = None
        try:
            with TaskClient(self.uri, database=name) as client:
                client.publish_many(
                    {
                        "name": "hold",
                        "key": f"h{i}",
                        "options": {"worker_timeout_ms": 2000, "ping_interval_ms": 500},
                    }
                    for i in range(n)
                )
                wait_until(lambda: client.stats().get("hold", {}).get("running", 0) == n)
                rescuer = spawn_worker(self.uri, name, "--concurrency", str(n))
                wait_for_worker(client, rescuer, count=2)
                killed_at = client.now()
                victim.send_signal(signal.SIGKILL)
                wait_until(
                    lambda: (
                        client.collection.count_documents(
                            {"runs.1": {"$exists": True}, "runs.1.state": "RUNNING"}
                        )
                        == n
                    ),
                    timeout=60,
                )
                waits = [
                    (t.runs[1].claimed_at - killed_at).total_seconds() for t in client.list(limit=n)
                ]
        finally:
            stop_process(victim)
            if rescuer is not None:
                stop_process(rescuer)
            self.drop(name)
        worst = max(waits)
        self.record(
            Result(
                "W3 takeover",
                f"p50 {pct(waits, 0.5):.2f} s, max {worst:.2f} s",
                "≤ 3.0 s (timeout 2 s + 1 s)",
                worst <= 3.0,
                f"{n} tasks held by a worker killed with SIGKILL",
                {"p50": pct(waits, 0.5), "max": worst},
            )
        )

    # -- W4 -------------------------------------------------------------------------------------

    def _claim_p50(self, total: int) -> float:
        name = self.db()
        coll = self.mongo[name]["tasks"]
        with TaskClient(self.uri, database=name) as client:
            now = client.now()
            client.publish("noop", "warm")
            finished = {
                k: v
                for k, v in store.new_document(NewTask.build("noop", "x"), now).items()
                if k != "_id"
            }
            finished.update(status="succeeded", next_claim_at=None, successes=1)
            for start in range(0, total - 1000, 10_000):
                coll.insert_many(
                    [
                        {"_id": f"f{i}", **finished}
                        for i in range(start, min(total - 1000, start + 10_000))
                    ]
                )
            client.publish_many({"name": "noop", "key": f"p{i}"} for i in range(1000))
            times = []
            for i in range(1000):
                began = time.perf_counter()
                client._run(store.claim([f"p{i}"], ["noop"], "bench", client.now()))
                times.append((time.perf_counter() - began) * 1000)
        self.drop(name)
        return statistics.median(times)

    def w4_scale(self) -> None:
        small, large = self.sizes.scale_small, self.sizes.scale_large
        a, b = self._claim_p50(small), self._claim_p50(large)
        ratio = b / a
        self.record(
            Result(
                "W4 scale",
                f"claim p50 {a:.2f} ms at {small:,} vs {b:.2f} ms at "
                f"{large:,} tasks: ratio {ratio:.2f}",
                "≤ 1.5",
                ratio <= 1.5,
                "1,000 pending, the rest finished",
                {"ratio": ratio},
            )
        )

    # -- W5 -------------------------------------------------------------------------------------

    def w5_stampede(self) -> None:
        from mtask.worker import Worker

        name = self.db()
        n = self.sizes.stampede

        async def run() -> float:
            workers = [
                Worker(
                    registry, uri=self.uri, database=name, names=["noop"], heartbeat_interval=0.5
                )
                for _ in range(4)
            ]
            tasks = [asyncio.create_task(w.run()) for w in workers]
            async with AsyncTaskClient(self.uri, database=name) as client:
                # each is handed its tasks by the relay (the shared stream), or sees the 4 live
                # workers of its name (its heartbeat's read of its peers, for the stagger)
                while not all(  # noqa: ASYNC110
                    not w.parts.finding.ranks()
                    or len(w.parts.assignment.peers.get("noop", ())) == 4
                    for w in workers
                ):
                    await asyncio.sleep(0.05)  # polls MongoDB-backed state; no event to await
                for i in range(n):
                    await client.publish("noop", f"s{i}")
                    while (await client.get(f"s{i}")).status != "succeeded":  # type: ignore[union-attr]  # noqa: ASYNC110
                        await asyncio.sleep(0.002)
            for w in workers:
                w.stop()
            await asyncio.gather(*tasks)
            return sum(w.stats.claim_attempts for w in workers) / sum(
                w.stats.claimed for w in workers
            )

        per_task = asyncio.run(run())
        self.drop(name)
        self.record(
            Result(
                "W5 stampede",
                f"{per_task:.2f} claim attempts per task",
                "≤ 1.5",
                per_task <= 1.5,
                f"4 idle workers, {n} tasks published one at a time",
                {"attempts": per_task},
            )
        )

    # -- W6 -------------------------------------------------------------------------------------

    def w6_publish(self) -> None:
        single, many = self.publish_rates()
        self.record(
            Result(
                "W6 publish",
                f"publish {single:,.0f}/s (32 at once), publish_many {many:,.0f}/s",
                "publish_many ≥ 5,000/s",
                many >= 5000,
                "",
                {"single": single, "many": many},
            )
        )

    def publish_rates(self) -> tuple[float, float]:
        """W6: ``publish`` (``sizes.publish / 4``, 32 at once) and ``publish_many``
        (``sizes.publish``), tasks per second."""
        n = self.sizes.publish
        name = self.db()

        async def singles() -> float:
            async with AsyncTaskClient(self.uri, database=name) as client:
                await client.publish("noop", "warm")
                sem = asyncio.Semaphore(32)

                async def one(i: int) -> None:
                    async with sem:
                        await client.publish("noop", f"one{i}")

                began = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(n // 4)))
                return (n // 4) / (time.perf_counter() - began)

        single = asyncio.run(singles())
        with TaskClient(self.uri, database=name) as client:
            began = time.perf_counter()
            client.publish_many({"name": "noop", "key": f"many{i}"} for i in range(n))
            many = n / (time.perf_counter() - began)
        self.drop(name)
        return single, many

    # -- W8 -------------------------------------------------------------------------------------

    def w8_delayed(self) -> None:
        """Delayed tasks: how late after ``run_at`` (server clock) an idle worker claims them.
        The worker's heap wakes on time; the sweep (30 s) plays no part."""
        n = self.sizes.latency // 2
        name = self.db()
        proc = spawn_worker(self.uri, name, "--concurrency", "16")
        try:
            with TaskClient(self.uri, database=name) as client:
                wait_for_worker(client, proc)
                now = client.now()
                client.publish_many(
                    {
                        "name": "noop",
                        "key": f"d{i}",
                        "options": {"run_at": now + dt.timedelta(seconds=0.5 + 0.05 * i)},
                    }
                    for i in range(n)
                )
                wait_until(
                    lambda: client.stats(exact=True).get("noop", {}).get("succeeded", 0) == n
                )
                late = [
                    (t.runs[0].claimed_at - t.options.run_at).total_seconds() * 1000
                    for t in client.list(name="noop", limit=10_000)
                    if t.options.run_at is not None
                ]
        finally:
            stop_process(proc)
            self.drop(name)
        p50, p99, worst = pct(late, 0.5), pct(late, 0.99), max(late)
        self.record(
            Result(
                "W8 delayed",
                f"claimed after run_at: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms",
                "≤ 10 ms (issue #7)",
                p99 <= 10,
                f"{n} tasks with run_at 0.5 s + 50 ms apart, one idle worker; "
                "claimed_at - run_at, both on the server's clock",
                {"p50": p50, "p99": p99, "max": worst, "early": float(min(late) < 0)},
            )
        )

    # -- report ---------------------------------------------------------------------------------

    def report(self, path: Path, quick: bool) -> None:
        table = Table("workload", "figure", "target", "met", "notes")
        for r in self.results:
            table.add_row(
                r.name, r.figure, r.target, {True: "yes", False: "NO", None: "-"}[r.met], r.notes
            )
        self.console.print(table)
        version = self.mongo.server_info()["version"]
        lines = [
            "# mtask benchmark results",
            "",
            f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; mode: "
            f"{'quick (CI sizes)' if quick else 'full'}",
            f"- machine: {os.cpu_count()} cores, {mem_gib():.0f} GiB, {platform.platform()}, "
            f"Python {platform.python_version()}",
            f"- MongoDB {version} on the same machine, single-node replica set, "
            "write concern majority",
            f"- the workers' event loop: {loop_factory(LOOP)[0]}",
            "",
            "| workload | figure | target | met | notes |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in self.results:
            met = {True: "yes", False: "**no**", None: "-"}[r.met]
            lines.append(f"| {r.name} | {r.figure} | {r.target} | {met} | {r.notes} |")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        self.console.print(f"written to {path}")


# -- helpers ------------------------------------------------------------------------------------
