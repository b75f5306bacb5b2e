"""The execution graph on the dashboard's task page, through the app (``create_app``) on a
task document a real worker wrote (``graphapp``): an order that continued as new, retried a
failed step, slept, timed out waiting for a signal, ran two steps in parallel and failed in its
spawn (one child failed for good). The page carries each step as a node, the parallel pair in
one stage, the children with their state and link, the failed mark and a "retry from this step"
form, which works with the session's CSRF token and is refused without it or a session."""

from __future__ import annotations

import asyncio
import html
import re
import urllib.parse

from fastapi.testclient import TestClient
from graphapp import registry
from harness import running_worker

from mtask import AsyncTaskClient, TaskClient
from mtask.web import create_app
from mtask.web.auth import Principal

TOKEN = "graph-token"
KEY = "order:o-7"
ORIGIN = {"Origin": "http://testserver"}
STEPS = ["check", "cool-off", "wait:go", "price", "stock", "spawn#1"]


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None
    return found.group(1)


def in_order(steps: list[str]) -> list[str]:
    """``steps`` with the parallel pair (recorded as each ended) in a fixed order."""
    return [*steps[:3], *sorted(steps[3:5]), *steps[5:]]


def section(page: str) -> str:
    found = re.search(r'<section id="graph">.*?</section>', page, re.S)
    assert found is not None, "no graph on the page"
    return found.group(0)


def node(graph: str, step: str) -> str:
    found = re.search(
        rf'<div class="g-node[^"]*"[^>]*data-step="{re.escape(step)}"'
        r'.*?(?=<div class="g-node|</ol>)',
        graph,
        re.S,
    )
    assert found is not None, step
    return found.group(0)


def sign_in(http: TestClient, token: str) -> None:
    http.cookies.clear()
    login = http.get("/login").text
    signed = http.post("/login", data={"token": token, "csrf": csrf_of(login)}, headers=ORIGIN)
    assert signed.status_code == 303


def check_page(mongo_uri: str, db_name: str, client: TaskClient) -> None:
    viewer = {"view-token": Principal("viewer", "vera")}
    app = create_app(mongo_uri, database=db_name, token=TOKEN, tokens=viewer, sample_seconds=3600)
    with TestClient(app, follow_redirects=False) as http:
        sign_in(http, "view-token")  # a viewer sees the graph, no retry, and may not post it
        page = http.get(f"/ui/tasks/{KEY}")
        assert 'data-step="spawn#1"' in section(page.text)
        assert "g-retry" not in section(page.text)
        form = {"action": "retry", "target": KEY, "step": "spawn#1", "next": "/"}
        answer = http.post("/ui/act", data={**form, "csrf": csrf_of(page.text)}, headers=ORIGIN)
        assert answer.status_code == 303
        assert "a viewer may not retry" in urllib.parse.unquote_plus(answer.headers["location"])
        sign_in(http, TOKEN)
        page = http.get(f"/ui/tasks/{KEY}")
        assert page.status_code == 200
        graph = section(page.text)
        steps = re.findall(r'data-step="([^"]+)"', graph)
        assert in_order(steps) == STEPS  # the gather's pair in the order they ended
        assert 'id="graph-earlier"' in graph and "<code>tick</code>" in graph  # continued once
        parallel = re.findall(r'<li class="g-stage g-parallel" data-group="gather#1">', graph)
        assert len(parallel) == 1
        stage = graph.split('data-group="gather#1"', 1)[1].split('<li class="g-stage', 1)[0]
        assert 'data-step="price"' in stage and 'data-step="stock"' in stage
        check = node(graph, "check")
        assert "2 attempts" in check and "1 failed try" in check
        assert "RuntimeError: the inventory service answered 503" in check
        assert "slept" in node(graph, "cool-off")
        assert "waited" in node(graph, "wait:go") and "timed out" in node(graph, "wait:go")
        spawn = node(graph, "spawn#1")
        assert "g-failed" in spawn and "the task failed here" in spawn
        failed_child = re.search(
            r'<li class="g-child g-child-failed" data-key="order:o-7/spawn#1/1".*?</li>',
            spawn,
            re.S,
        )
        assert failed_child is not None
        assert 'href="/ui/tasks/order%3Ao-7/spawn%231/1"' in failed_child.group(0)
        assert "ValueError: no stock for broken" in failed_child.group(0)
        assert 'data-key="order:o-7/spawn#1/0" data-state="succeeded"' in spawn
        assert 'id="graph-end" data-state="failed"' in graph
        assert len(re.findall(r'class="g-retry"', graph)) == len(STEPS)
        form = re.search(r'<form[^>]*id="retry-from-6">(.*?)</form>', graph, re.S)
        assert form is not None
        fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', form.group(1)))
        assert fields["action"] == "retry" and html.unescape(fields["step"]) == "spawn#1"
        fields = {k: html.unescape(v) for k, v in fields.items()}
        # refused: without the CSRF token, and without a session
        bare = {k: v for k, v in fields.items() if k != "csrf"}
        assert http.post("/ui/act", data=bare, headers=ORIGIN).status_code == 403
        session = dict(http.cookies)
        http.cookies.clear()
        answer = http.post("/ui/act", data=fields, headers=ORIGIN)
        assert answer.status_code == 303 and answer.headers["location"].startswith("/login")
        http.cookies.update(session)
        task = client.get(KEY)
        assert task is not None and task.status is not None and task.status.value == "failed"
        # the form: the steps before spawn#1 kept, the task pending again
        answer = http.post("/ui/act", data=fields, headers=ORIGIN)
        assert answer.status_code == 303
        shown = http.get(answer.headers["location"]).text
        assert "is pending now, from step spawn#1" in html.unescape(shown)
        task = client.get(KEY)
        assert task is not None and task.status is not None and task.status.value == "pending"
        assert in_order([s.name for s in task.steps]) == STEPS[:-1]
        assert "g-retry" not in section(shown)  # open again: nothing to retry from


async def test_the_graph_of_a_failed_workflow_and_its_retry_from_a_step(
    aclient: AsyncTaskClient, client: TaskClient, mongo_uri: str, db_name: str
) -> None:
    async with running_worker(registry, mongo_uri, db_name) as (_, events):
        await aclient.publish("order", KEY, {"again": 1})
        await events.wait("recorded", key=KEY, state="FAIL", count=2, timeout=60)
    await asyncio.to_thread(check_page, mongo_uri, db_name, client)
