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

    from mtask.worker.running.pool.child import _Run, _watch_lease

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


# -- durable steps in a child process (tests/integration/test_steps_process.py) -------------------

_MONGO: dict[str, Any] = {}


def _counted(params: dict[str, Any], label: str, value: Any) -> Any:
    """A step's function: counts its calls in MongoDB (the child is another process than the
    test's), fails its first call when ``label`` is in ``params["fail_once"]``."""
    from pymongo import MongoClient

    uri = params["uri"]
    if uri not in _MONGO:
        _MONGO[uri] = MongoClient(uri)
    calls = _MONGO[uri][params["db"]]["step_calls"]
    n = calls.find_one_and_update(
        {"_id": label}, {"$inc": {"n": 1}}, upsert=True, return_document=True
    )["n"]
    if label in params.get("fail_once", ()) and n == 1:
        raise RuntimeError(f"{label} failed once")
    return value


@registry.task(
    "steps_in_child", isolation="process", options={"retry_delay_ms": 0, "max_retries": 3}
)
def steps_in_child(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    k = ctx.key
    charged = ctx.step_sync("charge", _counted, params, f"{k}:charge", {"pid": os.getpid()})
    ctx.progress(0.5, "charged")  # output and steps share the child's pipe
    label = ctx.step_sync("label", _counted, params, f"{k}:label", "L-42")
    return {"charged": charged, "label": label, "attempt": ctx.attempt, "pid": os.getpid()}


@registry.task("nap_in_child", isolation="process")
def nap_in_child(params: dict[str, Any], ctx: TaskContext) -> str:
    before = ctx.step_sync("before", _counted, params, f"{ctx.key}:before", 1)
    ctx.sleep_sync(params["seconds"])
    after = ctx.step_sync("after", _counted, params, f"{ctx.key}:after", 2)
    return f"{before}+{after}"


@registry.task("rounds_in_child", isolation="process")
def rounds_in_child(params: dict[str, Any], ctx: TaskContext) -> Any:
    """Continues as new (``ctx.continue_as_new``) in its child process, each journal spawning
    a child of its own."""
    got = ctx.spawn_and_wait_sync([("double", {"n": params["round"]})])
    done = [*params["done"], got[0]["value"]]
    if params["round"] < 2:
        ctx.continue_as_new({"round": params["round"] + 1, "done": done})
    return {"done": done, "pid": os.getpid()}


@registry.task("approval_in_child", isolation="process")
def approval_in_child(params: dict[str, Any], ctx: TaskContext) -> Any:
    from mtask.steps import SignalTimeout

    ctx.step_sync("ask", _counted, params, f"{ctx.key}:ask", None)
    try:
        decision = ctx.wait_for_sync("approved", timeout=params.get("timeout"))
    except SignalTimeout:
        return "timed out"
    return {"decision": decision, "pid": os.getpid()}


@registry.task("big_in_child", isolation="process")
def big_in_child(params: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    """A result past the inline size: spilled through the worker, loaded back after a sleep."""
    blob = ctx.step_sync("blob", _counted, params, f"{ctx.key}:blob", b"\x07" * params["size"])
    ctx.sleep_sync(0.05)
    return {"bytes": len(blob), "ok": blob == b"\x07" * params["size"], "attempt": ctx.attempt}


@registry.task("fickle_in_child", isolation="process", options={"retry_delay_ms": 0})
def fickle_in_child(params: dict[str, Any], ctx: TaskContext) -> str:
    first = "a" if ctx.attempt == 1 else "b"  # not a function of its params: a mismatch
    ctx.step_sync(first, _counted, params, f"{ctx.key}:{first}", 1)
    ctx.sleep_sync(0.01)
    return "never"


@registry.task("steps_without_a_worker", isolation="process")
def steps_without_a_worker(params: dict[str, Any], ctx: TaskContext) -> Any:
    return ctx.step_sync("one", int, 1)


@registry.task("sleep_in_child", isolation="process")
def sleep_in_child(params: dict[str, Any], ctx: TaskContext) -> None:
    ctx.sleep_sync(params["seconds"], name="nap")


@registry.task("steps_refused_in_child", isolation="process")
def steps_refused_in_child(params: dict[str, Any], ctx: TaskContext) -> None:
    """The worker refuses steps to a task of concurrency 2: its error is raised here (and
    said in a ``Fail``, which ends the task at once)."""
    from mtask.steps import StepError

    try:
        ctx.step_sync("one", int, 1)
    except StepError as exc:
        raise Fail(f"caught {type(exc).__name__} in {os.getpid()}: {exc}") from None
    raise Fail("not refused")


def _row(params: dict[str, Any], ctx: TaskContext, i: int) -> dict[str, Any]:
    """Step ``i`` of ``step_chain_in_child``: one row in ``step_rows``, written by the child."""
    from pymongo import MongoClient

    uri = params["uri"]
    if uri not in _MONGO:
        _MONGO[uri] = MongoClient(uri)
    row = {"task": ctx.key, "step": i, "run_id": ctx.run_id, "pid": os.getpid()}
    _MONGO[uri][params["db"]]["step_rows"].insert_one(row)
    return {"step": i, "run_id": ctx.run_id}


@registry.task("step_chain_in_child", isolation="process")
def step_chain_in_child(params: dict[str, Any], ctx: TaskContext) -> list[dict[str, Any]]:
    """``workerapp.step_chain`` in a child process: five steps ``s1``…``s5``, each a row; the
    run of worker ``hold_after``'s key holds after that step is recorded (the test kills it)."""
    hold_after = params.get("hold_after", {}).get(ctx.worker_id)
    results = []
    for i in range(1, 6):
        results.append(ctx.step_sync(f"s{i}", _row, params, ctx, i))
        if i == hold_after:
            time.sleep(3600)
    return results


def _tally(words: list[str]) -> Any:
    """A ``defaultdict`` with a lambda: BSON stores it as a document, pickle refuses it."""
    import collections

    counts: Any = collections.defaultdict(lambda: 0)
    for word in words:
        counts[word] += 1
    return counts


@registry.task("unpicklable_result", isolation="process")
def unpicklable_result(params: dict[str, Any]) -> Any:
    return _tally(params.get("words", ["a", "b", "a"]))


@registry.task("unpicklable_and_no_bson", isolation="process")
def unpicklable_and_no_bson(params: dict[str, Any]) -> Any:
    return lambda: None


@registry.task("unpicklable_step", isolation="process", options={"retry_delay_ms": 0})
def unpicklable_step(params: dict[str, Any], ctx: TaskContext) -> Any:
    def tally() -> Any:
        _counted(params, f"{ctx.key}:tally", None)
        return _tally(["a", "b", "a"])

    counts = ctx.step_sync("tally", tally)
    ctx.sleep_sync(0.01)  # the next run replays the step
    return {"counts": dict(counts), "attempt": ctx.attempt}


@registry.task("sys_exit_in_child", isolation="process")
def sys_exit_in_child(params: dict[str, Any]) -> None:
    sys.exit(3)  # as argparse does on an argument it refuses


@registry.task("sys_exit_in_thread", isolation="thread")
def sys_exit_in_thread(params: dict[str, Any]) -> None:
    sys.exit(3)


class Unsaid(Fail):
    def __str__(self) -> str:
        raise ValueError("cannot say")


@registry.task("unsaid_fail_in_child", isolation="process")
def unsaid_fail_in_child(params: dict[str, Any]) -> None:
    raise Unsaid()


# -- what a child sends back: its size and its unpickling (tests/integration/test_pool_replies.py)


def _landed(marker: str, value: dict[str, Any]) -> dict[str, Any]:
    """Called where a ``Landing`` is unpickled: marks that its bytes reached that process."""
    Path(marker).write_text(str(os.getpid()))
    return value


class Landing(dict):  # type: ignore[type-arg]
    """A result BSON stores as a document; unpickling it writes ``marker``."""

    def __init__(self, marker: str, size: int) -> None:
        super().__init__(blob="x" * size)
        self.marker = marker

    def __reduce__(self) -> Any:
        return (_landed, (self.marker, dict(self)))


def _big_result(params: dict[str, Any]) -> Any:
    return Landing(params["marker"], params["size"])


registry.task("big_result", isolation="process")(_big_result)
registry.task("big_result_in_thread", isolation="thread")(_big_result)


class ExitsWhenLoaded:
    """A result whose unpickling raises ``SystemExit`` (``__reduce__`` names ``sys.exit``)."""

    def __reduce__(self) -> Any:
        return (sys.exit, ("unpickled",))


@registry.task("exits_when_loaded", isolation="process")
def exits_when_loaded(params: dict[str, Any]) -> Any:
    return ExitsWhenLoaded()


def _cancelled() -> None:
    raise asyncio.CancelledError


class CancelsWhenLoaded:
    def __reduce__(self) -> Any:
        return (_cancelled, ())


@registry.task("cancels_when_loaded", isolation="process")
def cancels_when_loaded(params: dict[str, Any]) -> Any:
    return CancelsWhenLoaded()


class Padded(dict):  # type: ignore[type-arg]
    """A mapping BSON stores as its items, whose pickle also carries a large attribute."""

    def __init__(self, items: dict[str, Any], pad: int) -> None:
        super().__init__(items)
        self.pad = "p" * pad


@registry.task("padded_result", isolation="process")
def padded_result(params: dict[str, Any]) -> Any:
    return Padded({"a": 1}, params["pad"])


@registry.task("long_fail", isolation="process")
def long_fail(params: dict[str, Any]) -> None:
    raise Fail("x" * params["size"])


@registry.task("big_chunk", isolation="process")
def big_chunk(params: dict[str, Any], ctx: TaskContext) -> str:
    ctx.emit(b"x" * params["size"])
    return "said"


@registry.task("big_and_no_bson", isolation="process")
def big_and_no_bson(params: dict[str, Any]) -> Any:
    return {"blob": "x" * params["size"], "odd": {1, 2}}  # pickle takes a set, BSON does not


registry.price("small", input=1.0, output=4.0)  # per million tokens


def _charged(ctx: TaskContext, model: str | None, inp: int, out: int) -> int:
    """A model's call in a step: its usage charged from the child (once per call)."""
    ctx.record_usage_sync(model, input_tokens=inp, output_tokens=out)
    return inp


@registry.task("usage_in_child", isolation="process", options={"retry_delay_ms": 0})
def usage_in_child(params: dict[str, Any], ctx: TaskContext) -> int:
    """Charges in steps; its first run fails after them (the retry replays them, charging
    nothing), the second charges once more outside any step."""
    for n, (model, inp, out) in enumerate(params["calls"]):
        ctx.step_sync(f"call{n}", _charged, ctx, model, inp, out)
    if ctx.attempt == 1:
        raise RuntimeError("failed once after its steps")
    ctx.record_usage_sync(None, input_tokens=1, cost=0.5)
    return os.getpid()


@registry.task("spender_in_child", isolation="process", options={"retry_delay_ms": 0})
def spender_in_child(params: dict[str, Any], ctx: TaskContext) -> int:
    for n in range(params["steps"]):
        ctx.step_sync(f"call{n}", _charged, ctx, "small", 60, 40)
    return params["steps"]


@registry.task("metered_in_child", isolation="process", uses=["llm"], options={"retry_delay_ms": 0})
def metered_in_child(params: dict[str, Any], ctx: TaskContext) -> int:
    """Steps through the shared resource ``llm``, each admitted by its window of tokens."""
    for n in range(params["steps"]):
        ctx.step_sync(f"call{n}", _charged, ctx, "small", 70, 30)
    return params["steps"]
