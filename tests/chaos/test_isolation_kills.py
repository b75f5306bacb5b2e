"""Process-isolated handlers under worker kill -9: no child survives its worker, and the
killed worker's runs are taken over by another worker once their leases expire."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from harness import poll, spawn_worker

from mtask import TaskClient

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` in the process table."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    return {p for p in pids if os.path.exists(f"/proc/{p}")}


def spawn(uri: str, database: str, worker_id: str) -> subprocess.Popen[bytes]:
    return spawn_worker(
        uri, database, "--worker-id", worker_id, "--concurrency", "3",
        app="poolhandlers:registry",
    )  # fmt: skip


def test_no_child_outlives_a_killed_worker(mongo_uri: str, db_name: str) -> None:
    lease = {"ping_interval_ms": 1000, "worker_timeout_ms": 10_000}
    with TaskClient(mongo_uri, database=db_name) as client:
        for i in range(3):
            client.publish("nap", f"nap-{i}", {"seconds": 3}, options=lease)
        first = spawn(mongo_uri, db_name, "doomed")
        try:
            poll(
                lambda: sum(t.status == "running" for t in client.list()) == 3,
                60,
                "the first worker never ran the three tasks",
            )
            # the forkserver, the resource tracker and a child per run
            poll(lambda: len(descendants(first.pid)) >= 5, 60, "the children never started")
            children = descendants(first.pid)
            first.send_signal(signal.SIGKILL)
            first.wait()
            poll(lambda: not alive(children), 15, f"children outlived the worker: {children}")
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        second = spawn(mongo_uri, db_name, "rescuer")
        try:
            poll(
                lambda: all(client.get(f"nap-{i}").status == "succeeded" for i in range(3)),  # type: ignore[union-attr]
                240,
                "the runs of the killed worker were not taken over",
            )
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(30)
        assert not alive(descendants(second.pid))
