"""A read token in a real browser (Debian's Chromium, driven by Playwright): a page of another
origin (a second server), allowed by serve's CORS setting, follows one task's output with an
``EventSource`` and the token in its address — every chunk a real worker emits, then ``end`` —
while the same token is refused another task's stream (403) and an expired token is refused
(401). The browser holds no session: the token is its only credential."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import worker_process
from webserver import serving

from mtask import TaskClient
from mtask.embedded import free_port
from mtask.security import read_tokens

SECRET = b"the browser test's read token secret"
FOLLOW = """async (url) => await new Promise((resolve) => {
  const got = [];
  const source = new EventSource(url);
  source.addEventListener("chunk", (e) => got.push(JSON.parse(e.data).data.i));
  source.addEventListener("end", (e) => {
    source.close();
    resolve({ got, end: JSON.parse(e.data) });
  });
  source.addEventListener("error", () => {
    if (source.readyState === EventSource.CLOSED) resolve({ got, end: null, closed: true });
  });
})"""
STATUS = "async (url) => (await fetch(url)).status"


@contextlib.contextmanager
def page_server(root: Path) -> Iterator[str]:
    """A plain page on another port: another origin than serve's."""
    (root / "index.html").write_text("<!doctype html><title>an app</title><p>app</p>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_event_source_follows_one_task_with_a_read_token(
    browser: Any, mongo_uri: str, db_name: str, client: TaskClient, tmp_path: Path
) -> None:
    client.publish("chatter", "mine", {"count": 40, "every_ms": 10})
    client.publish("add", "theirs", {"a": 1, "b": 1})
    token = client.read_token("mine", 600, secret=SECRET)
    expired = read_tokens.sign(SECRET, read_tokens.Scope("task", key="mine"), client.now())
    with (
        page_server(tmp_path) as origin,
        serving(
            mongo_uri, db_name, token="admin", read_secret=SECRET, cors_origins=[origin]
        ) as url,
        worker_process(mongo_uri, db_name, "--concurrency", "2"),
    ):
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(60_000)
        page.goto(origin + "/index.html")
        followed = page.evaluate(FOLLOW, f"{url}/tasks/mine:stream?kind=chunk&token={token}")
        refused = page.evaluate(FOLLOW, f"{url}/tasks/theirs:stream?token={token}")
        statuses = {
            "theirs": page.evaluate(STATUS, f"{url}/tasks/theirs?token={token}"),
            "mine": page.evaluate(STATUS, f"{url}/tasks/mine?token={token}"),
            "expired": page.evaluate(STATUS, f"{url}/tasks/mine?token={expired}"),
            "list": page.evaluate(STATUS, f"{url}/tasks?token={token}"),
        }
        context.close()
    assert followed["got"] == list(range(1, 41)) and followed["end"] == {"status": "succeeded"}
    assert refused["got"] == [] and refused["closed"]
    assert statuses == {"theirs": 403, "mine": 200, "expired": 401, "list": 403}
