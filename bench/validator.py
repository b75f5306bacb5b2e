"""Bench WV: what the ``$jsonSchema`` validator (``mtask collection init --validator``) costs on
W1 (drain) and W6 (publish), as A/B comparisons in one run. On a shared machine the load moves
every absolute figure; only ratios measured side by side can be compared.

- ``WV`` (``validator_ab``): rounds; each measures W1 and W6 on a fresh database with and on one
  without the validator, the order alternating every round; the figure is the median of the
  per-round ratios (validator / none). Each measurement lasts about a second, so a load spike
  lands on one side of a round.
- ``WVI`` (``validator_interleaved``): finer grained, so that the load falls on both sides
  alike. W6: batches of ``publish_many`` (250 tasks) and of 64 ``publish`` calls (32 at once)
  into the two databases, alternating batch by batch (the order swapped every pair); the figure
  is total time with / total time without. W1: both databases hold the same tasks and two
  worker processes drain them *at the same time* (started in alternating order); the figure
  is the median over rounds of rate with / rate without.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from typing import TYPE_CHECKING

from bench.support import Result, spawn_worker, stop_process, wait_until
from mtask.client import AsyncTaskClient, TaskClient

if TYPE_CHECKING:
    from bench.workloads import Bench

ROUNDS = int(os.environ.get("MTASK_BENCH_VALIDATOR_ROUNDS", "6"))


def one(bench: Bench, validator: bool) -> dict[str, float]:
    bench.validator = validator
    try:
        drain, _ = bench.drain("noop")
        single, many = bench.publish_rates()
    finally:
        bench.validator = False
    return {"drain": drain, "single": single, "many": many}


def validator_ab(bench: Bench) -> None:
    ratios: dict[str, list[float]] = {"drain": [], "single": [], "many": []}
    for r in range(ROUNDS):
        order = (False, True) if r % 2 == 0 else (True, False)
        figures = {flag: one(bench, flag) for flag in order}
        load = os.getloadavg()[0]
        for kind in ratios:
            ratios[kind].append(figures[True][kind] / figures[False][kind])
        bench.console.print(
            f"round {r + 1} (validator {'second' if r % 2 == 0 else 'first'}, load {load:.1f}): "
            + ", ".join(
                f"{kind} {figures[False][kind]:,.0f} → {figures[True][kind]:,.0f}/s"
                for kind in ratios
            )
        )
    median = {kind: statistics.median(values) for kind, values in ratios.items()}
    spread = {kind: (min(values), max(values)) for kind, values in ratios.items()}
    figure = ", ".join(
        f"{kind} x{median[kind]:.2f} ({spread[kind][0]:.2f}-{spread[kind][1]:.2f})"
        for kind in ratios
    )
    bench.record(
        Result(
            "WV validator cost",
            figure,
            "(no target)",
            None,
            f"{ROUNDS} rounds, order alternating; W1 drain of {bench.sizes.drain:,} no-op tasks "
            f"(one worker, concurrency 64) and W6 publish ({bench.sizes.publish // 4:,} singles, "
            f"32 at once) / publish_many ({bench.sizes.publish:,}); median ratio validator / "
            "none (min-max)",
            {f"{kind}_ratio": value for kind, value in median.items()},
        )
    )


# -- WVI: interleaved ----------------------------------------------------------------------------

PAIRS = 24
BATCH_MANY, BATCH_SINGLE = 250, 64


def _databases(bench: Bench) -> dict[bool, str]:
    names = {}
    for flag in (False, True):
        names[flag] = bench.db()
        with TaskClient(bench.uri, database=names[flag]) as client:
            client.init_collection(validator=flag)  # indexes on both sides before timing
    return names


def _publish_interleaved(bench: Bench, names: dict[bool, str]) -> dict[str, float]:
    """Seconds spent per side: publish_many batches and 32-at-once publish batches."""
    spent = {"many_a": 0.0, "many_b": 0.0, "single_a": 0.0, "single_b": 0.0}
    side = {False: "a", True: "b"}
    clients = {flag: TaskClient(bench.uri, database=names[flag]) for flag in names}
    try:
        for i in range(PAIRS):
            for flag in (False, True) if i % 2 == 0 else (True, False):
                began = time.perf_counter()
                clients[flag].publish_many(
                    {"name": "noop", "key": f"m{i}-{j}"} for j in range(BATCH_MANY)
                )
                spent[f"many_{side[flag]}"] += time.perf_counter() - began
    finally:
        for client in clients.values():
            client.close()

    async def singles() -> None:
        aclients = {f: AsyncTaskClient(bench.uri, database=names[f]) for f in names}
        try:
            for aclient in aclients.values():
                await aclient.publish("noop", "warm")
            sem = asyncio.Semaphore(32)

            async def one(aclient: AsyncTaskClient, key: str) -> None:
                async with sem:
                    await aclient.publish("noop", key)

            for i in range(PAIRS):
                for flag in (False, True) if i % 2 == 0 else (True, False):
                    began = time.perf_counter()
                    await asyncio.gather(
                        *(one(aclients[flag], f"s{i}-{j}") for j in range(BATCH_SINGLE))
                    )
                    spent[f"single_{side[flag]}"] += time.perf_counter() - began
        finally:
            for aclient in aclients.values():
                await aclient.close()

    asyncio.run(singles())
    return spent


def _rate(bench: Bench, name: str, n: int) -> float:
    span = next(
        bench.mongo[name]["tasks"].aggregate(
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
    return float(n / (span["b"] - span["a"]).total_seconds())


def _drain_side_by_side(bench: Bench, first: bool) -> dict[bool, float]:
    """Two fresh databases (with, without), the same no-op tasks, two workers at once."""
    names = _databases(bench)
    n = bench.sizes.drain
    for name in names.values():
        with TaskClient(bench.uri, database=name) as client:
            client.publish_many({"name": "noop", "key": f"d{i}"} for i in range(n))
    procs = {}
    try:
        for flag in (first, not first):
            procs[flag] = spawn_worker(bench.uri, names[flag], "--concurrency", "64")

        def done() -> bool:
            for proc in procs.values():
                if proc.poll() is not None:
                    raise RuntimeError("a worker exited during a drain")
            return all(
                bench.mongo[name]["tasks"].count_documents({"name": "noop", "status": "succeeded"})
                >= n
                for name in names.values()
            )

        wait_until(done)
    finally:
        for proc in procs.values():
            stop_process(proc)
    rates = {flag: _rate(bench, names[flag], n) for flag in names}
    for name in names.values():
        bench.drop(name)
    return rates


def validator_interleaved(bench: Bench) -> None:
    names = _databases(bench)
    try:
        spent = _publish_interleaved(bench, names)
    finally:
        for name in names.values():
            bench.drop(name)
    bench.console.print(
        "publish interleaved, seconds without / with: "
        f"publish_many {spent['many_a']:.2f} / {spent['many_b']:.2f}, "
        f"publish {spent['single_a']:.2f} / {spent['single_b']:.2f}"
    )
    loads = [os.getloadavg()[0]]
    drains = []
    for r in range(max(2, ROUNDS // 2)):
        rates = _drain_side_by_side(bench, first=r % 2 == 0)
        drains.append(rates[True] / rates[False])
        loads.append(os.getloadavg()[0])
        bench.console.print(
            f"drain side by side {r + 1}: without {rates[False]:,.0f}/s, with {rates[True]:,.0f}/s"
        )
    many = spent["many_b"] / spent["many_a"]
    single = spent["single_b"] / spent["single_a"]
    drain = statistics.median(drains)
    bench.record(
        Result(
            "WVI validator cost, interleaved",
            f"publish_many time x{many:.2f}, publish time x{single:.2f}, "
            f"drain rate x{drain:.2f} ({min(drains):.2f}-{max(drains):.2f})",
            "(no target)",
            None,
            f"W6: {PAIRS} pairs of batches ({BATCH_MANY} publish_many, {BATCH_SINGLE} publish "
            f"32 at once), alternating; W1: {len(drains)} rounds of two workers (concurrency "
            f"64) draining {bench.sizes.drain:,} no-op tasks each at the same time; load "
            f"{min(loads):.0f}-{max(loads):.0f}",
            {"many": many, "single": single, "drain": drain},
        )
    )
