"""The task page's step timeline in headless Chromium without JavaScript: a task a
real worker process took through every kind of step — done, failed then done (an error holding
markup, shown as text), a result stored aside, a transactional step, a sleep, a timed-out
wait, and a wait without deadline — with the signals it was sent, and the form that sends the
one it waits for (a payload that is not JSON is refused, nothing sent); a task without steps
has no step section. Full-page screenshots at 1280 and 390 px, dark and light, copied to /tmp/shots
to be looked at; no horizontal scroll at 390 px."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from harness import kept, looks, signed_in, worker_process
from test_dashboard import shots_dir, wait_until
from webserver import serving

from mtask import TaskClient

TOKEN = "steps-token"


def _waiting_for_approval(client: TaskClient, key: str) -> bool:
    task = client.get(key)
    assert task is not None and task.status.value not in ("failed", "cancelled"), task
    return task.waiting is not None and task.waiting.signal == "approved"


def test_the_task_page_shows_the_step_timeline(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    client.publish("step_showcase", "order/9", {"db": db_name})
    client.publish("add", "plain", {"a": 1, "b": 2})
    out = shots_dir(tmp_path)
    with (
        worker_process(mongo_uri, db_name, "--concurrency", "1"),
        serving(mongo_uri, db_name, token=TOKEN) as url,
    ):
        wait_until(lambda: _waiting_for_approval(client, "order/9"))
        wait_until(lambda: client.get("plain").status.value == "succeeded")  # type: ignore[union-attr]
        client.signal("order/9", "note", {"from": "ops", "text": "<b>rush</b>"})
        for scheme, size, viewport, page in looks(
            browser, url, TOKEN, ("dark", "desktop"), ("dark", "phone"), ("light", "phone")
        ):
            page.goto(url + "/ui/tasks/order/9")
            steps = page.locator("#steps")
            expect(page.locator("#reason")).to_contain_text(
                "waiting for the signal approved (step 7: wait:approved), no deadline"
            )
            said = page.locator("#content").inner_text()
            assert said.count("no deadline") == 1, said  # once, in the reason
            names = page.locator("ol.steps > li .name").all_inner_texts()
            assert names == [
                "reserve", "charge", "label", "book", "sleep#1", "wait:nudge", "wait:approved"
            ]  # fmt: skip
            states = page.locator("ol.steps > li .head .tag").all_inner_texts()
            assert states == ["done", "done", "done", "done", "done", "timed_out", "waiting"]
            charge = page.locator("ol.steps > li").nth(1)
            expect(charge).to_contain_text("2 attempts")
            expect(charge.locator("details summary")).to_have_text("1 failed try")
            error = charge.locator("ul.tries .error")  # markup shown as text, not run
            expect(error).to_have_text("RuntimeError: the gateway said <script>alert(1)</script>")
            expect(page.locator("ol.steps > li").nth(0)).to_contain_text('{"sku":"A-1","n":2}')
            expect(page.locator("ol.steps > li").nth(2)).to_contain_text(
                re.compile(r"result stored aside: 2\d{4} bytes")
            )
            expect(page.locator("ol.steps > li").nth(3)).to_contain_text("transactional")
            expect(page.locator("ol.steps > li").nth(5)).to_contain_text("signal nudge")
            expect(steps.locator("ul.signals")).to_contain_text(
                '{"from":"ops","text":"<b>rush</b>"}'
            )
            assert page.locator("ol.steps li script, ul.signals b").count() == 0
            kept(page, out, "dashboard-task-steps", scheme, size, viewport)
            page.goto(url + "/ui/tasks/plain")
            expect(page.locator("#runs")).to_contain_text("SUCCESS")
            assert page.locator("#steps").count() == 0  # no steps: no section
        # the page's form sends the signal the task waits for (no JavaScript)
        with signed_in(browser, url, TOKEN, "dark", "phone") as page:
            page.goto(url + "/ui/tasks/order/9")
            form = page.locator("#send-signal")
            expect(form.locator("input[name=name]")).to_have_value("approved")  # what it waits for
            form.locator("textarea[name=payload]").fill("{oops")
            form.locator("button[type=submit]").click()
            expect(page.locator("#note .flash.error")).to_contain_text(
                "signal not sent: the payload is not JSON"
            )
            assert _waiting_for_approval(client, "order/9")  # nothing sent
            assert [g.name for g in client.get("order/9").signals] == ["note"]  # type: ignore[union-attr]
            form.locator("textarea[name=payload]").fill('{"ok": true}')
            form.locator("button[type=submit]").click()
            expect(page.locator("#note .flash.ok")).to_have_text(
                "signal 'approved' sent to order/9: it woke the task"
            )
            wait_until(lambda: client.get("order/9").status.value == "succeeded")  # type: ignore[union-attr]
            page.goto(url + "/ui/tasks/order/9")
            assert page.locator("#send-signal").count() == 0  # a finished task takes no signal
    task = client.get("order/9")
    assert task is not None and task.result == {"ok": True}
