"""``mtask serve``'s app on a real port, in a thread, for tests that speak HTTP to it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from mtask.embedded import free_port
from mtask.web import create_app


@contextlib.contextmanager
def serving(
    uri: str, database: str, token: str | None = None, sample_seconds: float = 5.0, **more: Any
) -> Iterator[str]:
    """``more``: other options of ``create_app`` (``tokens``, ``read_secret``, …)."""
    port = free_port()
    app = create_app(uri, database=database, token=token, sample_seconds=sample_seconds, **more)
    config = uvicorn.Config(app, port=port, log_level="warning", lifespan="on", loop="asyncio")
    server = uvicorn.Server(config)  # the loop mtask serve runs on
    thread = threading.Thread(target=server.run, name="mtask-serve-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
