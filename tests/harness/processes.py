"""Real processes: a worker process (one, or a cluster of them logging to files), the state of
a process in /proc, and a process stopped at the end of a test whatever state it is in."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mtask
from mtask.testing import worker_argv

from .stall import stall_report

if TYPE_CHECKING:
    from mtask import TaskClient

TESTS = Path(__file__).resolve().parents[1]
"""tests/: the registries worker processes run (``workerapp``, ``poolhandlers``…) live here."""
CHAOS = TESTS / "chaos"
"""tests/chaos: the chaos suite's registries (``chaosapp``, ``triggerapp``…)."""
MTASK_ROOT = Path(mtask.__file__).resolve().parent.parent


STOP_WITHIN = 30.0
"""How long a worker may take to stop once told; past it the harness fails the test (a hang)."""


def tree_env(home: Path = TESTS, **more: str) -> dict[str, str]:
    """The environment of a subprocess that runs the tree under test (this checkout's
    ``mtask`` first, whatever is installed) and the tests' apps in ``home`` (``workerapp`` …)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(home), str(MTASK_ROOT)]), **more}


def spawn_worker(
    uri: str,
    db: str,
    *extra: str,
    app: str = "workerapp:registry",
    home: Path = TESTS,
    env: dict[str, str] | None = None,
    prefix: list[str] | None = None,
    **popen: Any,
) -> subprocess.Popen[Any]:
    """``mtask worker run app`` as a process of its own (``prefix``: a wrapper's argv, e.g.
    faketime or unshare; ``popen``: more ``subprocess.Popen`` arguments, its pipes)."""
    popen.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(
        [*(prefix or []), *worker_argv(app, uri, db, *extra)],
        cwd=home,
        env=tree_env(home, **(env or {})),
        **popen,
    )


def stop_process(proc: subprocess.Popen[Any], timeout: float = STOP_WITHIN) -> bool:
    """End ``proc`` whatever state it is in: resumed if frozen, SIGTERM, SIGKILL after
    ``timeout`` seconds; its pipes read to the end. Whether it stopped in time."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False
    return True


@contextlib.contextmanager
def worker_process(
    uri: str, db: str, *extra: str, crash_expected: bool = False, **spawn: Any
) -> Iterator[subprocess.Popen[Any]]:
    """``spawn_worker`` for the block, stopped after it (``stop_process``). One that exits
    with anything but 0 (a crash, a kill) or does not stop within ``STOP_WITHIN`` fails the
    test that passed otherwise, unless the test expects it (``crash_expected``)."""
    proc = spawn_worker(uri, db, *extra, **spawn)
    try:
        yield proc
    except BaseException:
        stop_process(proc)
        raise
    if not stop_process(proc):
        raise AssertionError(f"the worker process did not stop within {STOP_WITHIN} s of SIGTERM")
    if proc.returncode != 0 and not crash_expected:
        raise AssertionError(f"the worker process exited with {proc.returncode} (a crash?)")


def process_state(pid: int) -> str | None:
    """The process's state letter (``Z`` for a zombie, ``T`` stopped), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def gone(pid: int) -> bool:
    return process_state(pid) is None


def dead(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever adopted it to reap it."""
    return process_state(pid) in (None, "Z")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


STOPPED = (None, 0, -signal.SIGTERM, -signal.SIGKILL)
"""How a worker that did not crash ends: still running, exit 0, or stopped by a signal a test
sends (SIGTERM before its handlers are installed, SIGKILL)."""


class Cluster:
    """Worker processes by id, each in a process group of its own, logging to a file in
    ``logs``; ``app`` is the registry they run, in ``home`` (tests/chaos by default)."""

    def __init__(
        self,
        uri: str,
        database: str,
        logs: Path,
        app: str = "chaosapp:registry",
        home: Path = CHAOS,
    ) -> None:
        self.uri = uri
        self.database = database
        self.logs = logs
        self.app = app
        """The registry the workers run (``module:attribute`` in ``home``)."""
        self.home = home
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned: list[str] = []
        """Every worker id spawned, in order (those killed too: ``explain`` shows their logs)."""
        self.kills = 0
        self.expected_exits: set[str] = set()

    def spawn(
        self,
        worker_id: str,
        *args: str,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        app: str | None = None,
    ) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{worker_id}.log", "ab")  # noqa: SIM115 - closed with the process
        proc = spawn_worker(
            self.uri, self.database, "--worker-id", worker_id, "--log-level", "INFO", *args,
            app=app or self.app, home=self.home, prefix=prefix, stdout=log,
            stderr=subprocess.STDOUT,
            # a group of its own: signals reach the worker also through a wrapper (faketime
            # forks it, and would leave it running)
            start_new_session=True,
            env={"CHAOS_URI": self.uri, "CHAOS_DB": self.database, **(env or {})},
        )  # fmt: skip
        log.close()
        self.procs[worker_id] = proc
        if worker_id not in self.spawned:
            self.spawned.append(worker_id)
        return proc

    def signal(self, worker_id: str, sig: signal.Signals) -> None:
        proc = self.procs[worker_id]
        os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.wait(timeout=10)
            self.kills += 1
            del self.procs[worker_id]

    def log_of(self, worker_id: str) -> str:
        return (self.logs / f"{worker_id}.log").read_text(errors="replace")

    def state_of(self, worker_id: str) -> str:
        """What ``worker_id``'s process is at, in words (for ``explain``)."""
        proc = self.procs.get(worker_id)
        if proc is None:
            return "killed with SIGKILL by the test"
        if (code := proc.poll()) is not None:
            return f"pid {proc.pid}, exited with {code}"
        frozen = process_state(proc.pid) == "T"
        return f"pid {proc.pid}, {'stopped (SIGSTOP)' if frozen else 'running'}"

    def explain(self, client: TaskClient) -> str:
        """What the queue of ``client`` is at and what each worker spawned logged
        (``harness.stall``): for a wait that timed out (``until_finished``'s ``explain``)."""
        logs = {
            f"{w} ({self.state_of(w)})": functools.partial(self.log_of, w) for w in self.spawned
        }
        return stall_report(client.db, client.collection.name, logs)

    def explainer(self, client: TaskClient) -> Callable[[], str]:
        """``explain`` of ``client``, to call later: ``until_finished(…, explain=…)``."""
        return functools.partial(self.explain, client)

    def expect_exit(self, worker_id: str) -> None:
        """The test makes ``worker_id`` exit with an error on purpose: ``close`` accepts it."""
        self.expected_exits.add(worker_id)

    def close(self) -> None:
        """Stop every worker (SIGCONT, then SIGTERM; SIGKILL to what is left after 20 s). A
        worker that exited on its own with anything but 0 (or death by SIGTERM or SIGKILL, which
        a test sends), or exited with an error when told to stop, crashed: that fails the test (an
        ``AssertionError`` naming it and the end of its log), unless the test said it would
        (``expect_exit``). One killed with SIGKILL by the test (``signal``) is no longer here."""
        crashed = {w: p.returncode for w, p in self.procs.items() if p.poll() not in STOPPED}
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
        for worker_id, proc in self.procs.items():
            stopped = True
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                stopped = False
            with contextlib.suppress(ProcessLookupError):  # whatever is left of the group
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            if stopped and proc.returncode not in STOPPED:
                crashed.setdefault(worker_id, proc.returncode)
        self.procs.clear()
        unexpected = {w: code for w, code in crashed.items() if w not in self.expected_exits}
        if unexpected:
            tails = "\n".join(
                f"--- {w} (exit {code}):\n" + "\n".join(self.log_of(w).splitlines()[-15:])
                for w, code in unexpected.items()
            )
            raise AssertionError(f"worker(s) crashed: {sorted(unexpected)}\n{tails}")
