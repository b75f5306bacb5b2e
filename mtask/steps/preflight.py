"""Preflight: before a deploy, which parked tasks the new handlers would replay
cleanly and which would mismatch, and at which step: ``mtask step check app:registry``.

A parked task is a pending one with a journal (sleeping, waiting for a signal or children, or
waiting for its retry). Each is replayed *dry* against the new handler: its steps are given
back from their recorded results (a step's function is never called), and the replay stops
where the journal ends, at the first step it would have to call, await or check again (its
*frontier*, ``RunSteps(frontier=)``): up to there, the new code asked for the recorded steps,
so the task replays cleanly. A ``StepMismatch`` before that (or a gather whose recorded steps
are not asked for) is the mismatch the deploy would cause, with the step it names.

What a dry replay cannot stub: the handler's own code between steps runs. It runs in a
sandbox process (``mtask.steps.sandbox``) that has no MongoDB client, no publisher and no
output but memory, and whose audit hook refuses I/O: opening a network connection, a DNS
lookup, writing or removing a file, starting a process, sending a signal. A task whose handler
tried one is reported ``unchecked`` (with what it tried), as is one that did not reach its
frontier in time. The limits, said plainly: only what Python's audit events show is refused
(a C extension's own system calls are not); a handler that reads a file or the environment
between steps reads this machine's; a task whose handler chooses its steps by the clock or a
random number outside ``ctx.now``/``ctx.uuid`` may replay differently here than on a worker.

Nothing is written. The tasks are read page by page (the ``name_status_newest`` index, only
the fields a replay needs), and replayed in batches in the sandbox while the next page is
read.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import bson
from bson.codec_options import CodecOptions

from mtask.driver import Doc
from mtask.errors import InvalidParams, MtaskError, RegistryNotFound
from mtask.registry import Handler, Registry, TaskContext
from mtask.security.encryption import Encryption, sealed
from mtask.steps import RunSteps, SignalTimeout, StepError, StepMismatch, complete_now
from mtask.steps.children import ChildFailed
from mtask.store.parked import PAGE

OUTCOMES = ("clean", "mismatch", "error", "unchecked", "orphaned")
"""``orphaned``: a parked task of a name the new registry no longer has (no worker of it would
ever run it again)."""


class Frontier(BaseException):
    """The replay reached where the journal ends: the task replays cleanly up to here."""


class ForbiddenIo(BaseException):
    """The handler tried I/O outside a step during a dry replay (the sandbox's audit hook)."""


class Stuck(BaseException):
    """A batch's replays did not end in time (the sandbox's timer)."""


@dataclass(frozen=True)
class Verdict:
    """How task ``key`` (of handler ``name``) would replay: ``outcome`` one of ``OUTCOMES``;
    ``step`` the 1-based place it names (a mismatch's, or the frontier's); ``detail`` in
    words."""

    key: str
    name: str
    outcome: str
    step: int | None = None
    detail: str = ""

    def to_document(self) -> Doc:
        return {
            "key": self.key,
            "name": self.name,
            "outcome": self.outcome,
            "step": self.step,
            "detail": self.detail,
        }

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Verdict:
        step = doc.get("step")
        return cls(
            str(doc.get("key")),
            str(doc.get("name")),
            str(doc.get("outcome")),
            step if isinstance(step, int) else None,
            str(doc.get("detail") or ""),
        )


class ReplayStore:
    """A ``StepStore`` for a dry replay: it reads what the task's document holds, and any write
    means the replay went past the journal (``Frontier``: it should have stopped before)."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.doc = doc
        at = doc.get("updated_at")
        self.at = at if isinstance(at, dt.datetime) else dt.datetime(1970, 1, 1, tzinfo=dt.UTC)

    def now(self) -> dt.datetime:
        return self.at if self.at.tzinfo is not None else self.at.replace(tzinfo=dt.UTC)

    async def record(self, *args: Any) -> None:
        raise Frontier("a write")

    async def record_named(self, *args: Any) -> None:
        raise Frontier("a write")

    async def spawn(self, *args: Any) -> None:
        raise Frontier("a spawn")

    async def publish(self, *args: Any) -> None:
        raise Frontier("a spawn")

    async def children(self, step: str) -> list[Doc]:
        raise Frontier("children awaited")

    async def holds(self, *args: Any) -> Doc | None:
        raise Frontier("a wait on data")

    async def spill(self, data: bytes) -> Doc:
        raise Frontier("a write")

    async def transact(self, *args: Any) -> Any:
        raise Frontier("a transaction")

    async def load(self, spill: Mapping[str, Any]) -> bytes:
        data = (self.doc.get("_spills") or {}).get(str(spill.get("id")))
        if not isinstance(data, bytes):
            raise MtaskError("a result stored aside could not be read for the replay")
        return data

    async def signals(self, name: str) -> list[Doc]:
        sent = self.doc.get("signals")
        return [s for s in sent or [] if isinstance(s, dict) and s.get("name") == name]


def _stop(index: int, name: str, kind: str, prior: Doc | None) -> None:
    raise Frontier(f"step {index + 1} ({name})")


async def _publish_nothing(*args: Any, **kw: Any) -> None:
    return None


def context_for(doc: Mapping[str, Any]) -> TaskContext:
    """The context of a dry replay of ``doc``: its journal replays the recorded steps and stops
    at the first one it would call, await or check again; ``publish`` does nothing; what the
    handler says stays in memory."""
    journal = RunSteps(
        ReplayStore(doc),
        doc.get("steps"),
        run_id="preflight",
        attempt=int(doc.get("attempts") or 0) + 1,
        blocking_io=complete_now,
        frontier=_stop,
    )
    return TaskContext(
        key=str(doc["_id"]),
        name=str(doc.get("name")),
        attempt=journal.attempt,
        run_id="preflight",
        worker_id="preflight",
        publisher=_publish_nothing,
        steps_for=lambda _ctx, _gate: journal,  # it stops before a step would be called
    )


SEALED = (
    "its params are encrypted and this check cannot open them (the key file in "
    "MTASK_ENCRYPTION_KEY_FILE, as its workers have it)"
)


def judge(key: str, name: str, exc: BaseException | None) -> Verdict:
    """The verdict of a replay that ended with ``exc`` (``None``: the handler returned)."""
    if exc is None or isinstance(exc, Frontier):
        return Verdict(key, name, "clean", None, str(exc or "it would finish"))
    if isinstance(exc, StepMismatch):
        return Verdict(key, name, "mismatch", _place(str(exc)), str(exc))
    if isinstance(exc, ForbiddenIo | Stuck):
        return Verdict(key, name, "unchecked", None, str(exc))
    if isinstance(exc, SignalTimeout | ChildFailed):  # replayed as recorded: the same path
        return Verdict(key, name, "clean", None, f"it would raise {type(exc).__name__} again")
    what = "invalid params" if isinstance(exc, InvalidParams) else type(exc).__name__
    if isinstance(exc, StepError):
        what = "StepError"
    return Verdict(key, name, "error", None, f"{what}: {exc}")


def _place(text: str) -> int | None:
    """The step a mismatch names (``step 3 is recorded as …``)."""
    words = text.split()
    if len(words) > 1 and words[0] == "step" and words[1].isdigit():
        return int(words[1])
    return None


def replay_call(handler: Handler, doc: Mapping[str, Any]) -> Coroutine[Any, Any, Any] | Any:
    """Start a dry replay of ``doc``: an ``async def`` handler's coroutine (the caller awaits
    it), or a plain one's result (it ran here)."""
    ctx = context_for(doc)
    params = handler.parse(doc.get("params") or {})
    return handler.fn(*handler.args(params, ctx))


async def replay(registry: Registry, doc: Mapping[str, Any]) -> Verdict:
    """``doc``'s dry replay against its handler in ``registry``, to its verdict."""
    key, name = str(doc.get("_id")), str(doc.get("name"))
    handler = registry.handlers.get(name)
    if handler is None:
        return Verdict(key, name, "unchecked", None, "no handler of this name in the registry")
    if sealed(doc.get("params")):
        return Verdict(key, name, "unchecked", None, SEALED)
    try:
        started = replay_call(handler, doc)
        if handler.is_async:
            await started
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - every end of a replay is a verdict
        return judge(key, name, exc)
    return judge(key, name, None)


def replay_now(
    registry: Registry, doc: Mapping[str, Any], loop: asyncio.AbstractEventLoop
) -> Verdict | None:
    """``replay``, driven here rather than scheduled on ``loop`` (a replay's steps never wait,
    so most end without suspending): its verdict if it ended so as clean or mismatched; else
    ``None``, and the caller replays it again on the loop (a replay has no side effect)."""
    coro = replay(registry, doc)
    asyncio.events._set_running_loop(loop)  # for a handler that asks for it
    try:
        coro.send(None)
    except StopIteration as stop:
        verdict: Verdict = stop.value
        return verdict if verdict.outcome in ("clean", "mismatch") else None
    finally:
        asyncio.events._set_running_loop(None)
    coro.close()  # it waited for something: the loop's turn, from the start
    for task in asyncio.all_tasks(loop):  # what it had begun meanwhile
        task.cancel()
    return None


# -- the report --------------------------------------------------------------------------------


@dataclass
class NameReport:
    """One name's parked tasks: how many, by outcome, and the first few that are not clean."""

    name: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    examples: list[Verdict] = field(default_factory=list)

    @property
    def parked(self) -> int:
        return sum(self.counts.values())


@dataclass
class Report:
    """Every name's parked tasks, as the new handlers would replay them; ``seconds``: how long
    the check took."""

    names: dict[str, NameReport] = field(default_factory=dict)
    seconds: float = 0.0
    examples: int = 10

    def add(self, verdict: Verdict) -> None:
        report = self.names.setdefault(verdict.name, NameReport(verdict.name))
        report.counts[verdict.outcome] = report.counts.get(verdict.outcome, 0) + 1
        if verdict.outcome != "clean" and len(report.examples) < self.examples:
            report.examples.append(verdict)

    @property
    def mismatches(self) -> int:
        return sum(r.counts["mismatch"] for r in self.names.values())

    @property
    def orphaned(self) -> int:
        """The parked tasks of names the new registry no longer has."""
        return sum(r.counts["orphaned"] for r in self.names.values())

    @property
    def bad(self) -> bool:
        """Whether the deploy would strand a parked task: one would mismatch, or no handler of
        its name is left."""
        return bool(self.mismatches or self.orphaned)

    def to_document(self) -> Doc:
        return {
            "seconds": round(self.seconds, 3),
            "names": {
                n: {
                    "parked": r.parked,
                    **r.counts,
                    "examples": [v.to_document() for v in r.examples],
                }
                for n, r in sorted(self.names.items())
            },
        }


def alarm(seconds: float, handler: Callable[[int, Any], None]) -> None:
    """The sandbox's timer (``signal.setitimer``): ``0`` clears it."""
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


# -- the check: pages read here, replayed in the sandbox ---------------------------------------


class Pages(Protocol):
    def parked(self, name: str, after: tuple[Any, Any] | None = None) -> list[Doc]: ...

    @property
    def encryption(self) -> Encryption | None:
        """Opens encrypted params for the replay (a check without it leaves them unchecked)."""
        ...

    def names(self) -> list[str]: ...


def check(
    client: Pages,
    registry: str,
    names: Iterable[str] | None = None,
    *,
    timeout: float = 5.0,
    examples: int = 10,
) -> Report:
    """The parked tasks of ``registry``'s names (or of ``names`` among them), each replayed dry
    by the handlers ``registry`` (``module:attribute``) names, in a sandbox process; and those
    of the names in the collection the registry no longer has (``orphaned``: none would run
    again). Reads page by page (``client.parked``); writes nothing. ``RegistryNotFound`` if
    the sandbox cannot import it."""
    started = time.monotonic()
    report = Report(examples=examples)
    with _sandbox(registry, timeout) as (proc, verdicts):
        hello = next(verdicts, None)
        if hello is None or "error" in hello:
            raise RegistryNotFound(str((hello or {}).get("error") or "the sandbox did not start"))
        wanted = [n for n in hello["names"] if names is None or n in set(names)]
        failed: list[BaseException] = []
        feeder = threading.Thread(target=_feed, args=(client, wanted, proc, failed), daemon=True)
        feeder.start()
        for doc in verdicts:
            report.add(Verdict.from_document(doc))
        feeder.join()
        gone = [n for n in client.names() if n not in hello["names"]]
        for name in gone if names is None else [n for n in gone if n in set(names)]:
            for verdict in _orphans(client, name):
                report.add(verdict)
    if failed:  # reading the tasks failed (MongoDB away): the report would be short
        raise failed[0]
    if proc.returncode:
        said = getattr(proc, "said", "")
        raise MtaskError(f"the preflight's sandbox failed (exit {proc.returncode}): {said}")
    report.seconds = time.monotonic() - started
    return report


def _orphans(client: Pages, name: str) -> Iterator[Verdict]:
    """The parked tasks of ``name``, a name the new registry has no handler of."""
    detail = "no handler of this name in the new registry: no worker would run it again"
    after = None
    while True:
        page = client.parked(name, after)
        for doc in page:
            yield Verdict(str(doc["_id"]), name, "orphaned", None, detail)
        if len(page) < PAGE:
            return
        after = (page[-1].get("created_at"), page[-1]["_id"])


def _tail(log: Any) -> str:
    """The last line the sandbox wrote on its standard error (a handler's prints, or the
    sandbox's own traceback)."""
    log.seek(0)
    lines = log.read().decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else "no output"


def _feed(
    client: Pages, names: list[str], proc: subprocess.Popen[bytes], failed: list[BaseException]
) -> None:
    """The parked tasks, page by page, into the sandbox (on a thread of its own, while the
    verdicts are read); what failed is put in ``failed``."""
    assert proc.stdin is not None
    try:
        for name in names:
            after = None
            while True:
                page = client.parked(name, after)
                for doc in page:
                    proc.stdin.write(bson.encode(_opened(doc, client.encryption)))
                proc.stdin.write(FLUSH)
                if len(page) < PAGE:
                    break
                after = (page[-1].get("created_at"), page[-1]["_id"])
    except Exception as exc:  # noqa: BLE001 - raised by check(), once the sandbox stopped
        failed.append(exc)
    finally:
        proc.stdin.close()


def _opened(doc: Doc, encryption: Encryption | None) -> Doc:
    """``doc`` with its params decrypted, if they are encrypted and ``encryption`` opens them;
    else as it is (the sandbox then says it cannot check it: a handler never sees ciphertext)."""
    params = doc.get("params")
    if encryption is None or not sealed(params):
        return doc
    from pymongo.errors import EncryptionError

    try:
        return {**doc, "params": encryption.open(params)}
    except EncryptionError:
        return doc


FLUSH = bson.encode({"_flush": True})


@contextlib.contextmanager
def _sandbox(
    registry: str, timeout: float
) -> Iterator[tuple[subprocess.Popen[bytes], Iterator[Doc]]]:
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed below, once the sandbox ended
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtask.steps.sandbox", registry, str(timeout)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
    )
    assert proc.stdout is not None
    try:
        yield proc, bson.decode_file_iter(proc.stdout, codec_options=_AWARE)
    finally:
        if proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.said = _tail(log) if proc.returncode else ""  # type: ignore[attr-defined]
        log.close()


_AWARE: CodecOptions[dict[str, Any]] = CodecOptions(tz_aware=True)
