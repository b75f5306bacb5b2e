"""The task pages of the states ``test_states_dashboard`` does not hold, in headless Chromium
with a real worker process (``morestatesapp``): a parent waiting for its children, a wait on
data, a snoozed run, a back-off's own task (scheduled) and the group's next one (blocked), each
page with its badge, its reason and its reason's tag, at 1280 and 390 px, JavaScript on and off,
light and dark, never scrolling sideways; and the triggers page (the waited-on collection) in
the same four looks. Screenshots (``MTASK_SCREENSHOTS``, else the test's directory) are named
``states-task-*`` and ``states-triggers-*``, beside those of ``test_states_dashboard``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import signed_in, worker_process
from test_dashboard import shots_dir, wait_until
from test_states_dashboard import CONTEXTS, fits, plain
from webserver import serving

from mtask import TaskClient

TOKEN = "more-states-token"
EXPECTED: dict[str, tuple[str, str, str]] = {
    # key: (state, why, a part of the sentence)
    "fan-1": ("waiting", "children", "waiting for its children: 0 of 3 children finished"),
    "settle-1": ("waiting", "data", 'waiting until `invoices` holds `{"_id": "inv-9"'),
    "snooze-1": ("waiting", "snoozed", "upstream busy"),
    "polite-1": ("scheduled", "backoff", "provider said 429"),
    "polite-2": ("blocked", "backoff", "globex"),
}


def _said(client: TaskClient, key: str) -> tuple[str, str | None]:
    task = client.get(key)
    if task is None:
        return ("", None)
    said = client.explain(task)
    return (said.state.value, said.why)


def test_the_other_states_pages_and_the_triggers_page(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    out = shots_dir(tmp_path)
    client.publish("fan_out", "fan-1", {})
    client.publish("settle", "settle-1", {"invoice": "inv-9"})
    client.publish("snoozer", "snooze-1", {})
    client.publish("polite", "polite-1", {}, options={"group": "globex"})
    with (
        worker_process(mongo_uri, db_name, app="morestatesapp:registry"),
        serving(mongo_uri, db_name, token=TOKEN) as url,
    ):
        for key in ("fan-1", "settle-1", "snooze-1", "polite-1"):
            wait_until(lambda key=key: _said(client, key) == EXPECTED[key][:2])
        client.publish("polite", "polite-2", {}, options={"group": "globex"})
        wait_until(lambda: _said(client, "polite-2") == EXPECTED["polite-2"][:2])
        for size, viewport, scheme, js in CONTEXTS:
            with signed_in(browser, url, TOKEN, scheme, size, js=js) as page:
                suffix = "" if scheme == "light" else "-dark"
                for key, (state, why, words) in EXPECTED.items():
                    page.goto(f"{url}/ui/tasks/{key}")
                    expect(page.locator("#status")).to_have_text(state)
                    expect(page.locator("#reason")).to_contain_text(plain(words))
                    if state != "scheduled":  # a scheduled task's why is in its sentence alone
                        expect(page.locator(".summary .why-tag")).to_contain_text(why)
                    fits(page, viewport, f"{key} {size}")
                    shot = out / f"states-task-{state}-{why}-{size}{suffix}.png"
                    page.screenshot(path=str(shot), full_page=True)
                    assert shot.stat().st_size > 5_000
                page.goto(f"{url}/ui/triggers")
                expect(page.locator("tr[data-trigger='wait:invoices'] td.state")).to_have_text(
                    "following"
                )
                fits(page, viewport, f"triggers {size}")
                shot = out / f"states-triggers-{size}{suffix}.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 5_000
        for n in range(3):  # the children finish, and so does their parent
            client.signal(f"fan-1/spawn#1/{n}", "go", {"n": n})
        wait_until(lambda: _said(client, "fan-1")[0] == "succeeded")
