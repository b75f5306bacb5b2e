"""The runs' local deadlines (``mtask.worker.running.deadlines``): one timer for every run,
set for the earliest lease end, stopping the runs whose lease ran out and set again for the rest."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from mtask.worker.inflight import ActiveRun
from mtask.worker.running.deadlines import Deadlines


class Leases:
    def __init__(self) -> None:
        self.ends: dict[str, float] = {}

    def expiry(self, run_id: str) -> float | None:
        return self.ends.get(run_id)


def _run(run_id: str) -> ActiveRun:
    run = ActiveRun(key=run_id, name="n", run_id=run_id, ctx=cast(Any, None))
    run.task = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
    return run


class Watching:
    """A ``Deadlines`` over runs in a dict: a run whose lease ran out is noted and ends."""

    def __init__(self) -> None:
        self.leases = Leases()
        self.runs: dict[str, ActiveRun] = {}
        self.stopped: list[str] = []
        self.ran_out = asyncio.Event()
        self.deadlines = Deadlines(self.leases, lambda: self.runs.values(), self.stop)

    def stop(self, run: ActiveRun) -> None:
        self.stopped.append(run.run_id)
        del self.runs[run.run_id]
        self.ran_out.set()

    def start(self, run_id: str, lease_end: float | None) -> ActiveRun:
        run = self.runs[run_id] = _run(run_id)
        if lease_end is not None:
            self.leases.ends[run_id] = lease_end
        self.deadlines.watch(run)
        return run


def _timers() -> int:
    loop = asyncio.get_running_loop()
    return sum(1 for h in loop._scheduled if not h.cancelled())  # type: ignore[attr-defined]


async def test_one_timer_stops_the_runs_whose_lease_ran_out() -> None:
    w = Watching()
    now = asyncio.get_running_loop().time()
    before = _timers()
    for i in range(64):  # the runs of one claim: their leases end together
        w.start(f"a{i}", now + 0.05 + i * 1e-6)
    assert _timers() == before + 1  # one timer, not one a run
    w.leases.ends["a1"] = now + 60  # a ping extended this one
    w.runs["a2"].stop_reason = "lost"  # already being stopped: left alone
    del w.runs["a3"]  # ended: no longer in flight
    await asyncio.wait_for(w.ran_out.wait(), 10)
    assert sorted(w.stopped) == sorted(f"a{i}" for i in range(64) if i not in (1, 2, 3))
    assert w.deadlines._at == now + 60  # set again for the run still in flight
    assert _timers() == before + 1
    w.deadlines.close()
    assert _timers() == before


async def test_a_run_whose_lease_ends_sooner_moves_the_timer_up() -> None:
    w = Watching()
    now = asyncio.get_running_loop().time()
    w.start("long", now + 60)
    w.start("unpinged", None)  # not pinged (no lease to watch): no timer for it
    assert w.deadlines._at == now + 60
    w.start("short", now + 0.02)  # a task with a shorter worker_timeout_ms
    assert w.deadlines._at == now + 0.02
    await asyncio.wait_for(w.ran_out.wait(), 10)
    assert w.stopped == ["short"] and w.deadlines._at == now + 60
    w.deadlines.close()
