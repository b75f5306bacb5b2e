"""The dashboard's triggers page in headless Chromium without JavaScript: a real
worker process follows a trigger and a waited-on collection; the page (linked from the nav)
shows each with its state, lag and counts, and its forms pause, resume and reset it. Full-page
screenshots at 1280 and 390 px, dark and light, copied to /tmp/shots to be looked at; no
horizontal scroll at 390 px."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import EVERY_LOOK, kept, looks, signed_in, worker_process
from pymongo import MongoClient
from test_dashboard import shots_dir, wait_until
from webserver import serving

from mtask import TaskClient

TOKEN = "triggers-token"
TESTS = Path(__file__).parents[1]


@pytest.fixture
def worker(mongo_uri: str, db_name: str) -> Iterator[subprocess.Popen[bytes]]:
    with worker_process(mongo_uri, db_name, app="triggerapp:registry") as proc:
        yield proc


def _followed(client: TaskClient) -> bool:
    views = client.triggers()
    return len(views) == 2 and all(v["held"] and v.get("through") for v in views)


def test_the_triggers_page_shows_each_trigger_and_steers_it(
    browser: Any,
    worker: Any,
    mongo_uri: str,
    db_name: str,
    client: TaskClient,
    mongo: MongoClient[dict[str, Any]],
    tmp_path: Path,
) -> None:
    from playwright.sync_api import expect

    wait_until(lambda: _followed(client))
    mongo[db_name].orders.insert_many([{"_id": i, "status": "paid", "total": i} for i in range(3)])
    wait_until(lambda: (client.triggers()[0].get("published") or 0) >= 3)
    out = shots_dir(tmp_path)
    with serving(mongo_uri, db_name, token=TOKEN) as url:
        for scheme, size, viewport, page in looks(browser, url, TOKEN, *EVERY_LOOK):
            page.click("header nav a[href='/ui/triggers']")
            ship = page.locator("tr[data-trigger='ship']")
            expect(ship.locator("td.state")).to_have_text("following")
            expect(ship.locator("td.lag")).to_have_text(re.compile(r"^\d+(\.\d)? (s|min)$"))
            expect(ship).to_contain_text("orders")
            expect(ship).to_contain_text('match {"status": "paid"}')
            expect(page.locator("tr[data-trigger='wait:invoices'] td.state")).to_have_text(
                "following"
            )
            published = ship.locator("td.num").nth(1).inner_text()
            assert int(published) >= 3, published
            kept(page, out, "dashboard-triggers", scheme, size, viewport)
        with signed_in(browser, url, TOKEN, "dark", "phone") as page:
            page.goto(url + "/ui/triggers")
            ship = page.locator("tr[data-trigger='ship']")
            ship.locator("button", has_text="pause").click()
            expect(page.locator("#note .flash.ok")).to_contain_text("ship: paused")
            expect(ship.locator("td.state")).to_have_text("paused")
            wait_until(lambda: not client.triggers()[0]["held"])
            ship.locator("button", has_text="resume").click()
            expect(page.locator("#note .flash.ok")).to_contain_text("ship: resumed")
            wait_until(lambda: _followed(client))
            page.goto(url + "/ui/triggers")
            expect(ship.locator("td.state")).to_have_text("following")
