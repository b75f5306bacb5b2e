"""The preflight's dry replay without MongoDB (``mtask.steps.preflight``): a journal the new handler
asks for as recorded replays cleanly up to where it ends (no step function is called), a
changed one mismatches at the step it names, params the new handler refuses are an error; the
sandbox's audit hook refuses I/O (``mtask.steps.sandbox.Guard``); hypothesis: whatever a
journal holds, a dry replay ends in a verdict, never an exception."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from mtask.registry import Registry, TaskContext
from mtask.steps import StepMismatch
from mtask.steps.preflight import ForbiddenIo, Report, Verdict, judge, replay, replay_now
from mtask.steps.sandbox import Guard

NOW = dt.datetime(2026, 11, 28, 3, 0, tzinfo=dt.UTC)
called: list[str] = []
registry = Registry()


class Order(BaseModel):
    order: str


@registry.task("ship")
async def ship(params: Order, ctx: TaskContext) -> str:
    await ctx.step("charge", called.append, "charge")
    if ctx.patched("v2"):
        await ctx.step("ship", called.append, "ship")
    await ctx.wait_for("go")
    return "done"


@registry.task("plain")
def plain(params: dict[str, Any], ctx: TaskContext) -> int:
    ctx.step_sync("one", called.append, "one")
    ctx.sleep_sync(60)
    return 1


def entry(name: str, kind: str = "call", state: str = "done", **more: Any) -> dict[str, Any]:
    return {"name": name, "kind": kind, "state": state, "attempts": 1, **more}


def doc(name: str, steps: list[Any], params: Any = None) -> dict[str, Any]:
    return {"_id": "k", "name": name, "params": {"order": "7"} if params is None else params,
            "steps": steps, "attempts": 1, "updated_at": NOW}  # fmt: skip


def verdict(d: dict[str, Any]) -> Verdict:
    loop = asyncio.new_event_loop()
    try:
        return replay_now(registry, d, loop) or loop.run_until_complete(replay(registry, d))
    finally:
        loop.close()


def test_a_dry_replay_stops_where_the_journal_ends_and_calls_nothing() -> None:
    called.clear()
    old = doc("ship", [entry("charge"), entry("wait:go", "signal", "waiting", signal="go")])
    assert verdict(old).outcome == "clean"  # the old branch: patched() is False there
    new = doc("ship", [entry("charge"), entry("patch:v2", "patch", result=True)])
    found = verdict(new)
    assert (found.outcome, found.detail) == ("clean", "step 3 (ship)")  # where it would call
    assert (
        verdict(doc("plain", [entry("one"), entry("sleep#1", "sleep", "waiting")])).outcome
        == "clean"
    )
    assert called == []  # no step's function ran


def test_a_changed_journal_mismatches_and_bad_params_are_an_error() -> None:
    changed = doc("ship", [entry("charge"), entry("label"), entry("wait:go", "signal")])
    found = verdict(changed)
    assert (found.outcome, found.step) == ("mismatch", 2)
    assert "recorded as 'label'" in found.detail
    bad = verdict(doc("ship", [entry("charge")], params={"nope": 1}))
    assert bad.outcome == "error" and "invalid params" in bad.detail
    assert verdict(doc("gone", [entry("x")])).outcome == "unchecked"
    report = Report(examples=1)
    for v in (found, bad, verdict(changed)):
        report.add(v)
    assert report.mismatches == 2 and len(report.names["ship"].examples) == 1
    assert judge("k", "n", StepMismatch("step 4 is recorded as 'x'")).step == 4


def test_the_sandbox_refuses_io_between_steps() -> None:
    guard = Guard()
    guard("socket.connect", (None, ("10.0.0.1", 443)))  # not armed: allowed
    guard.armed = True
    guard("open", ("/etc/hosts", "r", 0))  # reading is allowed
    for event, args in (
        ("socket.connect", (None, ("10.0.0.1", 443))),
        ("open", ("/tmp/x", "w", 0)),
        ("open", ("/tmp/x", None, 0o101)),  # os.open(O_WRONLY | O_CREAT)
        ("subprocess.Popen", ("rm", ["rm"], None, None)),
    ):
        with pytest.raises(ForbiddenIo, match="outside a step"):
            guard(event, args)
    assert guard.tried is not None and "socket.connect" in guard.tried  # the first is kept


journals = st.lists(
    st.fixed_dictionaries(
        {
            "name": st.sampled_from(["charge", "patch:v2", "ship", "wait:go", "x", ""]),
            "kind": st.sampled_from(["call", "patch", "signal", "sleep", "children", 3]),
            "state": st.sampled_from(["done", "failed", "waiting", "timed_out", None]),
            "result": st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3)),
        }
    ),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(steps=journals, name=st.sampled_from(["ship", "plain"]))
def test_any_journal_gets_a_verdict(steps: list[Any], name: str) -> None:
    found = verdict(doc(name, steps))
    assert found.outcome in ("clean", "mismatch", "error", "unchecked")
