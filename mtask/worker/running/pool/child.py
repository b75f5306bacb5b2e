"""What runs in a child process of the pool (``mtask.worker.running.pool.pool``): its
containment, one handler call at a time, the run's live output and steps over the pipe, and
the watch that stops the run when its lease passes unrenewed.

A child leads a process group of its own and is a subreaper (``_contain``), asks for SIGKILL
when the worker dies (``_die_with_parent``), receives a ``pipe.Call`` on its pipe, calls the
handler and sends a ``pipe.Reply`` (how it ended, and the child's resident bytes), within the
pipe's ``Bounds``. What the run left running is killed before the reply (``_sweep``). The parent
side (starting, killing, recycling children; the memory watch and the reaper) is
``mtask.worker.running.pool.pool``; every message between them is ``pipe``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing.connection
import os
import resource
import signal
import sys
import threading
import time
from typing import Any, cast

import bson

from mtask.errors import InvalidParams
from mtask.flows import is_steps
from mtask.follow.output import RunOutput
from mtask.limits.snooze import Snooze
from mtask.registry import Fail, Handler, Retry, TaskContext
from mtask.steps import SignalTimeout, StepError, Suspended
from mtask.tracing import joined
from mtask.worker.running.failures import class_path, result_too_large, said, short_traceback
from mtask.worker.running.pool import pipe
from mtask.worker.running.pool.child_steps import ChildSteps, plain
from mtask.worker.running.pool.pipe import Bounds, Call, Output, Reply, ReplyKind, Stopped

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LEASE_POLL = 0.1
"""The longest a child's lease watch sleeps between two looks at its run's deadline."""


def _prctl(option: int, value: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(option, value, 0, 0, 0)


def _contain() -> None:
    """Lead a process group of our own (every process the handler starts inherits it, so one
    ``killpg`` reaches them all) and be a subreaper (descendants orphaned by their parent are
    re-parented to us, not to init, so ``_sweep`` finds them, even one that left the group)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _die_with_parent(alive: multiprocessing.connection.Connection, worker_pid: int) -> None:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                alive.recv()  # the worker never sends: this returns only at EOF
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)  # the group, with whatever the handler started
        os._exit(70)

    threading.Thread(target=watch, name="mtask-child-watch", daemon=True).start()
    if os.getppid() == 1 or not _alive(worker_pid):
        os._exit(70)  # the worker died before the watch started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rss_of(pid: int | str) -> int | None:
    """A process's resident bytes (``/proc/PID/statm``), None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _rss_bytes() -> int:
    rss = rss_of("self")
    return rss if rss is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _children_of(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (a scan of ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _sweep() -> int:
    """Kill and reap every descendant the run left behind; how many. Costs one ``waitpid``
    when there is none (the usual case). A subreaper's orphaned descendants are its children,
    so killing the children, round after round, reaches every generation."""
    killed = 0
    for _ in range(100):
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return killed  # no child at all
        if pid:
            continue  # reaped one that had ended; look again
        strays = _children_of(os.getpid())
        for stray in strays:
            with contextlib.suppress(OSError):
                os.kill(stray, signal.SIGKILL)
        for stray in strays:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(stray, 0)
        killed += len(strays)
        if not strays:
            time.sleep(0.01)  # a child between fork and /proc: look again
    return killed


def _call(call: Call, cancelled: Any, output: _ChildOutput, steps: ChildSteps) -> Reply:
    info = call.info
    ctx = TaskContext(
        key=info.key,
        name=info.name,
        attempt=info.attempt,
        run_id=info.run_id,
        worker_id=info.worker_id,
        cancelled=cast(asyncio.Event, cancelled),  # a multiprocessing Event: is_set() works
        output_for=output.made,
        steps_for=steps.steps_for,
        usage_for=steps.usage_for,
    )
    try:
        with joined(info.trace):  # the worker's run span is the parent of the spans here
            return _reply(call.handler, call.params, ctx)
    finally:
        steps.close()  # a request a thread it left behind makes now is refused
        output.close()  # what the handler said reaches the worker before its reply


def _reply(handler: Handler, params: dict[str, Any], ctx: TaskContext) -> Reply:
    """How the handler's call ended (its ``rss`` is set as the reply is framed)."""
    try:
        return Reply(ReplyKind.OK, handler.fn(*handler.args(handler.parse(params), ctx)))
    except Retry as exc:
        return Reply(ReplyKind.RETRY, said(exc), exc.delay)
    except Fail as exc:
        return Reply(ReplyKind.FAIL, said(exc))
    except Suspended as exc:  # the run ends WAITING (a BaseException: not a handler error)
        return Reply(ReplyKind.SUSPENDED, exc.wait)
    except (StepError, SignalTimeout) as exc:  # fail the task for good, as on a thread
        return Reply(ReplyKind.RAISE, exc)
    except Snooze as exc:  # SNOOZED, as on a thread
        return Reply(ReplyKind.RAISE, exc)
    except InvalidParams as exc:
        return Reply(ReplyKind.INVALID, str(exc))
    except MemoryError as exc:
        return Reply(ReplyKind.MEMORY, (short_traceback(exc), class_path(exc)))
    except BaseException as exc:  # noqa: BLE001 - any handler error is the task's failure:
        # sys.exit() (argparse's error) too, as on a thread; it ended the child
        return Reply(ReplyKind.ERROR, (short_traceback(exc), class_path(exc)))


class _Run:
    """The child's current run, shared by its main thread, its lease watch and its output
    sender: whoever takes ``lock`` and finds ``active`` set ends the run (the reply, or the
    stop at the deadline); every send on the pipe holds ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = False


OUTPUT_EVERY_S = 0.1
"""How often a child sends what its handler said (``ctx.progress``/``log``/``emit``)."""


class _ChildOutput:
    """A process-isolated run's live output (docs/output.md): its handler's ``RunOutput``,
    sent to the worker as ``pipe.Output`` every ``OUTPUT_EVERY_S`` by a thread started on
    the first thing said, and once more before the reply. The worker merges it into the run's
    own ``RunOutput`` and writes it under the run's fence. A run that says nothing starts no
    thread and sends nothing."""

    def __init__(self, conn: multiprocessing.connection.Connection, run: _Run) -> None:
        self.conn, self.run = conn, run
        self.output = RunOutput(wake=self._woken)  # the worker stamps the entries' time
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def made(self, _ctx: TaskContext) -> RunOutput:
        return self.output

    def _woken(self, _output: RunOutput) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._follow, name="mtask-child-output", daemon=True
                )
                self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(OUTPUT_EVERY_S):
            self.send()

    def send(self) -> None:
        while batch := self.output.take():
            with self.run.lock:  # never between the bytes of another send
                if not self.run.active:
                    return  # the lease watch ended the run
                try:
                    pipe.send(self.conn, Output(batch))
                except Exception:  # noqa: BLE001 - the worker is gone: its run ends anyway
                    self.output.close()  # and the reply must not fail with it
                    return

    def close(self) -> None:
        """Stop the thread and send what is left: called when the handler has returned or
        raised, before its reply. What a thread it left behind says later is dropped."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        self.output.close()
        self.send()


def _frame(reply: Reply, bounds: Bounds) -> memoryview:
    """The message that says ``reply``, pickled once (as ``pipe.send`` would), within its
    bounds: a result's reply past ``bounds.reply`` says what the worker would make of it, and
    no reply past ``bounds.message`` is sent (the worker would not read it)."""
    reply = reply._replace(rss=_rss_bytes())
    try:
        frame = pipe.frame(reply)
    except Exception as exc:  # noqa: BLE001 - e.g. a result that cannot be pickled
        frame = pipe.frame(_unpickled(reply, exc))
    if len(frame) > bounds.reply and reply.kind is ReplyKind.OK and not is_steps(reply.value):
        frame = _stored(reply, bounds)
    if len(frame) <= bounds.message:
        return frame
    return _refused(
        reply,
        f"the handler's reply is {len(frame)} bytes pickled, more than the {bounds.message} "
        "a process-isolated run may send the worker",
    )


def _unpickled(reply: Reply, exc: Exception) -> Reply:
    """What to reply instead of ``reply``, which pickle refused: a result as BSON gives it back
    (what the worker stores of it anyway), or why it cannot be stored (for good, as on a
    thread); anything else as an error."""
    if reply.kind is ReplyKind.OK:
        try:
            return reply._replace(value=plain(reply.value))
        except Exception as bad:  # noqa: BLE001 - any encoding problem is the handler's
            return reply._replace(kind=ReplyKind.FAIL, value=f"the result cannot be stored: {bad}")
    said_why = f"the result cannot be sent back: {exc!r}"
    return Reply(ReplyKind.ERROR, (said_why, None), rss=reply.rss)


def _stored(reply: Reply, bounds: Bounds) -> memoryview:
    """The reply for a result too large to cross as it is: why it is not stored (for good, as
    on a thread), or, if it is (pickle takes more room than BSON for it), what BSON gives back
    of it, which the worker stores the same."""
    try:
        size = len(bson.encode({"result": reply.value}))
    except Exception as bad:  # noqa: BLE001 - any encoding problem is the handler's
        return _refused(reply, f"the result cannot be stored: {bad}")
    if size > bounds.result:
        return _refused(reply, result_too_large(size, bounds.result))
    return pipe.frame(reply._replace(value=plain(reply.value)))


def _refused(reply: Reply, why: str) -> memoryview:
    return pipe.frame(Reply(ReplyKind.REFUSED, why, rss=reply.rss))


def _say(conn: multiprocessing.connection.Connection, message: pipe.Message) -> None:
    with contextlib.suppress(Exception):
        pipe.send(conn, message)


def _watch_lease(deadline: Any, run: _Run, conn: multiprocessing.connection.Connection) -> None:
    """Stop the run, and the child's whole process group, once its lease deadline passes
    with no renewal from the parent (a frozen or stopped worker). ``deadline.value`` is
    ``time.monotonic()`` seconds (one clock for every process of the host); infinite while
    the child is idle."""
    while True:
        left = deadline.value - time.monotonic()
        if left > 0 or not run.active:
            time.sleep(min(max(left, 0.0), LEASE_POLL) if run.active else LEASE_POLL)
            continue
        # a send (the reply, output) may be stuck in a full pipe to a frozen parent, and so
        # may ours: wait for either a little only
        if run.lock.acquire(timeout=0.2):
            if not run.active or deadline.value > time.monotonic():
                run.lock.release()  # the run ended, or a renewal arrived meanwhile
                continue
            run.active = False
            saying = threading.Thread(target=_say, args=(conn, Stopped(_rss_bytes())), daemon=True)
            saying.start()
            saying.join(0.2)
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)  # the handler and everything it started
        os._exit(71)


def child_main(
    conn: multiprocessing.connection.Connection,
    alive: multiprocessing.connection.Connection,
    cancelled: Any,
    deadline: Any,
    worker_pid: int,
    bounds: Bounds,
) -> None:
    _contain()
    _die_with_parent(alive, worker_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the worker's to handle
    run = _Run()
    threading.Thread(
        target=_watch_lease, args=(deadline, run, conn), name="mtask-child-lease", daemon=True
    ).start()
    while (call := pipe.next_call(conn)) is not None:  # None: retired, or the worker is gone
        run.active = True
        reply = _call(call, cancelled, _ChildOutput(conn, run), ChildSteps(conn, run))
        with run.lock:
            if not run.active:
                return  # the lease watch stopped the run (and is killing us)
            run.active = False
            _sweep()  # what the handler left running ends with its run
            conn.send_bytes(_frame(reply, bounds))
        if reply.kind is ReplyKind.MEMORY:
            return  # a child that ran out of memory is not trusted with another run
