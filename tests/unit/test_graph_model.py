"""The execution graph's model (``mtask.web.graph.build``) on task documents of any shape, read
as every reader reads them (``Task.from_document``): it never raises, keeps the journal's order,
puts a gather's consecutive steps in one stage and nothing else together, marks at most one
step as where the task failed, offers a retry from a step only to a failed or cancelled task,
counts no negative time; and the template draws whatever it builds."""

from __future__ import annotations

import datetime as dt
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from markupsafe import escape

from mtask.models import Task
from mtask.web.dashboard import templates
from mtask.web.graph import Graph, build

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
dates = st.one_of(
    st.datetimes(
        min_value=dt.datetime(2000, 1, 1),
        max_value=dt.datetime(9999, 12, 31),
        timezones=st.sampled_from([dt.UTC, dt.timezone(dt.timedelta(hours=5))]),
    ),
    st.datetimes(min_value=dt.datetime(2000, 1, 1)),  # no time zone: a hand edit
)
names = st.text(min_size=1, max_size=10)
step_names = st.one_of(st.sampled_from(["a", "b", "spawn#1", "<b>&"]), names)
"""A step's name: often one a child names as the step that spawned it."""


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the right shape, sometimes anything."""
    return st.one_of(valid, junk)


tries = st.fixed_dictionaries(
    {"run_id": st.text(max_size=40), "at": dates, "ms": st.integers(0, 10**6)},
    optional={"attempt": st.integers(0, 9), "error": st.text(max_size=30)},
)
failures = st.fixed_dictionaries(
    {},
    optional={"key": maybe(names), "name": maybe(names), "status": maybe(names), "error": junk},
)
steps = st.fixed_dictionaries(
    {
        "name": step_names,
        "kind": st.sampled_from(["call", "sleep", "signal", "data", "children", "value", "patch"]),
        "state": st.sampled_from(["done", "failed", "waiting", "timed_out"]),
        "run_id": st.text(max_size=40),
        "started_at": dates,
        "group": st.sampled_from([None, "gather#1", "gather#2"]),
    },
    optional={
        "attempts": st.integers(0, 5),
        "attempt": st.integers(0, 9),
        "finished_at": dates,
        "ms": st.integers(0, 10**7),
        "error": st.text(max_size=40),
        "until": dates,
        "signal": names,
        "nth": st.integers(0, 3),
        "collection": names,
        "tries": st.lists(tries, max_size=3),
        "total": st.integers(0, 30),
        "failed": st.integers(0, 30),
        "failures": st.lists(failures, max_size=3),
        "result": junk,
    },
)
runs = st.fixed_dictionaries(
    {
        "run_id": st.text(max_size=40),
        "worker_id": names,
        "state": st.sampled_from(["RUNNING", "SUCCESS", "FAIL", "WAITING", "CONTINUED"]),
        "claimed_at": dates,
    },
    optional={"finished_at": dates, "error": st.text(max_size=30)},
)
journals = st.fixed_dictionaries(
    {"n": st.integers(1, 5), "run_id": names, "at": dates},
    optional={"steps": st.integers(0, 9), "last": names},
)
STATUSES = ["pending", "running", "succeeded", "failed", "cancelled", "invalid"]
documents = st.fixed_dictionaries(
    {
        "_id": maybe(names),
        "status": maybe(st.sampled_from(STATUSES)),
        "steps": st.one_of(  # two of three times readable steps
            st.lists(steps, min_size=1, max_size=7), st.lists(steps, min_size=2, max_size=5), junk
        ),
    },
    optional={
        "name": maybe(names),
        "runs": maybe(st.lists(maybe(runs), max_size=4)),
        "runs_folded": maybe(st.integers(0, 9)),
        "error": maybe(st.text(max_size=30)),
        "finished_at": maybe(dates),
        "created_at": maybe(dates),
        "continued": maybe(
            st.fixed_dictionaries(
                {"n": st.integers(0, 9), "at": dates},
                optional={"journals": st.lists(journals, max_size=3)},
            )
        ),
    },
)
children = st.fixed_dictionaries(
    {"_id": maybe(names)},
    optional={
        "name": maybe(names),
        "status": maybe(st.sampled_from(STATUSES)),
        "error": maybe(st.text(max_size=20)),
        "created_at": maybe(dates),
        "finished_at": maybe(dates),
        "spawn": maybe(
            st.fixed_dictionaries(
                {"parent": names, "step": maybe(step_names), "index": maybe(st.integers(0, 5))}
            )
        ),
    },
)
derived = st.sampled_from(["succeeded", "failed", "waiting", "running", "retrying", "cancelled"])


def drawn(graph: Graph, key: str) -> str:
    return templates.get_template("graph.html").render(
        g=graph, task_key=key, root="", csrf="c", here="/", may=lambda action: True
    )


@settings(max_examples=100, deadline=None)
@given(documents, st.lists(st.tuples(children, derived), max_size=4), derived)
def test_any_document_makes_a_graph_the_page_draws(
    doc: dict[str, Any], kids: list[tuple[dict[str, Any], str]], state: str
) -> None:
    task = Task.from_document(doc)
    read = [(Task.from_document(k), s) for k, s in kids]
    graph = build(task, read, state, NOW)
    nodes = [n for stage in graph.stages for n in stage.nodes]
    assert [n.name for n in nodes] == [s.name for s in task.steps]  # the journal's order
    assert [n.place for n in nodes] == list(range(1, len(nodes) + 1))
    for stage in graph.stages:
        if len(stage.nodes) > 1:
            assert stage.group is not None
        assert {task.steps[n.place - 1].group or None for n in stage.nodes} == {stage.group}
    for before, after in zip(graph.stages, graph.stages[1:], strict=False):
        assert before.group is None or before.group != after.group  # one stage per gather
    ended = [n for n in nodes if n.ended_task]
    assert len(ended) <= 1 and all(n.failed for n in ended)
    assert not ended or ended[0] in graph.stages[-1].nodes  # a step after it: it was caught
    assert graph.end.outside is False or not ended
    offered = any(n.retry_from for n in nodes)
    assert not offered or (task.status is not None and task.status.value in ("failed", "cancelled"))
    times = [n.seconds for n in nodes] + [r.seconds for r in graph.runs]
    times += [c.seconds for n in nodes for c in n.children]
    assert all(t is None or t >= 0 for t in times)
    page = drawn(graph, task.key)
    assert page.count(' data-step="') == len(nodes)
    for n in nodes:
        assert f'data-step="{escape(n.name)}"' in page
    assert 'id="graph-end"' in page


def step(name: str, **fields: Any) -> dict[str, Any]:
    at = NOW - dt.timedelta(minutes=5)
    return {"name": name, "kind": "call", "state": "done", "run_id": "r" * 40, "started_at": at,
            **fields}  # fmt: skip


def test_a_gather_stands_side_by_side_and_a_failed_spawn_lists_its_children() -> None:
    later = NOW - dt.timedelta(minutes=4)
    doc = {
        "_id": "p",
        "status": "failed",
        "steps": [
            step("a", tries=[{"run_id": "r1", "at": NOW, "ms": 5, "error": "E: x\nE: boom"}]),
            step("b", group="gather#1"),
            step("c", group="gather#1"),
            step("nap", kind="sleep", finished_at=later, until=later),
            step("d", group="gather#2"),
            step(
                "kids",
                kind="children",
                state="failed",
                total=3,
                failed=1,
                finished_at=later,
                failures=[{"key": "p/kids/2", "name": "k", "status": "failed", "error": "V"}],
            ),
        ],
    }
    kid = {"_id": "p/kids/0", "name": "k", "spawn": {"parent": "p", "step": "kids", "index": 0}}
    graph = build(Task.from_document(doc), [(Task.from_document(kid), "succeeded")], "failed", NOW)
    assert [[n.name for n in s.nodes] for s in graph.stages] == [
        ["a"],
        ["b", "c"],
        ["nap"],
        ["d"],
        ["kids"],
    ]
    assert graph.parallel == 1 and graph.steps == 6
    a, nap, kids = graph.stages[0].nodes[0], graph.stages[2].nodes[0], graph.stages[4].nodes[0]
    assert [t.error for t in a.tries] == ["E: boom"]
    assert nap.seconds == 60 and not nap.so_far and nap.detail.startswith("until ")
    assert kids.ended_task and kids.failed and kids.retry_from
    assert [c.key for c in kids.children] == ["p/kids/0", "p/kids/2"]  # read, and failed
    assert kids.children_more == 1 and kids.children[1].error == "V"
    assert not graph.end.outside
    page = drawn(graph, "p")
    assert "the task failed here" in page and 'href="/ui/tasks/p/kids/0"' in page
    assert page.count("retry from here") == 6


def test_a_failure_between_steps_is_said_at_the_end_and_an_open_wait_counts_to_now() -> None:
    doc = {
        "_id": "q",
        "status": "failed",
        "error": "Traceback…\nKeyError: 'x'",
        "steps": [
            step("w", kind="signal", state="waiting", signal="go", until=dt.datetime(9999, 1, 1))
        ],
    }
    graph = build(Task.from_document(doc), [], "failed", NOW)
    (w,) = graph.stages[0].nodes
    assert w.so_far and w.seconds == 300 and w.detail == "signal go, no deadline"
    assert graph.end.outside and graph.end.error == "KeyError: 'x'"
    assert "failed outside any step" in drawn(graph, "q")
    waits = {**doc, "status": "pending", "waiting": {"until": NOW, "index": 0, "signal": "go"}}
    graph = build(Task.from_document(waits), [], "waiting", NOW)
    assert graph.stages[0].nodes[0].detail == "signal go"  # the reason says when it ends
    caught = {**doc, "steps": [step("a", state="failed", error="E: no"), step("b")]}
    graph = build(Task.from_document(caught), [], "failed", NOW)
    assert graph.stages[0].nodes[0].failed and not graph.stages[0].nodes[0].ended_task
    assert graph.end.outside
