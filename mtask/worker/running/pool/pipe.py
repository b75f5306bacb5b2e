"""The pipe between the worker and a child of the process pool: every message either side sends,
named and typed, encoded and decoded here and nowhere else (as ``finding/shared/wire.py`` is for
the relay's wire; CPython's ``concurrent/futures/process.py`` names its ``_CallItem`` and
``_ResultItem`` so). A message's kind is spelled in this module only
(``tests/unit/test_pipe.py`` keeps it so).

One run, the worker on the left (``pool.py``, ``exchange.py``), its child on the right
(``child.py``, ``child_steps.py``)::

    ProcessPool.run ─── Call(handler, params, info) ─────▶ child_main calls the handler
    exchange.reply  ◀── Output(batch) ──────────────────── _ChildOutput: every 0.1 s, and
                                                             once more before the reply
    exchange.reply  ◀── StepAsk(op, args) ──────────────── ChildSteps.ask, which blocks
      (on_step)     ─── StepAnswer(value, error) ────────▶   until it is answered
    ProcessPool     ◀── Reply(kind, value, delay, rss) ─── child_main: one per Call
      or            ◀── Stopped(rss) ───────────────────── the lease watch; then it dies
    ProcessPool     ─── Retire() ────────────────────────▶ child_main returns

Output and step requests come in any order before the reply and none after it; the child sends
each whole, under its run's lock (``child._Run``). Nothing else crosses the pipe: the soft limit
(``ctx.cancelled``) and the lease's deadline are in shared memory, and the worker's death is
seen on an "alive" pipe that carries nothing.

On the wire (``Connection.send``, pickled by ``ForkingPickler``) each message is a bare tuple,
its kind first (a ``Call`` is known by where it comes, a ``Retire`` is ``None``)::

    Call        (handler, params, info)       Retire    None
    Output      ("out", batch)                StepAsk   ("step", op, args)
    StepAnswer  ("ok", value) or ("error", exception)
    Reply       (kind, rss, value), ("retry", rss, what it said, delay)
    Stopped     ("lease", rss)

Tuples, and not the named messages themselves: a NamedTuple pickles as a reference to its class
beside its fields (this module's path and the class's name, and the enum's for a kind): a
no-op's ``Reply`` would be 92 bytes against 25 as a tuple, an ``Output`` 40 bytes more, and
each would unpickle through a lookup of its classes (2.6 µs against 0.2 µs for that reply), for
nothing the kind does not say already. The names cost a tuple built on each side
(``decode``: 0.25 µs).

What a child sends is bounded (``Bounds``): the worker reads a message whole before it can
refuse it, into the memory its other runs use.
"""

from __future__ import annotations

import multiprocessing.connection
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from multiprocessing.reduction import ForkingPickler
from typing import Any, NamedTuple, Protocol

from mtask.errors import InvalidParams
from mtask.follow.output import Batch
from mtask.registry import Fail, Handler, Retry
from mtask.steps import MAX_SPILL_BYTES, Suspended
from mtask.worker.running.failures import short_traceback
from mtask.worker.running.pool.errors import HandlerError, ReplyRefused

Connection = multiprocessing.connection.Connection

MESSAGE_SLACK = 64 * 1024
"""Room in a message beyond the value it carries (its kind, the resident bytes, pickle's
framing)."""


@dataclass(frozen=True)
class Bounds:
    """The most a child sends the worker at once, pickled (the worker reads it whole before it
    can refuse it: its memory is its other runs'). ``result``: the worker's
    ``max_result_bytes``, the BSON size past which a result is not stored; ``message``: what
    the worker reads of any one message (a reply, an output batch, a step's request: a spilled
    result is ``MAX_SPILL_BYTES``); a longer one ends the run, and its child."""

    result: int
    message: int

    @classmethod
    def of(cls, max_result_bytes: int) -> Bounds:
        """The bounds for a worker that stores results of up to ``max_result_bytes``."""
        return cls(max_result_bytes, max(MAX_SPILL_BYTES, 2 * max_result_bytes) + MESSAGE_SLACK)

    @property
    def reply(self) -> int:
        """A result's reply: twice the result's BSON limit (pickle takes less room than BSON
        for most values); past it the child checks the result as the worker would and sends
        why it is not stored instead (or, if it is, what BSON gives back of it)."""
        return min(2 * self.result + MESSAGE_SLACK, self.message)


@dataclass(frozen=True)
class RunInfo:
    """What a child needs to build the handler's ``TaskContext``."""

    key: str
    name: str
    attempt: int
    run_id: str
    worker_id: str
    trace: dict[str, str] | None = None
    """The run span's W3C context (``mtask.tracing.current_context``): the child's spans, its
    steps' and the handler's own, are its children. ``None`` without a tracer provider."""


# -- the kinds ------------------------------------------------------------------------------------


class Tag(StrEnum):
    """The kind of a message that is not a ``Reply``, as the first item of its tuple."""

    OUTPUT = "out"
    STEP_ASK = "step"
    ANSWER = "ok"
    ANSWER_ERROR = "error"
    STOPPED = "lease"


class ReplyKind(StrEnum):
    """How a run ended, as its child replies it; ``value`` in brackets."""

    OK = "ok"  # (the result)
    RETRY = "retry"  # (what the Retry said), and its delay
    FAIL = "fail"  # (what the Fail said), or why a result cannot be stored
    INVALID = "invalid"  # (why the params do not validate)
    REFUSED = "refused"  # (why the reply is past its bounds): ReplyRefused
    SUSPENDED = "suspended"  # (the Wait): the run ends WAITING
    RAISE = "raise"  # (a StepError, SignalTimeout or Snooze): raised as itself
    ERROR = "error"  # (the traceback of what the handler raised, sys.exit() too)
    MEMORY = "memory"  # (a MemoryError's traceback); the child exits after it


class StepOp(StrEnum):
    """What a ``StepAsk`` asks of the run's ``StepStore`` (``child_steps.ParentSteps``)."""

    JOURNAL = "journal"  # the steps the claimed document recorded: the first ask
    NOW = "now"
    RECORD = "record"
    SPILL = "spill"
    LOAD = "load"
    SIGNALS = "signals"
    HOLDS = "holds"  # whether a wait on data holds already (ctx.wait_until)
    # parallel steps and children
    RECORD_NAMED = "record_named"
    SPAWN = "spawn_children"
    PUBLISH = "publish"
    CHILDREN = "children"
    # usage (docs/usage.md): the run's usage is the worker's
    USAGE = "usage"  # ctx.record_usage: (model, counts, replaying), answered with the Usage
    GATE = "gate"  # before a step: its budgets and windows of tokens (RunUsage.check)


# -- the messages ---------------------------------------------------------------------------------


class Call(NamedTuple):
    """Worker to child: call ``handler`` (sent by reference: a module-level function) with
    ``params`` (parsed in the child) for the run ``info`` names."""

    handler: Handler
    params: dict[str, Any]
    info: RunInfo

    def encode(self) -> tuple[Any, ...]:
        return (self.handler, self.params, self.info)


class Retire(NamedTuple):
    """Worker to an idle child: exit (it is recycled)."""

    def encode(self) -> None:
        return None


class Output(NamedTuple):
    """Child to worker: what its handler said since the last batch (``ctx.progress``/``log``/
    ``emit``), merged into the run's own ``RunOutput``."""

    batch: Batch

    def encode(self) -> tuple[Any, ...]:
        return (Tag.OUTPUT.value, self.batch)


class StepAsk(NamedTuple):
    """Child to worker: one request of its run's durable steps; the child waits for the
    ``StepAnswer``."""

    op: StepOp
    args: tuple[Any, ...]

    def encode(self) -> tuple[Any, ...]:
        return (Tag.STEP_ASK.value, self.op.value, self.args)


class StepAnswer(NamedTuple):
    """Worker to child: the answer to its ``StepAsk``, a value or the exception to raise there
    as itself (``LeaseLost``, ``StepError``, a ``StorageError``)."""

    value: Any = None
    error: BaseException | None = None

    def encode(self) -> tuple[Any, ...]:
        if self.error is None:
            return (Tag.ANSWER.value, self.value)
        return (Tag.ANSWER_ERROR.value, self.error)

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    @classmethod
    def decode(cls, message: tuple[Any, ...]) -> StepAnswer:
        tag, value = message
        return cls(error=value) if tag == Tag.ANSWER_ERROR else cls(value)


class Reply(NamedTuple):
    """Child to worker: how its run ended (``kind``), with what (``value``, and a ``Retry``'s
    ``delay``), and the child's resident bytes as it replied (``rss``: set as it is framed)."""

    kind: ReplyKind
    value: Any = None
    delay: float | None = None
    rss: int = 0

    def encode(self) -> tuple[Any, ...]:
        if self.kind is ReplyKind.RETRY:
            return (self.kind.value, self.rss, self.value, self.delay)
        return (self.kind.value, self.rss, self.value)

    def result(self) -> Any:
        """The run's result, or raise what it ended with: ``Retry``, ``Fail``,
        ``InvalidParams``, ``ReplyRefused``, ``Suspended``, a ``StepError`` or
        ``SignalTimeout``, ``HandlerError``."""
        if self.kind is ReplyKind.OK:
            return self.value
        raise _RAISED[self.kind](self)


_RAISED: dict[ReplyKind, Callable[[Reply], BaseException]] = {
    ReplyKind.RETRY: lambda r: Retry(r.value, delay=r.delay),
    ReplyKind.FAIL: lambda r: Fail(r.value),
    ReplyKind.INVALID: lambda r: InvalidParams(r.value),
    ReplyKind.REFUSED: lambda r: ReplyRefused(r.value),
    ReplyKind.SUSPENDED: lambda r: Suspended(r.value),
    ReplyKind.RAISE: lambda r: r.value,
    ReplyKind.ERROR: lambda r: HandlerError(*r.value),  # (traceback, class path)
    ReplyKind.MEMORY: lambda r: HandlerError(*r.value),
}


class Stopped(NamedTuple):
    """Child to worker, instead of a reply: its lease watch stopped the run at the lease's
    deadline, with no renewal from the worker, and is killing the child."""

    rss: int

    def encode(self) -> tuple[Any, ...]:
        return (Tag.STOPPED.value, self.rss)


FromChild = Output | StepAsk | Reply | Stopped


# -- sending and receiving ------------------------------------------------------------------------


class Message(Protocol):
    def encode(self) -> object: ...


def send(conn: Connection, message: Message) -> None:
    """Send ``message``, pickled whole before a byte is written (one that pickle refuses raises
    here, and the pipe is as it was)."""
    conn.send(message.encode())


def frame(reply: Reply) -> memoryview:
    """``reply`` pickled once, as ``send`` would: the child weighs it against its bounds
    before it sends it (``Connection.send_bytes``)."""
    return ForkingPickler.dumps(reply.encode())


def next_call(conn: Connection) -> Call | None:
    """In the child: the next run to call; ``None`` once it is retired or the worker is
    gone."""
    try:
        message = conn.recv()
    except (EOFError, OSError):
        return None
    return None if message is None else Call(*message)


def answer(conn: Connection) -> StepAnswer:
    """In the child: the answer to the ``StepAsk`` it sent (``EOFError``/``OSError`` if the
    worker is gone)."""
    return StepAnswer.decode(conn.recv())


def receive(conn: Connection, bound: int) -> FromChild | None:
    """In the worker: the next message from a child whose pipe or sentinel is ready; ``None``
    if it died with nothing more to say. A message longer than ``bound`` is not read
    (``ReplyRefused``; the run kills the child); one that cannot be unpickled here, whatever it
    raises (a ``SystemExit``, a ``CancelledError``), or that the pipe does not know, is the
    run's ``HandlerError``."""
    if not conn.poll():
        return None
    try:
        data = conn.recv_bytes(bound)
    except EOFError:
        return None
    except OSError:
        if conn.readable:
            return None  # a read error: it died mid-message
        raise ReplyRefused(  # too long: its length was read, not the rest
            f"the handler's process sent a message of more than {bound} bytes; it was killed"
        ) from None
    try:
        message = ForkingPickler.loads(data)
    except BaseException as exc:  # noqa: BLE001 - raised by what the child sent, not here
        raise HandlerError(short_traceback(exc)) from None
    return decode(message)


def decode(message: Any) -> FromChild:
    """A child's message from the tuple it came as; ``HandlerError`` for one the pipe does not
    know (never sent by mtask's child)."""
    try:
        return _DECODE[message[0]](message)
    except (LookupError, TypeError, ValueError):
        raise HandlerError(
            f"the handler's process sent a message the worker does not know: {_shape(message)}"
        ) from None


def _shape(message: Any) -> str:
    if isinstance(message, tuple) and message and isinstance(message[0], str):
        return f"{message[0]!r} with {len(message) - 1} items"
    return type(message).__name__


def _replied(kind: ReplyKind) -> Callable[[tuple[Any, ...]], Reply]:
    if kind is ReplyKind.RETRY:
        return lambda m: Reply(kind, m[2], m[3], m[1])
    return lambda m: Reply(kind, m[2], None, m[1])  # positional: twice as fast as by keyword


_DECODE: dict[str, Callable[[tuple[Any, ...]], FromChild]] = {
    Tag.OUTPUT.value: lambda m: Output(m[1]),
    Tag.STEP_ASK.value: lambda m: StepAsk(StepOp(m[1]), tuple(m[2])),  # a list, if BSON made it
    Tag.STOPPED.value: lambda m: Stopped(m[1]),
    **{kind.value: _replied(kind) for kind in ReplyKind},
}
