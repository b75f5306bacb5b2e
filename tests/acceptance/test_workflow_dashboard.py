"""A workflow in the browser, in headless Chromium with a real worker process (``shopapp``): a
paid order's trigger publishes ``fulfil``, which spawns 23 ``pack`` children (one fails) and a
``mail``, then waits for a signal. Its task page says which trigger published it and for which
document, lists its first children each with its derived state and a link (the rest in the
task list filtered by the parent), and links the flow page, which draws the tree ``mtask flow``
draws, server-rendered (JavaScript on and off, 1280 and 390 px, light and dark, never scrolling
sideways). ``mtask get`` and REST say who published it too. Screenshots (``MTASK_SCREENSHOTS``,
else the test's directory; docs/screens/ holds them) are named ``workflow-*``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2 as httpx
from harness import DESKTOP, PHONE, kept, sign_in, worker_process
from harness.cli import run_cli
from pymongo import MongoClient
from test_dashboard import shots_dir, wait_until
from webserver import serving

from mtask import TaskClient
from mtask.web.dashboard import CHILDREN_SHOWN

TOKEN = "workflow-token"
KEY = "fulfil:o-1002"
SKUS = [f"sku-{i}" for i in range(22)] + ["broken"]
CHILDREN = len(SKUS) + 1  # the packs and the mail
LOOKS = [  # scheme, size, viewport, JavaScript
    ("light", "desktop", DESKTOP, True),
    ("dark", "desktop", DESKTOP, False),
    ("dark", "phone", PHONE, True),
    ("light", "phone", PHONE, False),
]


def _waiting_for_shipped(client: TaskClient) -> bool:
    task = client.get(KEY)
    if task is None:
        return False
    assert task.status is not None and task.status.value not in ("failed", "cancelled"), task
    return task.waiting is not None and task.waiting.signal == "shipped"


def test_a_workflow_parent_lists_its_children_draws_its_flow_and_names_its_trigger(
    browser: Any,
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    mongo: MongoClient[dict[str, Any]],
    tmp_path: Path,
) -> None:
    from playwright.sync_api import expect

    assert CHILDREN > CHILDREN_SHOWN  # the page lists some, the list has them all
    out = shots_dir(tmp_path)
    with (
        worker_process(mongo_uri, db_name, "--concurrency", "4", app="shopapp:registry"),
        serving(mongo_uri, db_name, token=TOKEN) as url,
    ):
        wait_until(lambda: any(v["held"] and v.get("through") for v in client.triggers()))
        order = {"_id": "o-1002", "status": "paid", "items": SKUS, "email": "bob@example.com"}
        mongo[db_name].orders.insert_one(order)
        wait_until(lambda: _waiting_for_shipped(client))
        said = "by trigger `fulfil` for `orders/o-1002`"
        # mtask get and REST say who published it
        code, printed, _ = run_cli("get", KEY, "--uri", mongo_uri, "--database", db_name)
        assert code == 0 and f"published  {said}" in printed, printed
        auth = {"Authorization": f"Bearer {TOKEN}"}
        view = httpx.get(f"{url}/tasks/{KEY}", headers=auth, timeout=30).json()
        assert view["triggered_by"] == {
            "trigger": "fulfil",
            "collection": "orders",
            "document": "o-1002",
        }
        page_of = httpx.get(f"{url}/tasks", params={"parent": KEY, "limit": 100}, headers=auth)
        listed = [t["key"] for t in page_of.json()["tasks"]]
        assert len(listed) == CHILDREN and listed[0] == f"{KEY}/spawn#1/0", listed  # in order
        for scheme, size, viewport, js in LOOKS:
            context = browser.new_context(
                viewport=viewport, color_scheme=scheme, java_script_enabled=js
            )
            page = context.new_page()
            page.set_default_timeout(30_000)
            sign_in(page, url, TOKEN)
            page.goto(f"{url}/ui/tasks/{KEY}")
            expect(page.locator("#triggered-by")).to_have_text(said.replace("`", ""))
            rows = page.locator("#children-table tbody tr[data-key]")
            expect(rows).to_have_count(CHILDREN_SHOWN)
            first = rows.first
            expect(first.locator("a")).to_have_text(f"{KEY}/spawn#1/0")
            expect(first.locator(".tag.state")).to_have_text("succeeded")
            expect(first).to_contain_text('"packed sku-0"')
            expect(page.locator("#children h2")).to_contain_text(
                f"the first {CHILDREN_SHOWN} of {CHILDREN}"
            )
            kept(page, out, "workflow-parent", scheme, size, viewport)
            page.locator("#all-children").click()  # every child, in the task list
            keys = page.locator("#tasks tbody tr[data-key]")
            expect(keys).to_have_count(CHILDREN)
            states = keys.evaluate_all("rows => rows.map(r => r.dataset.state)")
            assert states.count("failed") == 1 and states.count("succeeded") == CHILDREN - 1
            expect(page.locator("#parent-filter")).to_contain_text(KEY)
            if size == "desktop":  # a key wraps at its / or :, here not at all
                lines = page.locator("#tasks td.key a").evaluate_all(
                    "links => links.map(a => new Set("
                    "[...a.getClientRects()].map(r => Math.round(r.top))).size)"
                )
                assert set(lines) == {1}, lines
            failed = page.locator("#tasks tbody tr[data-state=failed]")
            expect(failed).to_contain_text("ValueError: no stock for broken")
            page.goto(f"{url}/ui/tasks/{KEY}")
            page.locator("#flow-link").click()  # the tree mtask flow draws
            tree = page.locator("#tree li[data-key]")
            expect(tree).to_have_count(1 + CHILDREN)
            root = page.locator(f'#tree > li[data-key="{KEY}"]')
            expect(root.locator(".tag.state").first).to_have_text("waiting")
            expect(root.locator(".why").first).to_contain_text("waiting for the signal shipped")
            broken = page.locator("#tree li[data-state=failed]")
            expect(broken).to_have_count(1)
            expect(broken.locator(".why")).to_contain_text("ValueError: no stock for broken")
            kept(page, out, "workflow-flow", scheme, size, viewport)
            page.goto(f"{url}/ui/flow/{KEY}/mail/0")  # a child's flow names the way up
            expect(page.locator("#ancestors a")).to_have_text([KEY])
            context.close()
        client.signal(KEY, "shipped", {"carrier": "dhl"})
        wait_until(lambda: client.get(KEY).status.value == "succeeded")  # type: ignore[union-attr]
