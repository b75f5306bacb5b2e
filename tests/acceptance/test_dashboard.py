"""The dashboard end to end in headless Chromium (Debian's ``chromium``, driven by Playwright):
sign in, filter failed tasks, search by error text, bulk-retry them, open a task's timeline,
stop a worker, sign out — with JavaScript on and off; a 390 px phone viewport without
horizontal scroll; dark mode. ``MTASK_SCREENSHOTS=dir`` keeps screenshots of the overview, the
task list, a task page and the workers page at desktop and phone sizes (docs/screens/ holds
them)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from harness import DESKTOP, PHONE, worker_process
from webserver import serving

from mtask import TaskClient

TOKEN = "dash-token"


SHOWN_RIGHT = """selector => Math.max(...[...document.querySelectorAll(selector)]
    .map(e => e.getBoundingClientRect().right))"""
"""The rightmost edge of what ``selector`` matches, where the page shows it: a cell in a table
scrolled sideways lies beyond the screen even when the page itself does not scroll."""


SHOWN = {"overview": "table.blocks td", "tasks": "table.blocks td", "workers": "table.blocks td"}


def wait_until(check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def shots_dir(tmp_path: Path) -> Path:
    return Path(os.environ.get("MTASK_SCREENSHOTS") or tmp_path)


def operator_session(page: Any, url: str, client: TaskClient, worker_id: str, js: bool) -> None:
    """The operator's round: every step through the UI only."""
    from playwright.sync_api import expect

    page.goto(url + "/")
    page.fill("#token", "wrong")
    page.click("form.login button[type=submit]")
    expect(page.locator(".error")).to_have_text("That is not the token.")
    page.fill("#token", TOKEN)
    page.click("form.login button[type=submit]")
    failed = page.locator('#counts tr[data-name="flaky"] td[data-status="failed"] a')
    expect(failed).to_have_text("3")
    failed.click()  # a count is a link to the filtered list
    expect(page.locator("#tasks tbody tr")).to_have_count(3)
    page.fill('input[name="q"]', "failure")  # error words
    page.select_option('select[name="name"]', "flaky")
    page.click("#filters button[type=submit]")
    expect(page.locator("#tasks tbody tr")).to_have_count(3)
    expect(page.locator("#tasks")).to_contain_text("flaky failure on attempt 1")
    page.click("#bulk >> text=retry all 3")
    expect(page.locator(".flash.ok")).to_contain_text("retry would apply to 3 tasks")
    page.click("#bulk >> text=confirm: retry 3")
    expect(page.locator(".flash.ok")).to_contain_text("retry: 3 of 3 tasks")
    wait_until(lambda: client.stats().get("flaky", {}).get("succeeded") == 3)
    page.goto(url + "/ui/tasks/f1")
    expect(page.locator("#status")).to_have_text("succeeded")
    expect(page.locator("#timeline svg rect")).to_have_count(2)
    expect(page.locator("#runs tbody tr")).to_have_count(2)
    page.click("header nav >> text=workers")
    row = page.locator(f'#workers tr[data-worker="{worker_id}"]')
    expect(row).to_contain_text("running")
    expect(row.locator("td.counts")).to_have_text("11 / 3")  # 5 adds, 3 + 3 flaky runs
    row.get_by_role("button", name="stop").click()
    expect(page.locator(".flash.ok")).to_contain_text(f"stop requested: {worker_id}")
    page.click("header .logout button")
    expect(page.locator("#token")).to_be_visible()
    page.goto(url + "/ui/workers")
    expect(page.locator("#token")).to_be_visible()  # signed out: the session is gone


def failing_tasks(client: TaskClient, prefix: str) -> None:
    for i in (1, 2, 3):
        client.publish("flaky", f"{prefix}{i}", {"fail_times": 1}, options={"max_retries": 0})
    client.publish_many(
        [{"name": "add", "key": f"{prefix}a{i}", "params": {"a": i, "b": 1}} for i in range(5)]
    )


@pytest.mark.parametrize("js", [True, False], ids=["js", "no-js"])
def test_the_operator_round(
    browser: Any, js: bool, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    failing_tasks(client, "f")
    worker_id = f"dash-worker-{'js' if js else 'nojs'}"
    with worker_process(mongo_uri, db_name, "--worker-id", worker_id) as process:
        wait_until(lambda: client.stats().get("flaky", {}).get("failed") == 3)
        with serving(mongo_uri, db_name, token=TOKEN, sample_seconds=0.25) as url:
            context = browser.new_context(viewport=DESKTOP, java_script_enabled=js)
            page = context.new_page()
            page.set_default_timeout(30_000)
            operator_session(page, url, client, worker_id, js)
            context.close()
        wait_until(lambda: not any(w["_id"] == worker_id for w in client.workers()))
        wait_until(lambda: process.poll() is not None)  # the stop ends the process, with 0


# every page at two widths and two schemes, each kept as a screenshot: 40-60 s on a quiet
# machine, more than the default hang guard of 120 s beside another suite
@pytest.mark.timeout(600)
def test_phone_width_dark_mode_and_screenshots(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    failing_tasks(client, "f")
    client.publish_many(
        {"name": "sleep", "key": f"a-rather-long-task-key/{i}", "params": {"seconds": 0.3}}
        for i in range(40)
    )
    out = shots_dir(tmp_path)
    with worker_process(mongo_uri, db_name, "--worker-id", "worker-1", "--concurrency", "4"):
        wait_until(lambda: client.stats().get("flaky", {}).get("failed") == 3)
        with serving(mongo_uri, db_name, token=TOKEN, sample_seconds=0.25) as url:
            for scheme in ("light", "dark"):
                for size, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
                    context = browser.new_context(viewport=viewport, color_scheme=scheme)
                    page = context.new_page()
                    page.set_default_timeout(30_000)
                    page.goto(url + "/")
                    page.fill("#token", TOKEN)
                    page.click("form.login button[type=submit]")
                    expect(page.locator("#counts")).to_be_visible()
                    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
                    dark = background.startswith("rgb(11, 17, 32")
                    assert dark == (scheme == "dark"), background
                    wait_until(lambda: client.throughput(60) != [])
                    for name, path in [
                        ("overview", "/"),
                        ("tasks", "/ui/tasks?status=failed"),
                        ("task", "/ui/tasks/f1"),
                        ("workers", "/ui/workers"),
                    ]:
                        page.goto(url + path)
                        width = page.evaluate("document.documentElement.scrollWidth")
                        assert width <= viewport["width"], (name, size, width)
                        if name in SHOWN:  # every count, error and button on the screen
                            right = page.evaluate(SHOWN_RIGHT, SHOWN[name])
                            assert 0 < right <= viewport["width"], (name, size, right)
                        if scheme == "light" or name == "overview":
                            suffix = "" if scheme == "light" else "-dark"
                            shot = out / f"dashboard-{name}-{size}{suffix}.png"
                            page.screenshot(path=str(shot), full_page=size == "phone")
                            assert shot.stat().st_size > 5_000
                    context.close()
