"""The execution graph of a failed workflow in headless Chromium, with a real worker process
(``graphapp``): an order that continued as new, retried a failed step, slept, timed out waiting
for a signal, ran two steps in parallel and failed in its spawn (one child failed for good).
At 1280 and 390 px, JavaScript on and off, dark (and light once): the parallel pair stands side
by side, every node is on the screen (no sideways scroll), the failed step and child are marked,
the words are readable against their background (WCAG contrast 4.5:1), a child's link opens its
page, and "retry from this step" runs the task again from its spawn. Screenshots
(``MTASK_SCREENSHOTS``, else the test's directory; docs/screens/ holds them) are ``graph-*``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from harness import kept, signed_in, worker_process
from harness.pages import SIZES
from test_dashboard import shots_dir, wait_until
from webserver import serving

from mtask import TaskClient

TOKEN = "graph-token"
KEY = "order:o-9"
LOOKS = [  # scheme, size, JavaScript
    ("dark", "desktop", True),
    ("dark", "phone", False),
    ("dark", "phone", True),
    ("dark", "desktop", False),
    ("light", "phone", False),
]
CONTRAST = """els => els.map(e => {
    const rgb = s => (s.match(/[\\d.]+/g) || []).map(Number);
    const lum = c => { const [r, g, b] = c.slice(0, 3).map(v => { v /= 255;
        return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
        return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
    let n = e, bg = null;
    while (n) { const c = rgb(getComputedStyle(n).backgroundColor);
        if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) { bg = c; break; }
        n = n.parentElement; }
    const fg = rgb(getComputedStyle(e).color), a = lum(fg), b = lum(bg || [255, 255, 255]);
    return [e.textContent.trim().slice(0, 30), (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)];
})"""
"""Each element's text and its contrast ratio against the first opaque background behind it."""
READ = "#graph .g-head, #graph .g-facts span, #graph .tag, #graph .g-error, #graph .g-mark, \
#graph .g-child a, #graph .g-group, #graph .g-chip, #graph button"


def failed(client: TaskClient) -> bool:
    task = client.get(KEY)
    return task is not None and task.status is not None and task.status.value == "failed"


def spawn_run(client: TaskClient) -> str:
    """The run that recorded the order's spawn."""
    task = client.get(KEY)
    assert task is not None and task.steps[-1].name == "spawn#1"
    return task.steps[-1].run_id


def test_the_graph_of_a_failed_workflow_in_the_browser(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    out = shots_dir(tmp_path)
    with (
        worker_process(mongo_uri, db_name, "--concurrency", "4", app="graphapp:registry"),
        serving(mongo_uri, db_name, token=TOKEN) as url,
    ):
        client.publish("order", KEY, {"again": 1})
        wait_until(lambda: failed(client))
        for scheme, size, js in LOOKS:
            viewport = SIZES[size]
            with signed_in(browser, url, TOKEN, scheme, size, js=js) as page:
                page.goto(f"{url}/ui/tasks/{KEY}")
                nodes = page.locator("#graph .g-node[data-step]")
                expect(nodes).to_have_count(6)
                pair = page.locator('#graph li.g-parallel[data-group="gather#1"] .g-node')
                expect(pair).to_have_count(2)
                left, right = pair.nth(0).bounding_box(), pair.nth(1).bounding_box()
                assert left and right and abs(left["y"] - right["y"]) < 1, (left, right)
                assert left["x"] + left["width"] <= right["x"], (size, left, right)
                edges = nodes.evaluate_all("ns => ns.map(n => n.getBoundingClientRect().right)")
                assert max(edges) <= viewport["width"], (size, edges)
                spawn = page.locator('#graph .g-node[data-step="spawn#1"]')
                expect(spawn).to_have_class(re.compile(r"\bg-failed\b.*\bg-ended\b"))
                expect(spawn.locator(".g-mark")).to_have_text("the task failed here")
                expect(spawn.locator(".g-child-failed")).to_contain_text("no stock for broken")
                expect(page.locator("#graph-earlier")).to_contain_text("continued as new 1 time")
                check = page.locator('#graph .g-node[data-step="check"]')
                expect(check.locator(".g-attempts")).to_have_text("2 attempts")
                ratios = page.locator(READ).evaluate_all(CONTRAST)
                low = [r for r in ratios if r[1] < 4.5]
                assert not low, (scheme, low)
                kept(page, out, "graph" if js else "graph-nojs", scheme, size, viewport)
                spawn.locator(".g-child-failed a").click()  # the child's own page
                expect(page.locator("h2.key")).to_have_text(f"{KEY}/spawn#1/1")
        for js in (False, True):  # a plain form; with JavaScript, submitted in place
            spawned_by = spawn_run(client)
            with signed_in(browser, url, TOKEN, "dark", "desktop", js=js) as page:
                page.goto(f"{url}/ui/tasks/{KEY}")
                page.locator("#retry-from-6 button").click()
                expect(page.locator(".flash.ok")).to_contain_text("from step spawn#1")
            wait_until(lambda: failed(client))  # its spawn, run again, fails again
            assert spawn_run(client) != spawned_by
