"""The runs' local deadlines (``mtask.worker.deadlines``): one timer for every run, set for the
earliest lease end, stopping the runs whose lease ran out and set again for the rest."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from mtask.worker.deadlines import Deadlines
from mtask.worker.inflight import ActiveRun


class Leases:
    def __init__(self) -> None:
        self.ends: dict[str, float] = {}

    def expiry(self, run_id: str) -> float | None:
        return self.ends.get(run_id)


def _run(run_id: str) -> ActiveRun:
    run = ActiveRun(key=run_id, name="n", run_id=run_id, ctx=cast(Any, None))
    run.task = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
    return run


def _timers() -> int:
    loop = asyncio.get_running_loop()
    return sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]


async def test_one_timer_stops_the_runs_whose_lease_ran_out() -> None:
    loop = asyncio.get_running_loop()
    leases = Leases()
    runs: dict[str, ActiveRun] = {}
    stopped: list[str] = []
    ran_out = asyncio.Event()

    def stop(run: ActiveRun) -> None:
        stopped.append(run.run_id)
        del runs[run.run_id]
        ran_out.set()

    deadlines = Deadlines(leases, lambda: runs.values(), stop)
    now = loop.time()
    before = _timers()
    for i in range(64):  # the runs of one claim: their leases end together
        run = runs[f"a{i}"] = _run(f"a{i}")
        leases.ends[run.run_id] = now + 0.05 + i * 1e-6
        deadlines.watch(run)
    assert _timers() == before + 1  # one timer, not one a run
    pinged = runs["a1"]
    leases.ends[pinged.run_id] = now + 60  # a ping extended this one
    runs["a2"].stop_reason = "lost"  # already being stopped: left alone
    del runs["a3"]  # ended: no longer in flight
    await asyncio.wait_for(ran_out.wait(), 10)
    assert sorted(stopped) == sorted(f"a{i}" for i in range(64) if i not in (1, 2, 3))
    assert deadlines._at == leases.ends["a1"]  # set again for the run still in flight
    assert _timers() == before + 1
    deadlines.close()
    assert _timers() == before


async def test_a_run_whose_lease_ends_sooner_moves_the_timer_up() -> None:
    loop = asyncio.get_running_loop()
    leases = Leases()
    runs: dict[str, ActiveRun] = {}
    stopped: list[str] = []
    ran_out = asyncio.Event()

    def stop(run: ActiveRun) -> None:
        stopped.append(run.run_id)
        del runs[run.run_id]
        ran_out.set()

    deadlines = Deadlines(leases, lambda: runs.values(), stop)
    now = loop.time()
    runs["long"], runs["short"], runs["unpinged"] = _run("long"), _run("short"), _run("unpinged")
    leases.ends["long"] = now + 60
    deadlines.watch(runs["long"])
    deadlines.watch(runs["unpinged"])  # not pinged (no lease to watch): no timer for it
    assert deadlines._at == now + 60
    leases.ends["short"] = now + 0.02  # a task with a shorter worker_timeout_ms
    deadlines.watch(runs["short"])
    assert deadlines._at == now + 0.02
    await asyncio.wait_for(ran_out.wait(), 10)
    assert stopped == ["short"] and deadlines._at == now + 60
    deadlines.close()
