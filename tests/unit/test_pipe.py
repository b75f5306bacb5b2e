"""The process pool's pipe (``mtask.worker.running.pool.pipe``), without a child: each message
crosses as the bare tuple the pipe always carried and comes back as itself; a reply means what
it says; what a child must not send is refused or failed; and a message's kind is spelled in
``pipe.py`` alone."""

from __future__ import annotations

import ast
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import mtask
from mtask import Fail, Retry
from mtask.errors import InvalidParams, LeaseLost
from mtask.follow.output import Batch
from mtask.steps import StepError, Suspended, Wait
from mtask.worker.running.pool import pipe
from mtask.worker.running.pool.errors import HandlerError, ReplyRefused
from mtask.worker.running.pool.pipe import (
    Output,
    Reply,
    ReplyKind,
    StepAnswer,
    StepAsk,
    StepOp,
    Stopped,
    Tag,
)

PACKAGE = Path(mtask.__file__).parent
POOL = PACKAGE / "worker" / "running" / "pool"
SPELLINGS = {m.value for kinds in (Tag, ReplyKind, StepOp) for m in kinds}

values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
rss = st.integers(0, 2**40)


# -- the kinds, in pipe.py alone ------------------------------------------------------------------


def spelled(path: Path) -> set[str]:
    """The pipe's kinds a module spells as a string literal (a docstring is not one)."""
    tree = ast.parse(path.read_text())
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    } & SPELLINGS


def talks_to_the_pool(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("mtask.worker.running.pool")
        for node in ast.walk(tree)
    )


def test_a_messages_kind_is_spelled_in_pipe_py_only() -> None:
    """Every module of the pool, and every module of the package that imports from it, names
    the kinds through ``pipe``'s enums: a bare ``"ok"`` or ``"out"`` there is a message
    built or read beside the pipe."""
    pipe_py = POOL / "pipe.py"
    assert spelled(pipe_py) == SPELLINGS  # the check sees them where they are
    clients = {p for p in PACKAGE.rglob("*.py") if talks_to_the_pool(p) and POOL not in p.parents}
    assert PACKAGE / "worker" / "running" / "invoke.py" in clients  # it finds the pool's clients
    others = set(POOL.glob("*.py")) - {pipe_py} | clients
    found = {str(p.relative_to(PACKAGE)): spelled(p) for p in sorted(others)}
    assert {name: kinds for name, kinds in found.items() if kinds} == {}


# -- the wire -------------------------------------------------------------------------------------


@given(value=values, rss=rss, delay=st.none() | st.floats(0, 1e6))
def test_replies_cross_as_the_tuples_the_pipe_carried_and_come_back_as_themselves(
    value: Any, rss: int, delay: float | None
) -> None:
    for kind in ReplyKind:
        reply = Reply(kind, value, delay if kind is ReplyKind.RETRY else None, rss)
        if kind is ReplyKind.RETRY:
            wire: tuple[Any, ...] = ("retry", rss, value, delay)
        else:
            wire = (kind.value, rss, value)
        assert bytes(pipe.frame(reply)) == bytes(pipe.ForkingPickler.dumps(wire))
        assert pipe.decode(pipe.ForkingPickler.loads(pipe.frame(reply))) == reply


@given(op=st.sampled_from(StepOp), args=st.lists(values, max_size=3), rss=rss)
def test_output_step_requests_and_stops_cross_as_their_tuples(
    op: StepOp, args: list[Any], rss: int
) -> None:
    batch = Batch({"fraction": 0.5}, {"lines": len(args)}, [{"data": a} for a in args])
    ask = StepAsk(op, tuple(args))
    assert Output(batch).encode() == ("out", batch)
    assert ask.encode() == ("step", op.value, tuple(args))
    assert Stopped(rss).encode() == ("lease", rss)
    for message in (Output(batch), ask, Stopped(rss)):
        assert pipe.decode(message.encode()) == message
    # a step's arguments that pickle refuses cross as BSON gives them back: a list
    assert pipe.decode(("step", op.value, list(args))) == ask


@given(value=values)
def test_a_step_answer_is_a_value_or_an_exception_raised_as_itself(value: Any) -> None:
    assert StepAnswer(value).encode() == ("ok", value)
    assert StepAnswer.decode(StepAnswer(value).encode()).result() == value
    lost = LeaseLost("gone")
    assert StepAnswer(error=lost).encode() == ("error", lost)
    with pytest.raises(LeaseLost, match="gone"):
        StepAnswer.decode(("error", lost)).result()


def test_calls_and_retirement_reach_the_child_through_a_real_pipe(
    pipe_ends: tuple[Any, Any],
) -> None:
    worker, child = pipe_ends
    info = pipe.RunInfo("k", "n", 1, "run-1", "w-1")
    call = pipe.Call(_handler, {"a": 1}, info)  # type: ignore[arg-type]
    pipe.send(worker, call)
    assert pipe.next_call(child) == call
    pipe.send(worker, pipe.Retire())
    assert pipe.next_call(child) is None  # retired
    worker.close()
    assert pipe.next_call(child) is None  # the worker is gone


def _handler(params: dict[str, Any]) -> None:
    return None


# -- what a reply means ---------------------------------------------------------------------------

WAIT = Wait(0, {"name": "nap"}, dt.datetime(2026, 11, 28, tzinfo=dt.UTC))


@pytest.mark.parametrize(
    ("reply", "raised", "match"),
    [
        (Reply(ReplyKind.RETRY, "later", 2.5), Retry, "^later$"),
        (Reply(ReplyKind.FAIL, "no"), Fail, "^no$"),
        (Reply(ReplyKind.INVALID, "bad params"), InvalidParams, "^bad params$"),
        (Reply(ReplyKind.REFUSED, "too large"), ReplyRefused, "^too large$"),
        (Reply(ReplyKind.SUSPENDED, WAIT), Suspended, "^waiting until 2026-11-28"),
        (Reply(ReplyKind.RAISE, StepError("misused")), StepError, "^misused$"),
        (Reply(ReplyKind.ERROR, ("Traceback: boom", "a.B")), HandlerError, "^Traceback: boom$"),
        (Reply(ReplyKind.MEMORY, ("MemoryError", "builtins.MemoryError")), HandlerError, "^Memory"),
    ],
)
def test_a_reply_raises_what_its_run_ended_with(
    reply: Reply, raised: type[BaseException], match: str
) -> None:
    with pytest.raises(raised, match=match) as caught:
        reply.result()
    if isinstance(caught.value, Retry):
        assert caught.value.delay == 2.5
    if isinstance(caught.value, Suspended):
        assert caught.value.wait == WAIT
    if isinstance(caught.value, HandlerError):  # the class the handler raised, for its run
        assert caught.value.error_class == reply.value[1]


def test_every_kind_but_ok_raises_and_ok_returns() -> None:
    assert Reply(ReplyKind.OK, {"a": 1}).result() == {"a": 1}
    for kind in set(ReplyKind) - {ReplyKind.OK}:
        with pytest.raises(BaseException):  # noqa: B017 - which one: the test above
            Reply(kind, "x").result()


# -- what the worker does not read ----------------------------------------------------------------


def _exit_when_loaded() -> None:
    raise SystemExit("unpickled")


class _ExitsWhenLoaded:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_exit_when_loaded, ())


def test_a_message_past_the_bound_is_refused_unread(pipe_ends: tuple[Any, Any]) -> None:
    worker, child = pipe_ends
    child.send(Output(Batch(None, None, [{"data": "x" * 1000}])).encode())
    with pytest.raises(
        ReplyRefused, match="^the handler's process sent a message of more than 100 "
    ):
        pipe.receive(worker, 100)


def test_what_cannot_be_unpickled_or_is_unknown_is_the_runs_handler_error(
    pipe_ends: tuple[Any, Any],
) -> None:
    worker, child = pipe_ends
    assert pipe.receive(worker, 1000) is None  # nothing to read
    child.send(("ok", 1, _ExitsWhenLoaded()))
    with pytest.raises(HandlerError, match="SystemExit: unpickled"):
        pipe.receive(worker, 1000)
    for unknown, said in [
        (("gossip", 1), "'gossip' with 1 items"),
        (("out",), "'out' with 0 items"),
        (("step", "teleport", ()), "'step' with 2 items"),
        (None, "NoneType"),
        ({"kind": "ok"}, "dict"),
    ]:
        child.send(unknown)
        with pytest.raises(HandlerError, match=f"does not know: {said}$"):
            pipe.receive(worker, 1000)
    child.close()
    assert pipe.receive(worker, 1000) is None  # it died with nothing more to say
