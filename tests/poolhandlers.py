"""Handlers for the process-pool tests: importable by child processes (forkserver)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mtask import Fail, Registry, Retry, TaskContext, TaskOptions

registry = Registry()


@registry.task("double", isolation="process")
def double(params: dict[str, Any]) -> dict[str, Any]:
    return {"value": params["n"] * 2, "pid": os.getpid()}


@registry.task("exit3", isolation="process")
def exit3(params: dict[str, Any]) -> None:
    os._exit(3)


@registry.task("segfault", isolation="process")
def segfault(params: dict[str, Any]) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(10)


@registry.task("hog", isolation="process")
def hog(params: dict[str, Any]) -> None:
    chunks = []
    while True:
        chunks.append(bytearray(16 * 1024 * 1024))


@registry.task("spin", isolation="process", time_limit=1.0)
def spin(params: dict[str, Any]) -> None:
    while True:
        pass


@registry.task("sleepy", isolation="process", time_limit=1.0)
def sleepy(params: dict[str, Any]) -> None:
    time.sleep(3600)


@registry.task("cooperative", isolation="process")
def cooperative(params: dict[str, Any], ctx: TaskContext) -> str:
    while not ctx.cancelled.is_set():
        time.sleep(0.01)
    return "saw cancelled"


@registry.task("retry", isolation="process")
def retry(params: dict[str, Any]) -> None:
    raise Retry("later", delay=2.5)


@registry.task("fail", isolation="process")
def fail(params: dict[str, Any]) -> None:
    raise Fail("no")


@registry.task("boom", isolation="process")
def boom(params: dict[str, Any]) -> None:
    raise ValueError("boom in child")


@registry.task("pid", isolation="process")
def pid(params: dict[str, Any]) -> int:
    return os.getpid()


@registry.task("burn", isolation="process")
def burn(params: dict[str, Any]) -> int:
    n = 0
    for i in range(int(params.get("loops", 200_000))):
        n += i * i
    return n % 1000


@registry.task("forever", isolation="process")
def forever(params: dict[str, Any]) -> None:
    time.sleep(3600)


@registry.task("nap", isolation="process")
def nap(params: dict[str, Any]) -> float:
    time.sleep(params["seconds"])
    return float(params["seconds"])


def _grandchild(pidfile: str) -> subprocess.Popen[bytes]:
    """A process the handler starts and does not wait for; its pid written to ``pidfile``."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pidfile).write_text(str(sleeper.pid))
    return sleeper


@registry.task("spawn_and_sleep", isolation="process")
def spawn_and_sleep(params: dict[str, Any]) -> None:
    _grandchild(params["pidfile"])
    time.sleep(params.get("seconds", 3600))


@registry.task("leave_behind", isolation="process")
def leave_behind(params: dict[str, Any]) -> str:
    _grandchild(params["pidfile"])
    return "left"


@registry.task("thread_coop", soft_time_limit=0.2, time_limit=10)
def thread_coop(params: dict[str, Any], ctx: TaskContext) -> str:
    while not ctx.cancelled.is_set():
        time.sleep(0.01)
    return "stopped at the soft limit"


@registry.task("thread_hang", time_limit=0.3)
def thread_hang(params: dict[str, Any]) -> None:
    time.sleep(2)


@registry.task("async_hang", time_limit=0.3)
async def async_hang(params: dict[str, Any]) -> None:
    await asyncio.sleep(3600)


@registry.task("plain_pid")
def plain_pid(params: dict[str, Any]) -> int:
    return os.getpid()


@registry.task("defaulted", options=TaskOptions(max_retries=7, priority=5))
def defaulted(params: dict[str, Any]) -> None:
    return None


@registry.task("narrate_in_child", isolation="process")
def narrate_in_child(params: dict[str, Any], ctx: TaskContext) -> int:
    """Live output from a child process (docs/output.md): progress many times, lines and
    chunks over more than one of the child's sends."""
    for i in range(1, params["chunks"] + 1):
        ctx.emit({"i": i, "pid": os.getpid()})
        for step in range(100):
            ctx.progress((i - 1 + step / 100) / params["chunks"], f"chunk {i}")
        if i % 10 == 0:
            ctx.log.info("ten more", i=i)
        time.sleep(0.005)
    ctx.progress(1.0, "all sent")
    return os.getpid()


@registry.task("narrate_then_fail", isolation="process")
def narrate_then_fail(params: dict[str, Any], ctx: TaskContext) -> None:
    """Says things in a child, then fails: what it said lands before its outcome."""
    for i in range(params["chunks"]):
        ctx.emit(i)
        ctx.progress((i + 1) / params["chunks"], f"chunk {i}")
        time.sleep(0.002)
    ctx.log.error("giving up")
    raise Fail("said it all, then failed")


@registry.task("flood_in_child", isolation="process")
def flood_in_child(params: dict[str, Any], ctx: TaskContext) -> None:
    """Says its pid, then chunks of ``size`` bytes until it is stopped."""
    ctx.emit(os.getpid())
    while True:
        ctx.emit(b"x" * params["size"])
        time.sleep(0.001)


def lease_watch_with_a_full_pipe(conn: Any) -> None:
    """A child process's lease watch at a run's deadline when the pipe to the worker is full
    (a frozen worker that stopped reading): its own group first, for the watch kills it."""
    from types import SimpleNamespace

    from mtask.worker.pool import _Run, _watch_lease

    os.setpgid(0, 0)
    os.set_blocking(conn.fileno(), False)
    for size in (4096, 1):
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(conn.fileno(), b"\0" * size)
    os.set_blocking(conn.fileno(), True)
    run = _Run()
    run.active = True
    _watch_lease(SimpleNamespace(value=0.0), run, conn)
