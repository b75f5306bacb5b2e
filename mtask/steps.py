"""Durable steps (docs/steps.md): a handler's steps recorded in its task document, replayed by
later runs of the task instead of being called again; sleeps and signal waits that end the run
and resume it on the server's clock.

``RunSteps`` is one run's journal: what earlier runs recorded (from the claimed document), the
replay rules, and what to record next. Its logic is written once, as generators that yield what
they need done (``_Io``: a write or read through the ``StepStore``; ``_Call``: the user's step
function), and run by ``step``/``sleep``/``wait_for`` (``async def`` handlers, on the worker's
loop) or ``step_sync``/``sleep_sync``/``wait_for_sync`` (plain ``def`` handlers, on a thread or
in a child process). No I/O here: the ``StepStore`` is the worker's
(``worker/running/step_stores.py``), a child process's pipe to it
(``worker/running/pool/child_steps.py``), or memory (``MemorySteps``, for tests).

Replay rules: step names are unique in a task (a name asked again from the same place in the
handler, a loop, is numbered: ``fetch#2``); a run asks for its steps in the recorded order
(the n-th step asked is the n-th recorded, same name and kind; a ``ctx.gather``'s steps are one
place, matched among themselves by name: ``Group``), else ``StepMismatch`` and the run fails
for good with nothing written. A step recorded ``done`` returns its result; one
recorded ``failed`` is called again (its attempts and errors kept); a ``sleep`` recorded with
its ``until`` is over once the server's clock passes it; a ``wait_for`` is over once its signal
is there (the k-th wait for a signal name takes the k-th signal of that name) or its timeout
passed (``SignalTimeout``, recorded, so a replay raises it again); a ``wait_until`` is over
once a ``find`` with its predicate returns the document (MongoDB decides, at the wait and at
each wake-up) or its timeout passed (``ConditionTimeout``, recorded likewise).

Issue 61 adds, each through the same ``StepStore``: parallel steps (``Group``, recorded by
name: ``StepStore.record_named``; ``mtask.parallel`` runs the branches); a step's own policy
(``mtask.step_policy``: ``_Pause`` between tries, ``StepTimeout``); values decided once and
patch markers (``value``, ``patched``: entries decided without I/O, ``pending`` until the next
step); what a step's function says held until its record (``mtask.output.holding``); children
(``mtask.spawn``'s plan, run here with ``run_plan``); and a ``frontier`` where a dry replay
stops (``mtask.preflight``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import datetime as dt
import inspect
import sys
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import bson

from mtask.errors import MtaskError
from mtask.models import storable_depth
from mtask.output import holding
from mtask.step_policy import NO_POLICY, StepPolicy, StepTimeout
from mtask.triggers import check_collection

Doc = dict[str, Any]
T = TypeVar("T")

MAX_STEPS = 1000
"""The most steps one task records (its document holds them)."""
MAX_STEP_NAME = 200
INLINE_BYTES = 16 * 1024
"""A result larger than this as BSON is kept in the side collection (``<tasks>.steps``)."""
INLINE_TOTAL_BYTES = 1024 * 1024
"""The most inline results one task document holds; later results spill."""
SPILL_CHUNK_BYTES = 4 * 1024 * 1024
"""A spilled result is cut into side documents of at most this many bytes."""
MAX_SPILL_BYTES = 512 * 1024 * 1024
MAX_TRIES_KEPT = 10
"""A step keeps its newest tries (run, attempt, when, how long, error)."""
NEVER = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)
"""``available_at`` of a task waiting for a signal without a timeout."""
KINDS: tuple[str, ...] = ("call", "sleep", "signal", "data")
# issue 61: children spawned and awaited, a recorded value (ctx.now, ctx.uuid), a patch marker
KINDS += ("children", "value", "patch")
STATES = ("done", "failed", "waiting", "timed_out")


class StepError(MtaskError):
    """A step asked for in a way the journal cannot record (a name used twice, too many steps,
    a result that is not BSON): the run fails for good, nothing is written."""

    default_message = "invalid step"


class StepMismatch(StepError):
    """This run asked for a step other than the one recorded at its place: the handler's code
    changed, or it chooses its steps by something other than its params and earlier steps."""

    default_message = "the steps asked for differ from the recorded ones"


class SignalTimeout(MtaskError):
    """``wait_for`` timed out before its signal came (the handler may catch it)."""

    default_message = "no signal before the timeout"


class ConditionTimeout(SignalTimeout):
    """``wait_until`` timed out before its document was in the state it waits for (a durable
    wait's timeout, as ``SignalTimeout``: the handler may catch either)."""

    default_message = "the document did not reach the state before the timeout"


MAX_WAIT_IDS = 1000
"""The most documents one ``wait_until`` may name (``_id``, or ``_id: {$in: [...]}``)."""
REFUSED_OPERATORS = ("$where", "$text", "$near", "$nearSphere")
"""Top-level operators a predicate may not use: aggregation's ``$match`` (the wake-up's check)
refuses them."""


def wait_ids(predicate: Any) -> list[Any]:
    """The ``_id`` values a ``wait_until`` predicate names: its ``_id`` is a value, or
    ``{"$eq": value}``, or ``{"$in": [values]}`` (at most ``MAX_WAIT_IDS``). A change to one of
    these documents is what may settle the wait; the tasks are found by them (an index)."""
    if not isinstance(predicate, Mapping):
        raise StepError("a wait's predicate is a find filter (a mapping)")
    for op in REFUSED_OPERATORS:
        if op in predicate:
            raise StepError(f"a wait's predicate cannot use {op}")
    try:
        bson.encode(dict(predicate))
    except Exception as exc:  # noqa: BLE001 - any encoding problem is the handler's
        raise StepError(f"a wait's predicate must be BSON: {exc}") from None
    if "_id" not in predicate:
        raise StepError(
            "a wait's predicate names the document's _id (a value, $eq or $in): a change to "
            "that document is what wakes the task"
        )
    return _id_values(predicate["_id"])


def _id_values(value: Any) -> list[Any]:
    """The ``_id``s a predicate's ``_id`` condition names (a value, ``$eq`` or ``$in``)."""
    if not (isinstance(value, Mapping) and value and all(str(k).startswith("$") for k in value)):
        if isinstance(value, list):
            raise StepError("an _id is never an array")
        return [value]
    if set(value) == {"$eq"}:
        return [value["$eq"]]
    if set(value) == {"$in"} and isinstance(value["$in"], list | tuple):
        ids = list(value["$in"])
        if not ids or len(ids) > MAX_WAIT_IDS:
            raise StepError(f"_id: {{$in: [...]}} names 1 to {MAX_WAIT_IDS} documents")
        return ids
    raise StepError("a wait's predicate names its _id with a value, $eq or $in")


@dataclass(frozen=True)
class Wait:
    """Why a run ends waiting: its step's place, the entry to record there (``None``: recorded
    by an earlier run), and until when (a sleep), or for which signal (its ``nth`` of that name)
    with a deadline (``NEVER`` without a timeout), or for which document's state (``data``:
    ``collection``, ``ids``, ``filter``)."""

    index: int
    entry: Doc | None
    until: dt.datetime
    signal: str | None = None
    nth: int = 0
    data: Doc | None = None
    children: str | None = None
    """Issue 61: the step whose spawned children it waits for (``mtask.spawn``)."""

    def to_document(self) -> Doc:
        step = self.entry["name"] if self.entry else None
        doc: Doc = {"until": self.until, "index": self.index}
        if step is not None:
            doc["step"] = step
        if self.signal is not None:
            doc["signal"] = self.signal
            doc["nth"] = self.nth
        if self.data is not None:
            doc["data"] = dict(self.data)
        if self.children is not None:
            doc["step"] = self.children
            doc["children"] = self.children
        return doc


class Suspended(BaseException):
    """Raised by ``sleep`` and ``wait_for`` to end the run as WAITING (a ``BaseException``, so
    a handler's ``except Exception`` does not swallow it): the worker records the wait and
    frees the slot; the task is claimed again when the sleep ends or the signal comes."""

    def __init__(self, wait: Wait) -> None:
        super().__init__(f"waiting until {wait.until.isoformat()}")
        self.wait = wait


class StepStore(Protocol):
    """Where a run's steps are written and read, fenced by the run
    (``worker/running/step_stores.py``)."""

    def now(self) -> dt.datetime:
        """The server's time, as this process estimates it."""
        ...

    async def record(self, index: int, entry: Doc, prior: Doc | None) -> None:
        """Write ``entry`` at ``index`` (replacing ``prior``, or as a new last entry) if the run
        still owns its task; ``LeaseLost`` if it does not."""
        ...

    async def spill(self, data: bytes) -> Doc:
        """Store a large encoded result aside; returns its reference (``id``, ``chunks``,
        ``bytes``) for the step's entry."""
        ...

    async def load(self, spill: Mapping[str, Any]) -> bytes: ...

    async def signals(self, name: str) -> list[Doc]:
        """The task's signals named ``name``, oldest first (``payload``, ``at``)."""
        ...

    async def holds(self, collection: str, predicate: Doc, waiting: Doc | None) -> Doc | None:
        """The document of ``collection`` that ``predicate`` (a find filter) matches now, or
        ``None``. With ``waiting`` (the wait's ``waiting`` document), the wait is announced
        first, fenced by the run: a change from then on wakes the task even before the run
        ends WAITING (``store.datawaits``)."""
        ...

    async def transact(
        self,
        fn: Callable[[Any], Coroutine[Any, Any, Any]],
        entry_for: Callable[[Any], tuple[Doc, bytes | None]],
        index: int,
        prior: Doc | None,
    ) -> Any:
        """Run ``fn(session)`` and record ``entry_for(its result)`` at ``index`` in one
        transaction; returns the result."""
        ...

    # -- issue 61 -------------------------------------------------------------------------------

    async def record_named(self, entry: Doc, prior: Doc | None) -> None:
        """Write a parallel step's ``entry`` by its name (``ctx.gather``): a new last entry if
        the journal holds no step of that name (``prior`` ``None``), else in place of
        ``prior`` (still the one the run read). ``LeaseLost`` as ``record``."""
        ...

    async def spawn(self, index: int, entry: Doc, children: list[Doc]) -> None:
        """Record the children's step ``entry`` (new, at ``index``) with the task's counter of
        them, then publish the ``children`` (``mtask.spawn.Child.to_document``), idempotently."""
        ...

    async def publish(self, step: str, children: list[Doc]) -> None:
        """Publish the children of step ``step`` again (those that exist stay as they are)."""
        ...

    async def children(self, step: str) -> list[Doc]:
        """The children spawned by step ``step``, in spawn order: ``index``, ``key``,
        ``name``, ``status``, ``result``, ``error`` (read once, when the task resumes)."""
        ...


@dataclass(frozen=True)
class _Io:
    make: Callable[[], Coroutine[Any, Any, Any]]


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    step: str | None = None
    """The step whose function this is (``_IN_STEP`` while it runs: nothing nests in it)."""
    timeout: float | None = None
    """Its policy's time limit, in seconds (``StepTimeout`` past it)."""
    said: list[Doc] | None = None
    """Where what it says (``ctx.log``, ``ctx.emit``) is held until its record is written."""


@dataclass(frozen=True)
class _Pause:
    """Wait ``seconds`` in place (a step policy's backoff between two tries)."""

    seconds: float


Plan = Generator[_Io | _Call | _Pause, Any, T]

_IN_STEP: contextvars.ContextVar[str | None] = contextvars.ContextVar("mtask_in_step", default=None)
"""The step whose function runs in this context (a thread, a task of ``ctx.gather``)."""


def encode(result: Any) -> bytes:
    try:
        return bson.encode({"v": result})
    except Exception as exc:  # noqa: BLE001 - any encoding problem is the handler's
        raise StepError(f"a step's result must be BSON: {exc}") from None


def decode(data: bytes) -> Any:
    return bson.decode(data)["v"]


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + "…"


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME or "\x00" in name:
        raise StepError(f"a step's name is a string of 1 to {MAX_STEP_NAME} characters, no NUL")
    return name


def check_signal_name(name: Any) -> str:
    """A signal's name: a step's name that does not start with ``$`` (it is a value in the
    signal's pipeline update, where ``$…`` would read a field)."""
    if not isinstance(name, str) or not name or len(name) > MAX_STEP_NAME or "\x00" in name:
        raise StepError(f"a signal's name is a string of 1 to {MAX_STEP_NAME} characters, no NUL")
    if name.startswith("$"):
        raise StepError(f"a signal's name cannot start with '$': {name!r}")
    return name


def complete_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends (a ``StepStore`` whose methods do no I/O on a loop:
    a child process's pipe, a dry replay's record) to its end, here."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise StepError("a step's I/O here cannot await")


def caller(depth: int = 2) -> Any:
    """Where in the handler a step is asked for: the code and instruction of the frame
    ``depth`` levels up (the caller of the function that calls this)."""
    frame = sys._getframe(depth)
    return (frame.f_code, frame.f_lasti)


def check_patch(patch: Any) -> str:
    if not isinstance(patch, str) or not patch or len(patch) > MAX_STEP_NAME - 6:
        raise StepError(f"a patch's id is a string of 1 to {MAX_STEP_NAME - 6} characters")
    return check_name(patch)


def _replays(prior: Doc | None) -> bool:
    """Whether a recorded entry is given back as it is (a result, a timeout, children that
    failed), rather than called, checked or awaited again."""
    if prior is None:
        return False
    state = prior.get("state")
    return state in ("done", "timed_out") or (state == "failed" and prior.get("kind") == "children")


def _to_ms(when: dt.datetime) -> dt.datetime:
    return _aware(when).replace(microsecond=when.microsecond // 1000 * 1000)


@dataclass
class Group:
    """The steps begun in one ``ctx.gather`` (``mtask.parallel``): its ``label`` (``gather#n``),
    where it begins in the journal (``start``), the entries earlier runs recorded for it (the
    ``span`` entries from ``start`` whose ``group`` is its label), by name."""

    journal: RunSteps
    label: str
    start: int
    recorded: dict[str, Doc]
    span: int
    asked: list[str] = field(default_factory=list)

    def begin(self, name: str, kind: str) -> tuple[int, Doc | None]:
        """Where step ``name`` of this group is (recorded or new) and what was recorded."""
        journal = self.journal
        inside = _IN_STEP.get()
        if inside is not None:
            raise StepError(
                f"step {name!r} was asked for while step {inside!r} runs: one step at a time "
                "in each branch of a gather (steps do not nest)"
            )
        journal._check_new(name)
        prior = self.recorded.get(name)
        if prior is not None and prior.get("kind") != kind:
            raise StepMismatch(
                f"step {name!r} of {self.label!r} is recorded as {prior.get('kind')}; this run "
                f"asked for it as {kind}"
            )
        later = [
            e for e in journal.recorded[self.start + self.span :] if e.get("group") != self.label
        ]
        if prior is None and later:
            raise StepMismatch(
                f"{self.label!r} is recorded without step {name!r} (the next recorded step is "
                f"{later[0].get('name')!r}): the steps must be asked for as recorded"
            )
        index = next(
            (i for i, e in enumerate(journal.recorded) if e.get("name") == name),
            len(journal.recorded),
        )
        journal.asked.append(name)
        self.asked.append(name)
        return index, prior


_GROUP: contextvars.ContextVar[Group | None] = contextvars.ContextVar("mtask_group", default=None)
"""The gather whose branch runs in this context (its tasks and threads copy it)."""


async def _call_async(call: _Call) -> Any:
    """A step's function called on the loop (in a thread when it has a time limit), with what
    it says held (``_Call.said``)."""
    token = _IN_STEP.set(call.step)
    try:
        with holding(call.said):
            if call.timeout is not None:
                return await _timed_async(call, call.timeout)
            value = call.fn()
            if inspect.isawaitable(value):
                value = await value
            return value
    finally:
        _IN_STEP.reset(token)


async def _timed_async(call: _Call, seconds: float) -> Any:
    """The function in a thread (an ``async def``'s coroutine on the loop), given up after
    ``seconds``: ``StepTimeout`` (a plain function's thread cannot be stopped: it is left to
    end on its own, and its result is dropped)."""
    limit = asyncio.timeout(seconds)
    try:
        async with limit:
            value = await asyncio.to_thread(call.fn)
            if inspect.isawaitable(value):
                value = await value
            return value
    except TimeoutError:
        if limit.expired():
            raise StepTimeout(f"step {call.step!r} took more than {seconds:g} s") from None
        raise


def _call_sync(call: _Call) -> Any:
    token = _IN_STEP.set(call.step)
    try:
        with holding(call.said):
            value = call.fn() if call.timeout is None else _timed_sync(call, call.timeout)
        if inspect.isawaitable(value):
            close = getattr(value, "close", None)
            if callable(close):
                close()
            raise StepError(
                "step_sync calls plain functions; await ctx.step(...) in an async def handler "
                "for a coroutine function"
            )
        return value
    finally:
        _IN_STEP.reset(token)


def _timed_sync(call: _Call, seconds: float) -> Any:
    """``_timed_async`` for a plain-def handler: the function on a thread of its own (a daemon:
    one that never ends does not hold the process)."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    context = contextvars.copy_context()

    def body() -> None:
        try:
            future.set_result(context.run(call.fn))
        except BaseException as exc:  # noqa: BLE001 - given to the waiting step
            future.set_exception(exc)

    threading.Thread(target=body, name=f"mtask-step-{call.step}", daemon=True).start()
    try:
        return future.result(seconds)
    except TimeoutError:
        if future.done():
            raise
        raise StepTimeout(f"step {call.step!r} took more than {seconds:g} s") from None


class RunSteps:
    """One run's journal (see the module's docstring). ``recorded`` is the claimed document's
    ``steps``; ``loop`` is the worker's event loop, where a thread handler's I/O runs."""

    def __init__(
        self,
        store: StepStore,
        recorded: Any,
        *,
        run_id: str,
        attempt: int,
        loop: asyncio.AbstractEventLoop | None = None,
        blocking_io: Callable[[Coroutine[Any, Any, Any]], Any] | None = None,
        release: Callable[[list[Any]], None] | None = None,
        frontier: Callable[[int, str, str, Doc | None], None] | None = None,
    ) -> None:
        self.store = store
        self.recorded: list[Doc] = [
            dict(e) for e in (recorded if isinstance(recorded, list) else []) if isinstance(e, dict)
        ]
        self.run_id = run_id
        self.attempt = attempt
        self.loop = loop
        self.blocking_io = blocking_io
        """How a plain-def handler's I/O runs (default: on ``loop``, waited for)."""
        self.asked: list[str] = []
        self.inside: str | None = None
        """The step whose function is running (another is refused meanwhile)."""
        self.waits: dict[str, int] = {}
        self.untils: dict[str, int] = {}
        self.sleeps = 0
        self.spilled = False
        """Whether this run stored a result aside (its task's retention seals it)."""
        self.inline = sum(len(encode(e["result"])) for e in self.recorded if "result" in e)
        """The bytes of the inline results recorded so far."""
        # -- issue 61 --
        self.release = release
        """Where what a step's function said goes once its record is written (the run's
        ``RunOutput.release``); ``None``: it is not held."""
        self.frontier = frontier
        """Called with each step asked for that the journal does not replay (``mtask.preflight``
        stops its dry replay there); ``None``: nothing."""
        self.sites: dict[str, Any] = {}
        """Where in the handler each name was first asked for: asked again from there (a
        loop), it is numbered (``fetch#2``)."""
        self.repeats: dict[str, int] = {}
        self.values: dict[str, int] = {}
        self.groups = 0
        self.spawns = 0
        self.pending: list[tuple[int, Doc]] = []
        """Entries decided without I/O (``patched``, ``now``, ``uuid``), written before the
        next step begins."""
        self.lock = threading.RLock()
        """``ctx.gather_sync`` begins steps from several threads."""

    # -- the public calls ---------------------------------------------------------------------

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        transactional: bool = False,
        policy: StepPolicy | None = None,
        **kw: Any,
    ) -> Coroutine[Any, Any, Any]:
        return self.step_at(
            caller(), name, fn, args, kw, transactional=transactional, policy=policy
        )

    async def step_at(
        self,
        site: Any,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kw: Mapping[str, Any],
        *,
        transactional: bool = False,
        policy: StepPolicy | None = None,
    ) -> Any:
        """``step``, asked for from ``site`` (``caller()``: a loop's site numbers its name)."""
        name = self.numbered(name, site)
        if transactional:
            if policy is not None:
                raise StepError("a transactional step has no policy: its transaction retries")
            return await self._transactional(name, fn, args, dict(kw))
        plan = self._step(name, lambda: fn(*args, **kw), policy or NO_POLICY)
        return await self._run_async(self._one(plan))

    def step_sync(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        policy: StepPolicy | None = None,
        **kw: Any,
    ) -> Any:
        return self.step_sync_at(caller(), name, fn, args, kw, policy=policy)

    def step_sync_at(
        self,
        site: Any,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kw: Mapping[str, Any],
        *,
        policy: StepPolicy | None = None,
    ) -> Any:
        name = self.numbered(name, site)
        plan = self._step(name, lambda: fn(*args, **kw), policy or NO_POLICY)
        return self._run_sync(self._one(plan))

    def run_plan(self, plan: Plan[T]) -> Coroutine[Any, Any, T]:
        """Run a plan of another module (``mtask.spawn``) as one step, on the loop."""
        return self._run_async(self._one(plan))

    def run_plan_sync(self, plan: Plan[T]) -> T:
        return self._run_sync(self._one(plan))

    async def sleep(
        self, duration: float | dt.timedelta | dt.datetime, name: str | None = None
    ) -> None:
        await self._run_async(self._one(self._sleep(duration, name)))

    def sleep_sync(
        self, duration: float | dt.timedelta | dt.datetime, name: str | None = None
    ) -> None:
        self._run_sync(self._one(self._sleep(duration, name)))

    async def wait_for(
        self,
        signal: str,
        timeout: float | dt.timedelta | None = None,  # noqa: ASYNC109 - durable, server clock
        name: str | None = None,
    ) -> Any:
        return await self._run_async(self._one(self._wait_for(signal, timeout, name)))

    def wait_for_sync(
        self, signal: str, timeout: float | dt.timedelta | None = None, name: str | None = None
    ) -> Any:
        return self._run_sync(self._one(self._wait_for(signal, timeout, name)))

    async def wait_until(
        self,
        collection: str,
        predicate: Mapping[str, Any],
        timeout: float | dt.timedelta | None = None,  # noqa: ASYNC109 - durable, server clock
        name: str | None = None,
    ) -> Any:
        return await self._run_async(
            self._one(self._wait_until(collection, predicate, timeout, name))
        )

    def wait_until_sync(
        self,
        collection: str,
        predicate: Mapping[str, Any],
        timeout: float | dt.timedelta | None = None,
        name: str | None = None,
    ) -> Any:
        return self._run_sync(self._one(self._wait_until(collection, predicate, timeout, name)))

    # -- runners ------------------------------------------------------------------------------

    def _one(self, plan: Plan[T]) -> Plan[T]:
        """``plan``, after which another step may begin (one at a time: ``_begin``); the entries
        decided without I/O before it are written first (``pending``)."""
        yield from self._flush()
        asked = len(self.asked)
        try:
            value = yield from plan
        finally:
            # it began (a refused one leaves the running one be); a group's steps leave the
            # group's hold to the group
            if len(self.asked) > asked and self.group() is None:
                self.inside = None
        return value

    async def _run_async(self, plan: Plan[T]) -> T:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                need = plan.throw(error) if error is not None else plan.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                if isinstance(need, _Io):
                    value = await need.make()
                elif isinstance(need, _Pause):
                    await asyncio.sleep(need.seconds)
                else:
                    value = await _call_async(need)
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError):
                    plan.close()
                    raise
                error = exc

    def _run_sync(self, plan: Plan[T]) -> T:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                need = plan.throw(error) if error is not None else plan.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                if isinstance(need, _Io):
                    value = self._blocking(need.make())
                elif isinstance(need, _Pause):
                    time.sleep(need.seconds)
                else:
                    value = _call_sync(need)
            except BaseException as exc:  # noqa: BLE001 - given back to the plan
                error = exc

    def _blocking(self, coro: Coroutine[Any, Any, Any]) -> Any:
        if self.blocking_io is not None:
            return self.blocking_io(coro)
        if self.loop is None:
            return asyncio.run(coro)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            coro.close()
            raise StepError("in an async def handler, await ctx.step/sleep/wait_for")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # -- the journal --------------------------------------------------------------------------

    def _begin(self, name: str, kind: str, *, hold: bool = True) -> tuple[int, Doc | None]:
        """The place of the next step asked for and what is recorded there (``None``: nothing).
        ``hold``: the step runs until its plan ends (``_one``), and no other may begin
        meanwhile; a step decided at once (``patched``, ``now``) holds nothing."""
        check_name(name)
        with self.lock:
            group = self.group()
            if group is not None:
                index, prior = group.begin(name, kind)
            else:
                index, prior = self._begin_alone(name, kind, hold)
        if self.frontier is not None and not _replays(prior):
            self.frontier(index, name, kind, prior)
        return index, prior

    def _begin_alone(self, name: str, kind: str, hold: bool) -> tuple[int, Doc | None]:
        if self.inside is not None:
            raise StepError(
                f"step {name!r} was asked for while step {self.inside!r} runs: one step at a "
                "time (steps do not nest or run concurrently; their order is the record's)"
            )
        self._check_new(name)
        index = len(self.asked)
        prior = self.recorded[index] if index < len(self.recorded) else None
        if prior is not None and (prior.get("name") != name or prior.get("kind") != kind):
            raise StepMismatch(
                f"step {index + 1} is recorded as {prior.get('name')!r} ({prior.get('kind')}); "
                f"this run asked for {name!r} ({kind}) there: the steps must be asked for in "
                "the recorded order"
            )
        self.asked.append(name)
        if hold:
            self.inside = name  # until its plan ends (``_one``)
        return index, prior

    def _check_new(self, name: str) -> None:
        if name in self.asked:
            raise StepError(f"step {name!r} was asked for twice: step names are unique in a task")
        if len(self.asked) >= MAX_STEPS:
            raise StepError(f"a task records at most {MAX_STEPS} steps")

    def _entry(self, name: str, kind: str, prior: Doc | None, now: dt.datetime) -> Doc:
        entry: Doc = {
            "name": name,
            "kind": kind,
            "attempts": int((prior or {}).get("attempts") or 0),
            "run_id": self.run_id,
            "attempt": self.attempt,
            "started_at": (prior or {}).get("started_at") or now,
        }
        for kept in ("until", "signal", "nth", "collection", "tries"):
            if prior is not None and kept in prior:
                entry[kept] = prior[kept]
        group = self.group()
        if group is not None:
            entry["group"] = group.label
        return entry

    # -- issue 61: loops, parallel groups, values decided once ---------------------------------

    def numbered(self, name: str, site: Any) -> str:
        """``name``, or ``name#2``, ``name#3``, … when it is asked for again from the same place
        in the handler (a loop, or a helper called in one). Asked for again from another place,
        it stays ``name``, which ``_begin`` refuses: two different steps that share a name."""
        if site is None or not isinstance(name, str):
            return name
        with self.lock:
            first = self.sites.get(name)
            if first is None:
                self.sites[name], self.repeats[name] = site, 1
                return name
            if first != site:
                return name
            n = self.repeats[name] = self.repeats[name] + 1
        return f"{name}#{n}"

    def group(self) -> Group | None:
        """The ``ctx.gather`` this context's steps belong to, if any."""
        group = _GROUP.get()
        return group if group is not None and group.journal is self else None

    def open_group(self, name: str | None) -> Group:
        """A ``ctx.gather`` begins: its steps are matched by name, recorded as they end."""
        with self.lock:
            if self.inside is not None:
                raise StepError(
                    f"a gather was begun while step {self.inside!r} runs: one step (or one "
                    "gather) at a time"
                )
            self.groups += 1
            label = check_name(name) if name is not None else f"gather#{self.groups}"
            start = len(self.asked)
            span = 0
            while (
                start + span < len(self.recorded)
                and self.recorded[start + span].get("group") == label
            ):
                span += 1
            mine = {str(e.get("name")): e for e in self.recorded[start : start + span]}
            group = Group(self, label, start, mine, span)
            self.inside = label  # no step outside the group meanwhile
            return group

    def close_group(self, group: Group, completed: bool) -> None:
        """The gather ended (``completed``: every step of it returned)."""
        with self.lock:
            self.inside = None
        missing = [n for n in group.recorded if n not in group.asked]
        if completed and missing:
            raise StepMismatch(
                f"gather {group.label!r} recorded step(s) {', '.join(map(repr, missing))} that "
                "this run did not ask for: the steps must be asked for as recorded"
            )

    def _flush(self) -> Plan[None]:
        """Write the entries decided without I/O, in order (``pending``)."""
        while self.pending:
            index, entry = self.pending.pop(0)
            yield from self._write(index, entry, None)

    def value(self, prefix: str, make: Callable[[], Any]) -> Any:
        """A value decided once (``make()`` on first use), recorded as step ``prefix#n`` with
        the next write, and given back as recorded on replay."""
        with self.lock:
            n = self.values[prefix] = self.values.get(prefix, 0) + 1
        index, prior = self._begin(f"{prefix}#{n}", "value", hold=False)
        if prior is not None and prior.get("state") == "done":
            return prior.get("result")
        made = make()
        entry = self._entry(f"{prefix}#{n}", "value", prior, self.store.now())
        entry.update(state="done", result=made)
        self._tried(entry, entry["started_at"], 0)
        self.pending.append((index, entry))
        return made

    def now(self) -> dt.datetime:
        """The server's time on first use (to the millisecond, as BSON keeps it), replayed."""
        made = self.value("now", lambda: _to_ms(self.store.now()))
        return _aware(made) if isinstance(made, dt.datetime) else made

    def uuid(self) -> uuid.UUID:
        """A random UUID on first use, replayed."""
        return uuid.UUID(str(self.value("uuid", lambda: str(uuid.uuid4()))))

    def patched(self, patch: str) -> bool:
        """``True`` where the journal has not yet gone past this place (a new run, or a resumed
        one that never ran the code here): the marker ``patch:<id>`` is recorded with the next
        write; ``False`` where an earlier run recorded another step here (it ran the old code);
        the recorded answer where the marker is."""
        name = f"patch:{check_patch(patch)}"
        with self.lock:
            here = self._here(name)
            if here is not None and (here.get("name"), here.get("kind")) != (name, "patch"):
                return False
            index, prior = self._begin(name, "patch", hold=False)
        if prior is not None:
            return bool(prior.get("result"))
        entry = self._entry(name, "patch", None, self.store.now())
        entry.update(state="done", result=True)
        self._tried(entry, entry["started_at"], 0)
        self.pending.append((index, entry))
        return True

    def deprecate_patch(self, patch: str) -> None:
        """The new code only: a marker recorded here by an earlier run is passed over (taken as
        its place); none is recorded. Once no parked task took the old branch (``mtask step
        check``), the ``patched`` call is replaced by this one, and later removed."""
        name = f"patch:{check_patch(patch)}"
        with self.lock:
            here = self._here(name)
            if here is not None and (here.get("name"), here.get("kind")) == (name, "patch"):
                self._begin(name, "patch", hold=False)

    def _here(self, name: str) -> Doc | None:
        """What the journal recorded where the next step goes: in a group, the entry of this
        name, or any of the group's (it ran the old code) if none has it."""
        group = self.group()
        if group is not None:
            found = group.recorded.get(name)
            if found is None and group.span:
                return next(iter(group.recorded.values()))
            return found
        index = len(self.asked)
        return self.recorded[index] if index < len(self.recorded) else None

    def _tried(self, entry: Doc, now: dt.datetime, ms: int, error: str | None = None) -> None:
        tried: Doc = {"run_id": self.run_id, "attempt": self.attempt, "at": now, "ms": ms}
        if error is not None:
            tried["error"] = error
        tries = [t for t in entry.get("tries") or [] if isinstance(t, dict)]
        entry["tries"] = [*tries, tried][-MAX_TRIES_KEPT:]
        entry["attempts"] = int(entry.get("attempts") or 0) + 1
        entry["finished_at"] = now
        entry["ms"] = ms

    def _store_result(self, entry: Doc, result: Any) -> bytes | None:
        """Put ``result`` in ``entry`` if it is small and shallow; else return its encoding,
        to spill."""
        data = encode(result)
        if len(data) > MAX_SPILL_BYTES:
            raise StepError(f"a step's result is {len(data)} bytes; at most {MAX_SPILL_BYTES}")
        if (
            len(data) <= INLINE_BYTES
            and self.inline + len(data) <= INLINE_TOTAL_BYTES
            and storable_depth(result, len(data))  # MongoDB refuses a deeper one's record
        ):
            entry["result"] = result
            self.inline += len(data)
            return None
        return data

    def _read(self, prior: Doc) -> Plan[Any]:
        spill = prior.get("spill")
        if isinstance(spill, dict):
            data = yield _Io(lambda: self.store.load(spill))
            return decode(data)
        return prior.get("result")

    def _keep(self, index: int, entry: Doc) -> None:
        if index < len(self.recorded):
            self.recorded[index] = entry
        else:
            self.recorded.append(entry)

    def _write(self, index: int, entry: Doc, prior: Doc | None) -> Plan[None]:
        if "group" in entry:  # a parallel step: by its name, wherever it ends (``Group``)
            yield _Io(lambda: self.store.record_named(entry, prior))
            with self.lock:
                self._keep_named(entry)
            return
        yield _Io(lambda: self.store.record(index, entry, prior))
        self._keep(index, entry)

    def _keep_named(self, entry: Doc) -> None:
        for i, kept in enumerate(self.recorded):
            if kept.get("name") == entry["name"]:
                self.recorded[i] = entry
                return
        self.recorded.append(entry)

    def _step(
        self, name: str, call: Callable[[], Any], policy: StepPolicy = NO_POLICY
    ) -> Plan[Any]:
        index, prior = self._begin(name, "call")
        if prior is not None and prior.get("state") == "done":
            value = yield from self._read(prior)
            return value
        entry = self._entry(name, "call", prior, self.store.now())
        said: list[Any] | None = [] if self.release is not None else None
        try:
            result = yield from self._tries(entry, call, policy, said)
        except Exception:
            yield from self._write(index, entry, prior)
            self._said(said)
            raise
        entry.pop("error", None)
        data = self._store_result(entry, result)
        if data is not None:
            entry["spill"] = yield _Io(lambda: self.store.spill(data))
            self.spilled = True
        yield from self._write(index, entry, prior)
        self._said(said)
        return result

    def _tries(
        self, entry: Doc, call: Callable[[], Any], policy: StepPolicy, said: list[Any] | None
    ) -> Plan[Any]:
        """Call the step's function until it returns, at most ``policy.retries`` more times
        after a failure, waiting its backoff in place; each try is noted in ``entry``. The
        last failure is raised with ``entry`` marked ``failed``; a success marks it ``done``."""
        failed = 0
        while True:
            started = time.monotonic()
            try:
                result = yield _Call(call, entry["name"], policy.timeout, said)
            except Exception as exc:
                ms = round((time.monotonic() - started) * 1000)
                self._tried(entry, self.store.now(), ms, _error(exc))
                failed += 1
                if failed > policy.retries:
                    entry.update(state="failed", error=_error(exc))
                    raise
                yield _Pause(policy.delay(failed))
                continue
            ms = round((time.monotonic() - started) * 1000)
            entry["state"] = "done"
            self._tried(entry, self.store.now(), ms)
            return result

    def _said(self, said: list[Any] | None) -> None:
        """What the step's function said, now that its record is written."""
        if said and self.release is not None:
            self.release(said)

    async def _transactional(
        self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        if not inspect.iscoroutinefunction(fn):
            raise StepError(
                "a transactional step's function is an async def taking session=: its writes "
                "use the worker's AsyncClientSession (docs/transactions.md)"
            )
        await self._run_async(self._flush())
        index, prior = self._begin(name, "call")
        try:
            return await self._transact(name, fn, args, kw, index, prior)
        finally:
            self.inside = None

    async def _transact(
        self,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kw: dict[str, Any],
        index: int,
        prior: Doc | None,
    ) -> Any:
        if prior is not None and prior.get("state") == "done":
            return await self._run_async(self._read(prior))
        started, now = time.monotonic(), self.store.now()
        made: list[Doc] = []

        def entry_for(result: Any) -> tuple[Doc, bytes | None]:
            entry = self._entry(name, "call", prior, now)
            entry["state"] = "done"
            entry["transactional"] = True
            self._tried(entry, self.store.now(), round((time.monotonic() - started) * 1000))
            data = self._store_result(entry, result)
            made.append(entry)
            return entry, data

        try:
            result = await self.store.transact(
                lambda session: fn(*args, session=session, **kw), entry_for, index, prior
            )
        except Exception as exc:
            failed = self._entry(name, "call", prior, now)
            failed.update(state="failed", error=_error(exc), transactional=True)
            ms = round((time.monotonic() - started) * 1000)
            self._tried(failed, self.store.now(), ms, _error(exc))
            if not isinstance(exc, MtaskError) or isinstance(exc, StepError):
                await self.store.record(index, failed, prior)
            raise
        self._keep(index, made[-1])
        self.spilled = self.spilled or "spill" in made[-1]
        return result

    def _sleep(self, duration: float | dt.timedelta | dt.datetime, name: str | None) -> Plan[None]:
        self.sleeps += 1
        step = name if name is not None else f"sleep#{self.sleeps}"
        index, prior = self._begin(step, "sleep")
        now = self.store.now()
        if prior is not None and prior.get("state") == "done":
            return
        if prior is not None and isinstance(prior.get("until"), dt.datetime):
            until = _aware(prior["until"])
        else:
            until = _until(duration, now)
        entry = self._entry(step, "sleep", prior, now)
        if now >= until:
            entry["state"] = "done"
            entry["until"] = until
            self._tried(entry, now, 0)
            yield from self._write(index, entry, prior)
            return
        entry.update(state="waiting", until=until)
        raise Suspended(Wait(index, None if prior is not None else entry, until))

    def _recorded(self, prior: Doc | None, timed_out: SignalTimeout) -> Plan[tuple[bool, Any]]:
        """A wait an earlier run recorded as over: ``(True, its result)`` if done; ``timed_out``
        raised again if it timed out (a replay takes the same path); else ``(False, None)``."""
        if prior is not None and prior.get("state") == "done":
            value = yield from self._read(prior)
            return True, value
        if prior is not None and prior.get("state") == "timed_out":
            raise timed_out
        return False, None

    def _wait_for(
        self, signal: str, timeout: float | dt.timedelta | None, name: str | None
    ) -> Plan[Any]:
        check_signal_name(signal)
        nth = self.waits.get(signal, 0)
        self.waits[signal] = nth + 1
        step = name if name is not None else (f"wait:{signal}" + (f"#{nth + 1}" if nth else ""))
        index, prior = self._begin(step, "signal")
        timed_out = SignalTimeout(f"no signal {signal!r} came before the timeout (recorded)")
        over, value = yield from self._recorded(prior, timed_out)
        if over:
            return value
        now = self.store.now()
        entry = self._entry(step, "signal", prior, now)
        entry.update(signal=signal, nth=nth)
        came = yield _Io(lambda: self.store.signals(signal))
        if len(came) > nth:
            payload = came[nth].get("payload")
            entry["state"] = "done"
            self._tried(entry, now, 0)
            data = self._store_result(entry, payload)
            if data is not None:
                entry["spill"] = yield _Io(lambda: self.store.spill(data))
                self.spilled = True
            yield from self._write(index, entry, prior)
            return payload
        until = _deadline(prior, timeout, now)
        if now >= until:
            entry.update(state="timed_out", until=until)
            self._tried(entry, now, 0, "timed out")
            yield from self._write(index, entry, prior)
            raise SignalTimeout(f"no signal {signal!r} came before {until.isoformat()}")
        entry.update(state="waiting", until=until)
        raise Suspended(Wait(index, None if prior is not None else entry, until, signal, nth))

    def _wait_until(
        self,
        collection: str,
        predicate: Mapping[str, Any],
        timeout: float | dt.timedelta | None,
        name: str | None,
    ) -> Plan[Any]:
        try:
            check_collection(collection)
        except MtaskError as exc:
            raise StepError(f"wait_until: {exc}") from None
        filt: Doc = dict(predicate)
        data: Doc = {"collection": collection, "ids": wait_ids(predicate), "filter": filt}
        nth = self.untils.get(collection, 0)
        self.untils[collection] = nth + 1
        step = name if name is not None else f"until:{collection}" + (f"#{nth + 1}" if nth else "")
        index, prior = self._begin(step, "data")
        timed_out = ConditionTimeout(f"{collection} did not reach the state in time (recorded)")
        over, value = yield from self._recorded(prior, timed_out)
        if over:
            return value
        now = self.store.now()
        entry = self._entry(step, "data", prior, now)
        entry["collection"] = collection
        until = _deadline(prior, timeout, now)
        wait = Wait(index, None if prior is not None else entry, until, data=data)
        found = yield _Io(lambda: self.store.holds(collection, filt, None))
        if found is None and now < until:  # announced, then looked at again: no change is lost
            announce = wait.to_document()
            found = yield _Io(lambda: self.store.holds(collection, filt, announce))
        value = yield from self._settled(wait, entry, prior, now, found)
        return value

    def _settled(
        self, wait: Wait, entry: Doc, prior: Doc | None, now: dt.datetime, found: Doc | None
    ) -> Plan[Any]:
        """A data wait after its look: done with the document found, timed out, or waiting."""
        collection = entry["collection"]
        if found is not None:
            entry["state"] = "done"
            self._tried(entry, now, 0)
            stored = self._store_result(entry, found)
            if stored is not None:
                entry["spill"] = yield _Io(lambda: self.store.spill(stored))
                self.spilled = True
            yield from self._write(wait.index, entry, prior)
            return found
        if now >= wait.until:
            entry.update(state="timed_out", until=wait.until)
            self._tried(entry, now, 0, "timed out")
            yield from self._write(wait.index, entry, prior)
            raise ConditionTimeout(
                f"{collection} did not reach the state by {wait.until.isoformat()}"
            )
        entry.update(state="waiting", until=wait.until)
        raise Suspended(wait)


def _deadline(
    prior: Doc | None, timeout: float | dt.timedelta | None, now: dt.datetime
) -> dt.datetime:
    """A wait's deadline: the one an earlier run recorded, else ``timeout`` from ``now`` (the
    server's clock), else ``NEVER``."""
    if prior is not None and isinstance(prior.get("until"), dt.datetime):
        return _aware(prior["until"])
    return NEVER if timeout is None else _until(timeout, now)


def _aware(when: dt.datetime) -> dt.datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def _until(duration: float | dt.timedelta | dt.datetime, now: dt.datetime) -> dt.datetime:
    if isinstance(duration, dt.datetime):
        if duration.tzinfo is None:
            raise StepError("a time to sleep until must be timezone-aware")
        return duration
    seconds = duration.total_seconds() if isinstance(duration, dt.timedelta) else duration
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise StepError("a duration is a number of seconds (or a timedelta), not negative")
    if seconds > 366 * 86400 * 100:
        raise StepError("a duration of at most 100 years")
    return now + dt.timedelta(seconds=seconds)


class MemorySteps:
    """A ``StepStore`` in memory, for ``mtask.testing`` and the unit tier: records in a list,
    signals given by the test, time from ``clock`` (default: the local clock)."""

    def __init__(
        self,
        recorded: list[Doc] | None = None,
        signals: list[Doc] | None = None,
        clock: Callable[[], dt.datetime] | None = None,
        find: Callable[[str, Doc], Doc | None] | None = None,
    ) -> None:
        self.recorded: list[Doc] = recorded if recorded is not None else []
        self.sent: list[Doc] = signals if signals is not None else []
        self.spilled: dict[str, bytes] = {}
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))
        self.find = find
        """What ``wait_until`` finds: ``find(collection, predicate)``, the test's answer (a
        document or ``None``); without it a ``wait_until`` is a ``StepError``."""
        self.announced: list[Doc] = []
        """The waits announced (``holds`` with ``waiting``), oldest first."""
        self.tasks: dict[str, Doc] = {}
        """The children spawned (issue 61), by key: ``finish`` ends one, as its worker would."""

    def now(self) -> dt.datetime:
        return self.clock()

    def signal(self, name: str, payload: Any = None) -> None:
        self.sent.append({"name": name, "payload": payload, "at": self.now()})

    async def record(self, index: int, entry: Doc, prior: Doc | None) -> None:
        if index < len(self.recorded):
            self.recorded[index] = dict(entry)
        elif index == len(self.recorded):
            self.recorded.append(dict(entry))
        else:
            raise StepError(f"step {index} recorded after {len(self.recorded)} steps")

    async def spill(self, data: bytes) -> Doc:
        ref = f"spill-{len(self.spilled) + 1}"
        self.spilled[ref] = data
        return {"id": ref, "chunks": 1, "bytes": len(data)}

    async def load(self, spill: Mapping[str, Any]) -> bytes:
        return self.spilled[str(spill["id"])]

    async def signals(self, name: str) -> list[Doc]:
        return [s for s in self.sent if s.get("name") == name]

    async def holds(self, collection: str, predicate: Doc, waiting: Doc | None) -> Doc | None:
        if self.find is None:
            raise StepError("MemorySteps(find=...) answers wait_until: say what it finds")
        if waiting is not None:
            self.announced.append(dict(waiting))
        return self.find(collection, dict(predicate))

    async def record_named(self, entry: Doc, prior: Doc | None) -> None:
        for i, kept in enumerate(self.recorded):
            if kept.get("name") == entry["name"]:
                if prior is None:
                    raise StepError(f"step {entry['name']!r} was recorded meanwhile")
                self.recorded[i] = dict(entry)
                return
        self.recorded.append(dict(entry))

    async def spawn(self, index: int, entry: Doc, children: list[Doc]) -> None:
        await self.record(index, entry, None)
        await self.publish(str(entry["name"]), children)

    async def publish(self, step: str, children: list[Doc]) -> None:
        for child in children:
            self.tasks.setdefault(
                child["key"], {**child, "step": step, "status": "pending", "result": None}
            )

    async def children(self, step: str) -> list[Doc]:
        found = [dict(c) for c in self.tasks.values() if c.get("step") == step]
        return sorted(found, key=lambda c: int(c["index"]))

    def finish(
        self, key: str, result: Any = None, *, status: str = "succeeded", error: str = ""
    ) -> None:
        """End child ``key`` with ``result`` (or ``status`` ``failed`` and its ``error``)."""
        self.tasks[key].update(status=status, result=result, error=error or None)

    async def transact(
        self,
        fn: Callable[[Any], Coroutine[Any, Any, Any]],
        entry_for: Callable[[Any], tuple[Doc, bytes | None]],
        index: int,
        prior: Doc | None,
    ) -> Any:
        result = await fn(None)
        entry, data = entry_for(result)
        if data is not None:
            entry["spill"] = await self.spill(data)
        await self.record(index, entry, prior)
        return result
