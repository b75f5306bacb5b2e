"""The dashboard end to end in headless Chromium (Debian's ``chromium``, driven by Playwright):
sign in, see the counts and the worker, click retry on a failed task, see it succeed.
``MTASK_SCREENSHOT=path`` keeps a screenshot (docs/dashboard.png is made this way)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_metrics import worker_process
from webserver import serving

from mtask import TaskClient

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOKEN = "dash-token"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser_page() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("chromium is required in CI (apt-get install chromium)")
        pytest.skip("no chromium here (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)  # a fresh profile
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(30_000)
            yield page
        finally:
            browser.close()


def wait_until(check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_retry_a_failed_task_from_the_dashboard(
    browser_page: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    page = browser_page
    client.publish("flaky", "f1", {"fail_times": 1}, options={"max_retries": 0})
    client.publish_many(
        [{"name": "add", "key": f"a{i}", "params": {"a": i, "b": 1}} for i in range(5)]
    )
    with worker_process(mongo_uri, db_name, "--worker-id", "dash-worker") as _:
        wait_until(lambda: client.get("f1").status == "failed")  # type: ignore[union-attr]
        with serving(mongo_uri, db_name, token=TOKEN, sample_seconds=0.25) as url:
            page.goto(url + "/")
            page.fill("#token", "wrong")
            page.click("button[type=submit]")
            expect(page.locator(".error")).to_have_text("That is not the token.")
            page.fill("#token", TOKEN)
            page.click("button[type=submit]")
            counts = page.locator("#counts")
            expect(counts.locator('tr[data-name="flaky"] td[data-status="failed"]')).to_have_text(
                "1"
            )
            expect(counts.locator('tr[data-name="add"] td[data-status="succeeded"]')).to_have_text(
                "5"
            )
            expect(page.locator("#workers")).to_contain_text("dash-worker")
            # some load for the throughput chart and the workers' running tasks
            client.publish_many(
                {"name": "sleep", "key": f"s{i}", "params": {"seconds": 0.4}} for i in range(60)
            )
            expect(page.locator("#throughput polyline")).to_have_count(1)
            failure = page.locator('#failures tr[data-key="f1"]')
            expect(failure).to_contain_text("flaky failure on attempt 1")
            failure.get_by_role("button", name="retry").click()
            # the page refreshes itself: the task moves from failed to succeeded
            expect(
                counts.locator('tr[data-name="flaky"] td[data-status="succeeded"]')
            ).to_have_text("1")
            expect(counts.locator('tr[data-name="flaky"] td[data-status="failed"]')).to_have_text(
                "0"
            )
            expect(page.locator('#failures tr[data-key="f1"]')).to_have_count(0)
            shot = os.environ.get("MTASK_SCREENSHOT") or str(tmp_path / "dashboard.png")
            page.screenshot(path=shot, full_page=True)
            page.goto(url + "/ui/tasks/f1")
            expect(page.locator("#status")).to_have_text("succeeded")
            expect(page.locator("#runs tbody tr")).to_have_count(2)
            page.get_by_role("link", name="mtask").click()
            page.locator('tr[data-name="add"]').get_by_role("button", name="pause").click()
            expect(counts.locator('tr[data-name="add"]')).to_contain_text("paused")
    assert Path(shot).stat().st_size > 10_000
    task = client.get("f1")
    assert task is not None and task.status == "succeeded" and task.attempts == 2
