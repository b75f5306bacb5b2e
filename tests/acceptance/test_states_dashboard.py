"""A task explains itself on the dashboard, in headless Chromium with a real worker
process: every derived state and every blocked reason as stated on the overview (its totals),
in the task list (filtered by each state) and on each task's page (its badge and its reason),
at 1280 and 390 px, JavaScript on and off, light and dark, never scrolling sideways; the
limits page; then the review's order-200 through the page, JavaScript on and off: the signal
form refuses an empty payload and bad JSON beside the form keeping its input, a payload-less
signal sent on purpose fails the task, the next signal is said to go to no wait there is, the
step reset form hands it to the wait, and the task succeeds with it; no refused signal's
problem outlives the success. Screenshots (``MTASK_SCREENSHOTS``, else the test's directory;
docs/screens/ holds them) are named ``states-*``."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import states_scenario as scenario
from harness import BACKGROUND, DESKTOP, PHONE, sign_in, worker_process
from test_dashboard import SHOWN_RIGHT, shots_dir, wait_until
from webserver import serving

from mtask import TaskClient
from mtask.explain.states import STATES

TOKEN = "states-token"
CONTEXTS = [  # size, viewport, scheme, JavaScript
    ("desktop", DESKTOP, "light", True),
    ("desktop", DESKTOP, "dark", False),
    ("phone", PHONE, "dark", True),
    ("phone", PHONE, "light", False),
]
SHOTS = {  # the pages kept as screenshots, by the name they are kept under
    "overview": "/",
    "tasks": "/ui/tasks",
    "blocked": "/ui/tasks?state=blocked",
    "limits": "/ui/limits",
    **{  # the task page of each state and reason: task-blocked-group, task-running …
        f"task-{state}" + (f"-{why}" if why else "") + ("-on-retry" if key == "flaky-1" else ""): (
            f"/ui/tasks/{key}"
        )
        for key, (state, why, _) in scenario.EXPECTED.items()
    },
}


def plain(words: str) -> str:
    """A reason as the page shows it: its `backticked` names in <code>, without the ticks."""
    return words.replace("`", "")


def fits(page: Any, viewport: dict[str, int], where: str) -> None:
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= viewport["width"], (where, width)
    if page.locator("table.blocks td").count():
        right = page.evaluate(SHOWN_RIGHT, "table.blocks td")
        assert 0 < right <= viewport["width"], (where, right)


def states_of(client: TaskClient) -> dict[str, str]:
    return {t.key: e.state.value for t, e in zip(*_listed(client), strict=True)}


def _listed(client: TaskClient) -> tuple[list[Any], list[Any]]:
    tasks = client.list(limit=100)
    return tasks, client.explain_all(tasks)


# four contexts, each through every page: 70-80 s on a quiet machine, twice that beside another
# suite, more than the default hang guard of 120 s
@pytest.mark.timeout(600)
def test_every_state_and_reason_on_the_dashboard(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    out = shots_dir(tmp_path)
    scenario.before_worker(client)
    with (
        worker_process(mongo_uri, db_name, *scenario.WORKER_ARGS),
        serving(mongo_uri, db_name, token=TOKEN, sample_seconds=0.25) as url,
    ):
        scenario.with_worker(client)
        states = states_of(client)
        assert {k: states[k] for k in scenario.EXPECTED} == {
            k: v[0] for k, v in scenario.EXPECTED.items()
        }
        totals = Counter(states.values())
        for size, viewport, scheme, js in CONTEXTS:
            context = browser.new_context(
                viewport=viewport, color_scheme=scheme, java_script_enabled=js
            )
            page = context.new_page()
            page.set_default_timeout(30_000)
            sign_in(page, url, TOKEN)
            background = page.evaluate("getComputedStyle(document.body).backgroundColor")
            assert background.startswith(BACKGROUND[scheme]), (scheme, background)
            for state in STATES:  # the overview's totals, each a link to its list
                total = page.locator(f"#totals li.state-{state} .n")
                expect(total).to_have_text(str(totals.get(state, 0)))
            cell = page.locator('#counts tr[data-name="sleep"] td[data-status="blocked"] a')
            expect(cell).to_have_text("2")
            fits(page, viewport, f"overview {size}")
            for state in STATES:
                page.goto(f"{url}/ui/tasks?state={state}")
                rows = page.locator("#tasks tbody tr[data-key]")
                keys = rows.evaluate_all("rows => rows.map(r => r.dataset.key)")
                assert sorted(keys) == sorted(k for k, s in states.items() if s == state), state
                for badge in page.locator("#tasks tbody .tag.state").all_inner_texts():
                    assert badge == state
                fits(page, viewport, f"list {state} {size}")
            for key, (state, why, words) in scenario.EXPECTED.items():
                page.goto(f"{url}/ui/tasks/{key}")
                expect(page.locator("#status")).to_have_text(state)
                expect(page.locator("#reason")).to_contain_text(plain(words))
                if why is not None and why != "backoff":
                    expect(page.locator(".summary .why-tag")).to_contain_text(why.replace("_", " "))
                fits(page, viewport, f"{key} {size}")
            page.goto(url + "/ui/tasks/acme-3")
            expect(page.locator("#reason")).to_contain_text(
                re.compile(
                    r"acme-1 holds it, running [\d.]+ (ms|s|min) on \S+; 1 ahead of this one"
                )
            )
            page.goto(url + "/ui/tasks/bad-1")  # said once, no count the document lacks
            assert page.locator("#invalid-reason").count() == 0
            expect(page.locator("#facts")).to_contain_text("holds no count of its attempts")
            assert "None" not in page.locator("#facts").inner_text()
            page.goto(url + "/ui/tasks/flaky-1")  # succeeded on its second attempt
            assert page.locator("#error").count() == 0  # no error on top
            expect(page.locator("#runs")).to_contain_text("RuntimeError: upstream 503")
            expect(page.locator("#result")).to_have_text('"ok"')
            page.goto(url + "/ui/tasks/fail-1")
            expect(page.locator("#error .exception")).to_have_text(
                "ValueError: this task always fails"
            )
            expect(page.locator("#error .origin")).to_contain_text("workerapp.py:")
            expect(page.locator("#error .trace .user-frame")).to_contain_text("always_fails")
            expect(page.locator("#error details.mtask-frames summary")).to_contain_text(
                "mtask frames"
            )
            page.goto(url + "/ui/limits")
            sleep = page.locator('section.limit[data-name="sleep"]')
            expect(sleep.locator(".locks")).to_have_text("1 lock held")
            acme = sleep.locator('tr[data-group="acme"]')
            expect(acme.locator(".blocked-count")).to_have_text("2")
            expect(acme.locator(".head-task")).to_contain_text("acme-1 running, holds the lock")
            cleanup = page.locator('section.limit[data-name="slow_cleanup"]')
            expect(cleanup.locator(".in-use")).to_have_text("1 of 1 in use")
            fits(page, viewport, f"limits {size}")
            suffix = "" if scheme == "light" else "-dark"  # each size in light and dark
            for name, path in SHOTS.items():
                page.goto(url + path)
                shot = out / f"states-{name}-{size}{suffix}.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 5_000
            context.close()
        scenario.finish(client)


def test_the_signal_form_and_the_step_reset_redo_a_payload_less_signal(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    out = shots_dir(tmp_path)
    options = {"retry_delay_ms": 3_600_000, "max_retries": 3}
    for key in ("order-200", "order-201"):
        client.publish("await_approval", key, {"order": key}, options=options)
    with (
        worker_process(mongo_uri, db_name, "--concurrency", "2"),
        serving(mongo_uri, db_name, token=TOKEN) as url,
    ):
        for key, js in (("order-200", True), ("order-201", False)):
            wait_until(lambda key=key: client.get(key).waiting is not None)  # type: ignore[union-attr]
            context = browser.new_context(viewport=DESKTOP, java_script_enabled=js)
            page = context.new_page()
            page.set_default_timeout(30_000)
            sign_in(page, url, TOKEN)
            page.goto(f"{url}/ui/tasks/{key}")
            form = page.locator("#send-signal")
            expect(form.locator("input[name=name]")).to_have_value("approved")
            form.locator("button[type=submit]").click()  # no payload: refused
            problem = page.locator("#send-signal #note .flash.error")
            expect(problem).to_contain_text("signal not sent: the payload is empty")
            expect(problem).to_be_in_viewport()
            form.locator("textarea[name=payload]").fill("{by: ann}")
            form.locator("button[type=submit]").click()
            expect(problem).to_contain_text("signal not sent: the payload is not JSON")
            expect(form.locator("textarea[name=payload]")).to_have_value("{by: ann}")  # kept
            expect(problem).to_be_in_viewport()
            if key == "order-200":
                page.screenshot(path=str(out / "states-signal-refused-desktop.png"))
            assert client.get(key).signals == []  # type: ignore[union-attr]
            form.locator("textarea[name=payload]").fill("")
            form.locator("input[name=empty]").check()  # without a payload, on purpose
            form.locator("button[type=submit]").click()
            expect(page.locator("#note .flash.ok")).to_have_text(
                f"signal 'approved' sent to {key}: it woke the task"
            )
            wait_until(lambda key=key: (client.get(key).failures or 0) == 1)  # type: ignore[union-attr]
            page.goto(f"{url}/ui/tasks/{key}")
            expect(page.locator("#status")).to_have_text("retrying")
            expect(page.locator("#error .exception")).to_contain_text("TypeError")
            expect(page.locator("ol.steps > li").nth(1)).to_contain_text("had no payload")
            form.locator("textarea[name=payload]").fill('{"by": "ann"}')
            form.locator("button[type=submit]").click()
            kept = page.locator("#note .flash.ok")
            expect(kept).to_contain_text(
                "kept, but only a further wait_for('approved') would take it"
            )
            assert "problem=" not in page.url  # the refused one's problem is gone
            page.locator("#reset summary").click()  # the reset is folded away
            reset = page.locator("#reset-steps")
            reset.locator("select[name=step]").select_option("wait:approved")
            reset.locator("button[type=submit]").click()
            expect(page.locator("#note .flash.ok")).to_have_text(
                f"reset {key}: 1 step removed (wait:approved); 1 signal they had taken "
                "removed; it runs again now"
            )
            wait_until(lambda key=key: client.get(key).status.value == "succeeded")  # type: ignore[union-attr]
            page.reload()
            expect(page.locator("#status")).to_have_text("succeeded")
            expect(page.locator("#result")).to_contain_text('"approved_by": "ann"')
            assert page.locator(".flash.error").count() == 0  # a reload shows no old problem
            if key == "order-200":
                page.screenshot(path=str(out / "states-reset-done-desktop.png"), full_page=True)
            context.close()
    for key in ("order-200", "order-201"):
        task = client.get(key)
        assert task is not None and task.result == {"approved_by": "ann"}
