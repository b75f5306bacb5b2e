"""Tasks in every derived state and every blocked reason, made by a real worker
process (``workerapp``, ``--concurrency 3 --prefetch 0``) and the client: the scenario of
``test_states_dashboard.py`` and ``test_states_cli.py``. ``EXPECTED`` is what each task's
state, reason and sentence must say."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mtask import TaskClient

WORKER_ARGS = ("--concurrency", "3", "--prefetch", "0", "--worker-id", "states-worker")
HOUR_MS = 3_600_000

EXPECTED: dict[str, tuple[str, str | None, str]] = {
    # key: (state, why, a part of the sentence)
    "later-1": ("scheduled", None, "scheduled for "),
    "hold-2": ("available", None, "the next free worker of `wait_cancel` claims it"),
    "hold-1": ("running", None, "on `states-worker`"),
    "retry-1": (
        "retrying",
        "backoff",
        "attempt 1 failed: RuntimeError: flaky failure on attempt 1",
    ),
    "order-1": ("waiting", "signal", "waiting for the signal `approved` (step 2: wait:approved)"),
    "nap-1": ("waiting", "sleep", "sleeping until "),
    "dep-1": ("waiting", "dependencies", "waiting for 1 task it depends on: `later-1`"),
    "acme-3": (
        "blocked",
        "group",
        "waiting for group `acme` (sequence): `acme-1` holds it, running ",
    ),
    "sc-2": ("blocked", "limit", "limit of `slow_cleanup`: 1 of 1 runs at once in use"),
    "paused-1": ("blocked", "paused", "`echo` is paused"),
    "img-1": ("blocked", "no_worker", "no live worker handles `resize_image`"),
    "done-1": ("succeeded", None, "succeeded "),
    "flaky-1": ("succeeded", None, "attempt 2 of 4"),
    "fail-1": ("failed", None, "ValueError: this task always fails"),
    "cancel-1": ("cancelled", None, "cancelled "),
    "bad-1": ("invalid", None, "invalid: "),
}


def wait_until(check: Callable[[], Any], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _status(client: TaskClient, key: str) -> str | None:
    task = client.get(key)
    return None if task is None or task.status is None else task.status.value


def before_worker(client: TaskClient) -> None:
    """Limits and the tasks published before the worker starts."""
    client.set_limit("sleep", group_concurrency=1)  # each group a sequence
    client.set_limit("slow_cleanup", concurrency=1)
    client.publish("add", "later-1", {"a": 1, "b": 1}, delay=3600)
    client.publish("add", "dep-1", {"a": 1, "b": 2}, depends_on=["later-1"])
    client.publish("resize_image", "img-1", {"w": 10})
    client.pause("echo")  # before the worker starts: its first heartbeat reads it


def with_worker(client: TaskClient) -> None:
    """Once the worker runs: the tasks that pass through it, then the three that fill its three
    slots, then the ones left behind them."""
    client.publish("await_approval", "order-1", {"order": 1})
    client.publish("nap", "nap-1", {"seconds": 3600})
    client.publish("flaky", "retry-1", {"fail_times": 5}, options={"retry_delay_ms": HOUR_MS})
    client.publish("add", "done-1", {"a": 2, "b": 2})
    client.publish("upstream_step", "flaky-1", {"fail_times": 1})
    client.publish("always_fails", "fail-1", options={"max_retries": 0})
    client.publish("add", "cancel-1", {"a": 1, "b": 1}, delay=3600)
    client.cancel("cancel-1")
    now = client.now()
    client.collection.insert_one(
        {"_id": "bad-1", "name": "add", "status": "pending", "next_claim_at": now}
    )
    wait_until(lambda: _waiting(client, "order-1") and _waiting(client, "nap-1"))
    wait_until(lambda: (client.get("retry-1").failures or 0) >= 1)  # type: ignore[union-attr]
    for key, status in [
        ("done-1", "succeeded"),
        ("flaky-1", "succeeded"),
        ("fail-1", "failed"),
        ("bad-1", "invalid"),
    ]:
        wait_until(lambda key=key, status=status: _status(client, key) == status)
    client.publish("echo", "paused-1", {"x": 1})
    client.publish("wait_cancel", "hold-1")
    client.publish("sleep", "acme-1", {"seconds": 3600}, options={"group": "acme"})
    client.publish("slow_cleanup", "sc-1")
    for key in ("hold-1", "acme-1", "sc-1"):
        wait_until(lambda key=key: _status(client, key) == "running")
    client.publish("wait_cancel", "hold-2")
    for i in (2, 3):
        client.publish("sleep", f"acme-{i}", {"seconds": 1}, options={"group": "acme"})
    client.publish("slow_cleanup", "sc-2")


def _waiting(client: TaskClient, key: str) -> bool:
    task = client.get(key)
    assert task is not None and task.status is not None, key
    assert task.status.value not in ("failed", "cancelled", "invalid"), task
    return task.waiting is not None


def finish(client: TaskClient) -> None:
    """Lets the worker go: the holds cancelled."""
    for key in ("hold-1", "hold-2", "acme-1", "acme-2", "acme-3", "sc-1", "sc-2", "order-1"):
        client.cancel(key)
