"""``mtask.explain.states.explain``: one derived state per task and the sentence that says why,
from the document and the cluster's state. Hypothesis runs it over documents of any shape (an
``_id`` of any type, fields missing or mistyped) and clusters of any shape: it never raises, and
its state agrees with the stored status; the examples pin each state and each reason."""

from __future__ import annotations

import datetime as dt
from typing import Any

import hypothesis.strategies as st
import pytest
from bson.binary import Binary
from hypothesis import given
from hypothesis import settings as hsettings

from mtask.explain.states import (
    OPEN_STATES,
    PENDING_STATES,
    STATES,
    WHY,
    Cluster,
    Group,
    State,
    Worker,
    attempt_of,
    deadline,
    explain,
    timing,
)
from mtask.limits.rules import Limit
from mtask.models import Task
from mtask.steps import NEVER

NOW = dt.datetime(2026, 11, 28, 3, 12, 17, tzinfo=dt.UTC)
LATER = NOW + dt.timedelta(minutes=12)
EARLIER = NOW - dt.timedelta(seconds=21)
W1 = Worker("w1", "host-3", frozenset({"sync", "report", "add"}))


def doc(key: Any = "k", **fields: Any) -> dict[str, Any]:
    """A well-formed pending task document, due now, with ``fields`` over it."""
    base: dict[str, Any] = {
        "_id": key,
        "name": "add",
        "params": {},
        "options": {"priority": 0, "concurrency": 1, "max_retries": 3},
        "status": "pending",
        "next_claim_at": NOW,
        "available_at": NOW,
        "attempts": 0,
        "successes": 0,
        "failures": 0,
        "runs": [],
        "created_at": EARLIER,
        "updated_at": EARLIER,
    }
    return base | fields


def said(document: dict[str, Any], cluster: Cluster | None = None) -> tuple[str, Any, str]:
    e = explain(Task.from_document(document), cluster or Cluster(NOW, workers=(W1,)))
    return e.state.value, e.why, e.reason


def run(state: str = "RUNNING", **fields: Any) -> dict[str, Any]:
    return {
        "run_id": "r1",
        "worker_id": "w1",
        "state": state,
        "claimed_at": EARLIER,
        "lease_expires_at": NOW + dt.timedelta(seconds=9),
        **fields,
    }


# -- every state -------------------------------------------------------------------------------


def test_a_task_not_due_yet_is_scheduled() -> None:
    state, why, reason = said(doc(next_claim_at=LATER, available_at=LATER))
    assert (state, why) == ("scheduled", None)
    assert reason == "scheduled for 2026-11-28 03:24:17 (in 12 min)"


def test_a_due_task_with_a_worker_for_its_name_is_available() -> None:
    state, why, reason = said(doc())
    assert (state, why) == ("available", None)
    assert reason.endswith("the next free worker of `add` claims it (1 live worker handles it)")


def test_a_running_task_says_where_and_for_how_long() -> None:
    state, why, reason = said(doc(status="running", attempts=1, runs=[run()]))
    assert (state, why) == ("running", None)
    assert reason == "running for 21 s on `w1` (host-3), attempt 1 of 4"


def test_a_running_task_whose_lease_ended_is_taken_over() -> None:
    ended = run(lease_expires_at=NOW - dt.timedelta(seconds=5))
    state, why, reason = said(doc(status="running", runs=[ended]))
    assert (state, why) == ("running", "lease_ended")
    assert "stopped extending its lease 5.0 s ago: another worker takes it over" in reason


def test_a_failed_run_waiting_for_its_backoff_is_retrying() -> None:
    failed = run("FAIL", finished_at=EARLIER, error="Traceback …\nRuntimeError: upstream 503")
    state, why, reason = said(
        doc(failures=1, attempts=1, runs=[failed], next_claim_at=LATER, error=failed["error"])
    )
    assert (state, why) == ("retrying", "backoff")
    assert reason == (
        "attempt 1 failed: RuntimeError: upstream 503; attempt 2 of 4 at 2026-11-28 03:24:17 "
        "(in 12 min)"
    )


@pytest.mark.parametrize("until", ["2026-11-28 03:24:17 UTC", "2026-11-28T03:24:17+00:00"])
def test_a_task_its_backoff_released_says_when_once(until: str) -> None:
    backed = f"backed off group `globex` of `add` until {until}, by its handler: 429"
    released = run("RELEASED", finished_at=EARLIER, error=backed)
    state, why, reason = said(doc(runs=[released], attempts=1, backoffs=1, next_claim_at=LATER))
    assert (state, why) == ("scheduled", "backoff")
    assert reason.startswith(
        "released: backed off group `globex` of `add`, by its handler: 429; due again at "
        "2026-11-28 03:24:17 (in 12 min); 1 back-off"
    )
    assert reason.count("03:24:17") == 1


def test_waiting_for_a_signal_a_sleep_or_dependencies() -> None:
    signal = {"until": LATER, "index": 2, "step": "wait:approved", "signal": "approved", "nth": 0}
    assert said(doc(waiting=signal, next_claim_at=LATER)) == (
        "waiting",
        "signal",
        "waiting for the signal `approved` (step 3: wait:approved), times out at "
        "2026-11-28 03:24:17 (in 12 min)",
    )
    forever = signal | {"until": NEVER}
    assert said(doc(waiting=forever, next_claim_at=NEVER))[2].endswith("no deadline")
    sleep = {"until": LATER, "index": 1, "step": "sleep#1"}
    assert said(doc(waiting=sleep, next_claim_at=LATER)) == (
        "waiting",
        "sleep",
        "sleeping until 2026-11-28 03:24:17 (in 12 min; step 2: sleep#1)",
    )
    data = {
        "until": NEVER,
        "index": 0,
        "step": "until:invoices",
        "data": {"collection": "invoices", "ids": ["i-1"], "filter": {"_id": "i-1", "paid": True}},
    }
    assert said(doc(waiting=data, next_claim_at=NEVER)) == (
        "waiting",
        "data",
        'waiting until `invoices` holds `{"_id": "i-1", "paid": true}` (step 1: until:invoices), '
        "no deadline",
    )
    wide = data | {"data": data["data"] | {"filter": {"note": "x" * 500}}}
    assert len(said(doc(waiting=wide, next_claim_at=NEVER))[2]) < 200
    deps = doc(depends_on=["a", "b"], waiting_on=["a", "b"], next_claim_at=None)
    assert said(deps) == ("waiting", "dependencies", "waiting for 2 tasks it depends on: `a`, `b`")


def test_a_woken_task_is_available_though_its_wait_is_still_recorded() -> None:
    woken = {"until": NEVER, "index": 2, "signal": "approved", "nth": 0}
    assert said(doc(waiting=woken, next_claim_at=NOW))[0] == "available"


def test_the_final_states_are_the_stored_statuses() -> None:
    ok = doc(status="succeeded", successes=1, attempts=2, failures=1, finished_at=EARLIER)
    assert said(ok) == ("succeeded", None, "succeeded 21 s ago, on attempt 2 of 4")
    failed = doc(status="failed", failures=4, finished_at=EARLIER, error="x\nValueError: no")
    assert said(failed) == ("failed", None, "failed 21 s ago, on attempt 4 of 4: ValueError: no")
    fail = doc(status="failed", failed_permanently=True, failures=0, error="Fail: bad input")
    assert said(fail) == ("failed", None, "failed for good, on attempt 1 of 4: Fail: bad input")
    assert said(doc(status="cancelled", finished_at=EARLIER))[:2] == ("cancelled", None)
    bad = doc(status="invalid", invalid_reason="'runs' must be an array")
    assert said(bad) == ("invalid", None, "invalid: 'runs' must be an array")


# -- every blocked reason ---------------------------------------------------------------------


def test_a_paused_name_blocks_its_due_tasks_first() -> None:
    cluster = Cluster(NOW, paused=frozenset({"add"}), workers=())
    assert said(doc(), cluster)[:2] == ("blocked", "paused")
    assert "`add` is paused" in said(doc(), cluster)[2]
    assert said(doc(next_claim_at=LATER), cluster)[0] == "scheduled"  # not due: not blocked


def test_no_live_worker_for_the_name() -> None:
    cluster = Cluster(NOW, workers=(W1,))
    resize = doc(name="resize_image")
    assert said(resize, cluster) == (
        "blocked",
        "no_worker",
        "no live worker handles `resize_image`",
    )
    only = doc(options={"specific_worker_ids": ["w9"], "max_retries": 3})
    state, why, reason = said(only, cluster)
    assert (state, why) == ("blocked", "no_worker")
    assert reason == "it may run only on `w9`: none of them is a live worker of `add`"
    assert said(resize, Cluster(NOW))[0] == "available"  # workers not read: none assumed


def test_an_encrypted_task_given_back_by_a_worker_without_the_key_says_so() -> None:
    given_back = run(
        "RELEASED",
        finished_at=EARLIER,
        error="not decrypted by worker `w1`: this worker has no encryption key (…)",
    )
    sealed = {"__mtask_encrypted__": Binary(b"\x02" + bytes(40), 6)}
    state, why, reason = said(doc(params=sealed, attempts=1, runs=[given_back]))
    assert (state, why) == ("blocked", "no_key")
    assert reason == (
        "given back, no retry spent: not decrypted by worker `w1`: this worker has no "
        "encryption key (…); it waits for a worker of `add` that holds the encryption key (one "
        "that cannot decrypt it does not claim it again)"
    )
    shutdown = run("RELEASED", finished_at=EARLIER)  # given back for another reason: available
    assert said(doc(params=sealed, attempts=1, runs=[shutdown]))[0] == "available"


def test_a_sequence_behind_its_lock_holder() -> None:
    holder = Task.from_document(
        doc("sync2-acme-1", name="sync", status="running", runs=[run()], group_lock=True)
    )
    facts = Group(Limit(1), holder=holder, first="sync2-acme-1", ahead={"sync2-acme-3": 1})
    cluster = Cluster(NOW, workers=(W1,), groups={("sync", "acme"): facts})
    task = doc("sync2-acme-3", name="sync", options={"group": "acme", "max_retries": 3})
    assert said(task, cluster) == (
        "blocked",
        "group",
        "waiting for group `acme` (sequence): `sync2-acme-1` holds it, running 21 s on host-3; "
        "1 ahead of this one",
    )
    second = doc("sync2-acme-2", name="sync", options={"group": "acme"})
    assert said(second, cluster)[2].endswith("running 21 s on host-3")  # ahead not read
    mine = doc("sync2-acme-1", name="sync", options={"group": "acme"}, group_lock=True)
    assert said(mine, cluster)[0] == "available"  # the holder, due again (woken, retried)


def test_a_sequence_without_a_holder_runs_its_first_task() -> None:
    facts = Group(Limit(1), holder=None, first="a-1", ahead={"a-2": 0})
    cluster = Cluster(NOW, workers=(W1,), groups={("sync", "acme"): facts})
    first = doc("a-1", name="sync", options={"group": "acme"})
    assert said(first, cluster)[0] == "available"
    second = doc("a-2", name="sync", options={"group": "acme"})
    assert said(second, cluster) == (
        "blocked",
        "group",
        "waiting for group `acme` (sequence): `a-1` goes first (published earlier); next in line",
    )


def test_a_sleeping_holder_is_said_so() -> None:
    sleeping = doc(
        "h",
        name="sync",
        waiting={"until": LATER, "index": 0, "step": "sleep#1"},
        next_claim_at=LATER,
        group_lock=True,
    )
    facts = Group(Limit(1), holder=Task.from_document(sleeping), first="h")
    cluster = Cluster(NOW, workers=(W1,), groups={("sync", "g"): facts})
    reason = said(doc("t", name="sync", options={"group": "g"}), cluster)[2]
    assert reason.startswith("waiting for group `g` (sequence): `h` holds it, waiting: sleeping")


def test_a_group_limit_and_a_name_limit_full() -> None:
    live = {"expires": NOW + dt.timedelta(seconds=30)}
    slot = {"concurrency": 2, "holders": [live, live, {"expires": EARLIER}]}
    facts = Group(Limit(2), slot=slot)
    cluster = Cluster(NOW, workers=(W1,), groups={("report", "acme"): facts})
    task = doc(name="report", options={"group": "acme"})
    assert said(task, cluster) == (
        "blocked",
        "group",
        "waiting for group `acme` of `report`: 2 of 2 runs at once in use",
    )
    roomy = Cluster(NOW, workers=(W1,), groups={("report", "acme"): Group(Limit(3), slot=slot)})
    assert said(task, roomy)[0] == "available"  # the name's current limit, not the slot's copy
    name = Cluster(NOW, workers=(W1,), limits={"report": {"concurrency": 1, "holders": [live]}})
    assert said(doc(name="report"), name) == (
        "blocked",
        "limit",
        "limit of `report`: 1 of 1 runs at once in use",
    )


def test_a_rate_without_a_token_blocks() -> None:
    bucket = {"rate": 5.0, "burst": 1, "tokens": 0.0, "refilled_at": NOW}
    cluster = Cluster(NOW, workers=(W1,), limits={"add": bucket})
    assert said(doc(), cluster) == (
        "blocked",
        "limit",
        "limit of `add`: 5 per second, the next in 200 ms",
    )
    full = bucket | {"refilled_at": NOW - dt.timedelta(seconds=1)}
    assert said(doc(), Cluster(NOW, workers=(W1,), limits={"add": full}))[0] == "available"


def test_a_publishers_minimal_document() -> None:
    state, why, reason = said({"_id": "p", "name": "add"})
    assert (state, why) == ("available", "incomplete")
    assert "the first worker that meets it completes it" in reason


def test_timing_names_the_time_that_matters_next() -> None:
    def when(document: dict[str, Any]) -> Any:
        task = Task.from_document(document)
        return timing(task, explain(task, Cluster(NOW, workers=(W1,))))

    assert when(doc(next_claim_at=LATER)) == ("runs", LATER)
    signal = {"until": NEVER, "index": 0, "signal": "s", "nth": 0}
    assert when(doc(waiting=signal, next_claim_at=NEVER)) == ("times out", None)
    assert when(doc(status="running", runs=[run()]))[0] == "lease until"
    assert when(doc(status="succeeded")) is None


def test_attempts_count_tries_of_the_budget_not_runs() -> None:
    def of(**fields: Any) -> tuple[int, int | None]:
        return attempt_of(Task.from_document(doc(**fields)))

    assert of() == (1, 4)
    assert of(failures=1, attempts=5) == (2, 4)  # three runs ended waiting: no tries
    assert of(status="failed", failures=4) == (4, 4)
    assert of(status="failed", failures=1, failed_permanently=True) == (2, 4)
    assert of(options={}) == (1, None)
    assert deadline(NEVER, NOW) == "no deadline"


# -- any document, any cluster -----------------------------------------------------------------

KEYS = st.one_of(
    st.text(max_size=8),
    st.integers(),
    st.none(),
    st.binary(max_size=4),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.lists(st.integers(), max_size=2),
)
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
DATES = st.one_of(st.none(), st.sampled_from([EARLIER, NOW, LATER, NEVER]), ANY)
RUNS = st.lists(
    st.one_of(
        st.builds(
            run,
            st.sampled_from(["RUNNING", "FAIL", "SUCCESS", "WAITING", "TIMEOUT", "RELEASED"]),
            lease_expires_at=st.sampled_from([EARLIER, LATER]),
        ),
        ANY,
    ),
    max_size=3,
)
WAITING = st.one_of(
    st.none(),
    ANY,
    st.fixed_dictionaries(
        {"until": st.sampled_from([LATER, NEVER]), "index": st.integers(0, 3)},
        optional={"signal": st.text(min_size=1, max_size=3), "step": st.text(max_size=3)},
    ),
)
DOCUMENTS = st.fixed_dictionaries(
    {"_id": KEYS},
    optional={
        "name": st.one_of(st.sampled_from(["add", "sync", "report"]), ANY),
        "status": st.one_of(
            st.sampled_from(["pending", "running", "succeeded", "failed", "cancelled", "invalid"]),
            ANY,
        ),
        "next_claim_at": DATES,
        "options": st.one_of(
            ANY,
            st.fixed_dictionaries(
                {},
                optional={
                    "group": st.one_of(st.sampled_from(["g", "h"]), ANY),
                    "max_retries": st.one_of(st.integers(0, 5), ANY),
                    "specific_worker_ids": st.one_of(st.lists(st.sampled_from(["w1", "w9"])), ANY),
                    "run_at": DATES,
                },
            ),
        ),
        "runs": st.one_of(RUNS, ANY),
        "failures": st.one_of(st.integers(0, 5), ANY),
        "attempts": ANY,
        "waiting": WAITING,
        "waiting_on": st.one_of(st.lists(st.text(max_size=3), max_size=2), ANY),
        "error": ANY,
        "finished_at": DATES,
        "created_at": DATES,
        "failed_permanently": ANY,
        "group_lock": ANY,
        "publish_seq": ANY,
    },
)
SLOTS = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "concurrency": ANY,
            "rate": ANY,
            "burst": ANY,
            "tokens": ANY,
            "refilled_at": DATES,
            "holders": st.one_of(
                ANY, st.lists(st.one_of(ANY, st.fixed_dictionaries({"expires": DATES})))
            ),
        },
    ),
)


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    holder = draw(st.one_of(st.none(), DOCUMENTS.map(Task.from_document)))
    limit = Limit(draw(st.one_of(st.none(), st.integers(1, 3))), draw(st.sampled_from([None, 2.0])))
    groups = {
        (name, group): Group(
            limit,
            holder=holder,
            first=draw(st.one_of(st.none(), st.text(max_size=3))),
            slot=draw(SLOTS),
            ahead=draw(st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2)),
        )
        for name in draw(st.lists(st.sampled_from(["add", "sync"]), max_size=2))
        for group in ("g", "h")
    }
    limits = {
        name: slot
        for name in draw(st.lists(st.sampled_from(["add", "sync", "report"]), max_size=3))
        if (slot := draw(SLOTS)) is not None
    }
    workers = draw(
        st.one_of(
            st.none(),
            st.lists(
                st.builds(
                    Worker,
                    st.sampled_from(["w1", "w2"]),
                    st.one_of(st.none(), st.text(max_size=3)),
                    st.frozensets(st.sampled_from(["add", "sync", "report"])),
                ),
                max_size=2,
            ).map(tuple),
        )
    )
    paused = draw(st.frozensets(st.sampled_from(["add", "sync"])))
    return Cluster(NOW, paused, workers, limits, groups)


@hsettings(max_examples=400)
@given(DOCUMENTS, clusters())
def test_any_document_in_any_cluster_has_one_state_and_a_reason(
    document: dict[str, Any], cluster: Cluster
) -> None:
    task = Task.from_document(document)
    e = explain(task, cluster)
    assert e.state.value in STATES
    assert isinstance(e.reason, str) and e.reason
    if e.state in WHY:
        assert e.why in (*WHY[e.state], "malformed")
    status = task.status.value if task.status is not None else None
    if status in ("succeeded", "failed", "cancelled", "invalid"):
        assert e.state.value == status
    elif status == "running":
        assert e.state is State.RUNNING
    elif status == "pending":
        assert e.state in PENDING_STATES
    else:
        assert e.state in OPEN_STATES
    assert timing(task, e) is None or timing(task, e)[0]  # type: ignore[index]


_ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    heartbeats=st.lists(
        st.fixed_dictionaries(
            {"uses": _ANY | st.lists(st.fixed_dictionaries({"name": _ANY, "resources": _ANY}))}
        ),
        max_size=3,
    ),
    listed=_ANY,
)
def test_a_resource_the_workers_or_its_document_name_is_read_from_any_shape(
    heartbeats: list[dict[str, Any]], listed: Any
) -> None:
    """The readers' side of shared resources: heartbeats' ``uses`` and a resource
    document's ``names`` of any shape never raise, and give names and slots only."""
    from mtask.limits import rules as limits
    from mtask.store.cluster import _resources, declared_uses

    crm = limits.resource_slot("crm")
    heartbeats.append({"uses": [{"name": "n", "resources": ["crm", 7]}]})
    declared = declared_uses(heartbeats, ["n", "m"])
    found = _resources(["n", "m"], declared, {crm: {"_id": crm, "names": listed}, "n": {}})
    assert found["n"] == (crm,)
    assert set(found) <= {"n", "m"} and all(s == (crm,) for s in found.values())


def _explained_in_source() -> set[tuple[str, str | None]]:
    """Every ``(state, why)`` that ``mtask.explain.states`` can return, read from its source: each
    ``Explained(State.X, why, …)`` with a literal ``why``, and the final states (``why`` None)."""
    import ast
    import inspect

    import mtask.explain.states

    found: set[tuple[str, str | None]] = {(s, None) for s in STATES if not State(s).open}
    for node in ast.walk(ast.parse(inspect.getsource(mtask.explain.states))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Explained"):
            continue
        state, why = node.args[0], node.args[1]
        if isinstance(state, ast.Attribute) and isinstance(why, ast.Constant):
            found.add((State[state.attr].value, why.value))
    return found


def _in_the_table() -> set[tuple[str, str | None]]:
    """Every ``(state, why)`` docs/web.md's state table documents: the states in its first
    column, each with no ``why`` and with each lower-case name in backticks of its third."""
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "web.md").read_text()
    section = page.split("## A task explains itself", 1)[1]
    rows = re.findall(r"^\| (`.+?) \|(.*?)\|(.*?)\|$", section, flags=re.M)
    documented: set[tuple[str, str | None]] = set()
    for states, _when, whys in rows:
        for state in re.findall(r"`([a-z_]+)`", states):
            documented.add((state, None))
            documented |= {(state, w) for w in re.findall(r"`([a-z_]+)`", whys)}
    return documented


def test_the_web_pages_state_table_names_every_state_and_why_explain_returns() -> None:
    """docs/web.md's table of states: each ``(state, why)`` ``explain`` can return is in it,
    and it names none that ``explain`` cannot (a state always without a why aside)."""
    returned, documented = _explained_in_source(), _in_the_table()
    assert {s for s, _ in documented} == set(STATES)
    assert returned - documented == set()
    assert {(s, w) for s, w in documented if w is not None} - returned == set()
    assert ("scheduled", "debounce") in returned and ("waiting", "snoozed") in returned


@given(
    docs=st.lists(
        st.dictionaries(
            st.sampled_from(["_id", "holders", "concurrency", "held_until", "names"]), _ANY
        ),
        max_size=4,
    )
)
def test_the_limits_gauges_read_documents_of_any_shape(docs: list[dict[str, Any]]) -> None:
    """``mtask_limit_*`` (``occupancy.gauges``): a hand-written limit document of any shape
    never blanks the gauges of every limit."""
    from mtask.store.occupancy import gauges

    docs += [{"_id": "n", "holders": 5}, {"_id": "m", "holders": True, "concurrency": "2"}]
    found = gauges(docs, dt.datetime(2046, 1, 1, tzinfo=dt.UTC))
    assert len(found) == sum(1 for d in docs if isinstance(d.get("_id"), str) and d["_id"])
    assert all(g.in_use >= 0 for g in found)
