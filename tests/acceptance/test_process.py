"""Real mtask-worker processes: SIGKILL mid-task and takeover, SIGTERM, bad arguments."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import running_worker, spawn_worker, wait_for
from workerapp import registry

from mtask import TaskClient
from mtask.cli.worker import loop_factory, stop_on_signals
from mtask.errors import UsageError

TESTS = Path(__file__).parents[1]


def spawn(uri: str, db: str, *extra: str) -> subprocess.Popen[str]:
    return spawn_worker(uri, db, *extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def test_killed_worker_is_preempted(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    victim = spawn(mongo_uri, db_name, "--worker-id", "victim", "--concurrency", "20")
    try:
        options = {"worker_timeout_ms": 2000, "ping_interval_ms": 300}
        client.publish_many(
            [
                {"name": "sleep", "key": f"t{i}", "params": {"seconds": 3600}, "options": options}
                for i in range(20)
            ]
        )
        await wait_for(lambda: client.stats().get("sleep", {}).get("running") == 20, timeout=60)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        async with running_worker(
            registry, mongo_uri, db_name, worker_id="rescuer", concurrency=20
        ) as (_, events):
            await events.wait("claimed", count=20, timeout=30)
            tasks = client.list(limit=20)
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.communicate(timeout=10)
    for task in tasks:
        dead, rescue = task.runs[0], task.runs[1]
        assert (dead.worker_id, dead.state) == ("victim", "TIMEOUT")
        assert rescue.worker_id == "rescuer" and task.failures == 1
        assert dead.lease_expires_at is not None
        assert rescue.claimed_at - dead.lease_expires_at <= dt.timedelta(seconds=1)


@pytest.mark.parametrize("loop", ["auto", "asyncio", "uvloop"])
async def test_sigterm_drains_then_releases(
    mongo_uri: str, db_name: str, client: TaskClient, loop: str
) -> None:
    proc = spawn(mongo_uri, db_name, "--grace", "0.5", "--loop", loop, "--log-level", "INFO")
    try:
        client.publish("sleep", "long", {"seconds": 3600})
        await wait_for(lambda: client.get("long").status == "running", timeout=60)  # type: ignore[union-attr]
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    _, err = proc.communicate(timeout=10)
    assert code == 0, err
    # auto: uvloop, a dependency wherever this suite runs (Linux, CPython)
    assert f"event loop: {'asyncio' if loop == 'asyncio' else 'uvloop'}" in err, err
    task = client.get("long")
    assert task is not None and task.status == "pending" and task.runs[0].state == "RELEASED", err
    assert client.workers() == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no_such_module:registry"], "cannot import 'no_such_module'"),
        (["workerapp:registry", "--loop", "trio"], "--loop: invalid choice: 'trio'"),
    ],
)
def test_bad_arguments_are_a_clear_error(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mtask", "worker", "run", *argv],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_loop_uvloop_without_uvloop_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    with pytest.raises(UsageError, match="uvloop is not installed"):
        loop_factory("uvloop")
    assert loop_factory("auto") == ("asyncio", None)  # auto falls back to asyncio's own
    assert loop_factory("asyncio") == ("asyncio", None)


def test_signal_handlers_are_restored() -> None:
    class Dummy:
        def stop(self, immediate: bool = False) -> None: ...

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    loop = asyncio.new_event_loop()
    try:
        with stop_on_signals(Dummy(), loop):  # type: ignore[arg-type]
            assert signal.getsignal(signal.SIGTERM) not in before
    finally:
        loop.close()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


async def test_worker_survives_a_mongodb_restart(tmp_path: Path, db_name: str) -> None:
    from mtask.embedded import EmbeddedMongo

    server = EmbeddedMongo(tmp_path / "restart")
    uri = server.start()
    uri_fast = uri + "&serverSelectionTimeoutMS=2000"
    try:
        with TaskClient(uri_fast, database=db_name) as client:
            async with running_worker(registry, uri_fast, db_name) as (worker, events):
                client.publish("sleep", "across", {"seconds": 4})
                await events.wait("claimed", key="across")
                await asyncio.to_thread(server.stop)
                await asyncio.sleep(1.0)  # an outage: the worker must ride it out
                assert await asyncio.to_thread(server.start) == uri  # same port, same data
                await events.wait("recorded", key="across", timeout=60)
                client.publish("add", "after", {"a": 1, "b": 1})
                await events.wait("recorded", key="after", timeout=60)
                assert worker.state == "running"
            task = client.get("across")
            assert task is not None and task.status == "succeeded" and task.attempts == 1
    finally:
        server.stop()


def test_demo_runs_and_preempts(mongo_uri: str, mongo: Any) -> None:
    """``mtask demo`` in a pipe: its lines apart (no progress bar run into the table's title),
    no Python repr, and where its tasks are (database ``mtask_demo``) with the commands that
    read them."""
    from mtask.demo import DATABASE

    try:
        shown = subprocess.run(
            [sys.executable, "-m", "mtask.cli", "demo", "--uri", mongo_uri, "--seconds", "90"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert shown.returncode == 0, shown.stdout + shown.stderr
        lines = shown.stdout.splitlines()
        assert "finished 300 of 300 tasks in " in shown.stdout
        assert any(line.startswith("What ran where") for line in lines), shown.stdout
        assert "{" not in shown.stdout and "300/300" not in shown.stdout  # no repr, no bar
        assert f"published 300 sample tasks to database {DATABASE}" in shown.stdout
        given = f"--uri '{mongo_uri}'"  # quoted: a URI's ? and & are the shell's
        assert f"  mtask stats --database {DATABASE} {given}" in lines, shown.stdout
        header = next(line for line in lines if line.startswith("name "))
        assert header.split()[1:3] == ["succeeded", "failed"], header  # derived states
        tasks = mongo[DATABASE]["tasks"]
        assert tasks.count_documents({"status": {"$in": ["pending", "running"]}}) == 0
        assert tasks.count_documents({"runs.state": "TIMEOUT"}) > 0  # worker-1 was preempted
        doomed = tasks.find_one({"_id": "doomed"})
        assert doomed is not None and doomed["status"] == "failed" and doomed["attempts"] == 3
    finally:
        mongo.drop_database(DATABASE)
