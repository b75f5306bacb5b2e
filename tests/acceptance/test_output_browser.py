"""A task's live output in a real browser (Debian's Chromium, driven by Playwright): an
``EventSource`` reads the SSE stream of 1,000 chunks a real worker emits, goes away after 300,
and a new one resumes after the last id and gets the rest exactly once, then ``end``; the task
page shows the progress and the live log at 1280 and 390 px, dark (and light), without
JavaScript: full-page screenshots in the test's directory (or ``MTASK_SCREENSHOTS`` if set),
copied to /tmp/shots to be looked at."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

from harness import EVERY_LOOK, kept, looks, sign_in, worker_process
from test_dashboard import shots_dir
from webserver import serving

from mtask import TaskClient

TOKEN = "out-token"
READ = """async ([path, stopAfter]) => await new Promise((resolve, reject) => {
  const got = [];
  const source = new EventSource(path);
  source.addEventListener("chunk", (e) => {
    got.push([Number(e.lastEventId), JSON.parse(e.data).data.i]);
    if (stopAfter && got.length === stopAfter) { source.close(); resolve({ got, end: null }); }
  });
  source.addEventListener("end", (e) => {
    source.close();
    resolve({ got, end: JSON.parse(e.data) });
  });
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) reject(new Error("the stream closed"));
  });
})"""


def test_an_event_source_resumes_after_the_last_id_exactly_once(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    client.publish("chatter", "z", {"count": 1000, "every_ms": 4})
    with (
        worker_process(mongo_uri, db_name, "--concurrency", "1"),
        serving(mongo_uri, db_name, token=TOKEN) as url,
    ):
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(60_000)
        sign_in(page, url, TOKEN)  # the session cookie is the EventSource's credential
        first = page.evaluate(READ, ["/tasks/z:stream?kind=chunk", 300])
        assert [i for _, i in first["got"]] == list(range(1, 301)) and first["end"] is None
        last = first["got"][-1][0]
        rest = page.evaluate(READ, [f"/tasks/z:stream?kind=chunk&after={last}", 0])
        context.close()
    assert [i for _, i in rest["got"]] == list(range(301, 1001))  # none lost, none twice
    ids = [seq for seq, _ in rest["got"]]
    assert ids == sorted(set(ids)) and ids[0] > last
    assert rest["end"] == {"status": "succeeded"}


def test_the_task_page_shows_progress_and_the_live_log(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    client.publish("chatter", "report/7", {"count": 3000, "every_ms": 20})
    out = shots_dir(tmp_path)
    with (
        worker_process(mongo_uri, db_name, "--concurrency", "1"),
        serving(mongo_uri, db_name, token=TOKEN) as url,
    ):
        with contextlib.closing(client.stream("report/7")) as entries:  # awaits the worker
            next(e for e in entries if e.kind == "log" and e.seq > 60)
        for scheme, size, viewport, page in looks(browser, url, TOKEN, *EVERY_LOOK):
            page.goto(url + "/ui/tasks/report/7")
            expect(page.locator("#progress")).to_contain_text(re.compile(r"chunk \d+ of 3000"))
            expect(page.locator("#progress [role=progressbar]")).to_be_visible()
            expect(page.locator("ol.log")).to_contain_text("chunks so far i=")
            expect(page.locator("ol.log")).to_contain_text('{"i": ')
            expect(page.locator("#output-counts")).to_contain_text(
                re.compile(r"\d+ lines, \d+ chunks")
            )
            expect(page.locator("#runs")).to_contain_text("lines")
            refresh = page.locator("noscript meta[http-equiv=refresh]")
            assert refresh.count() == 1  # live without JavaScript while the task is open
            kept(page, out, "dashboard-task-output", scheme, size, viewport)
        client.cancel("report/7")
