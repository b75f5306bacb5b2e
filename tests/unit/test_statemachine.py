"""Property tests of the pure rules, and a check that the server's pipeline agrees with them."""

from __future__ import annotations

import datetime as dt
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pymongo import MongoClient

from mtask.statemachine import backoff_ms, compute_next_claim_at, derive_status, recompute_stages
from mtask.vocabulary import MAX_RUNS_KEPT, RunState, TaskStatus

BASE = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
times = st.integers(min_value=-600_000, max_value=600_000).map(
    lambda ms: BASE + dt.timedelta(milliseconds=ms)
)
runs = st.builds(
    lambda state, lease, wid: {
        "run_id": f"r{wid}-{lease.timestamp()}",
        "worker_id": f"w{wid}",
        "state": state,
        "claimed_at": BASE,
        "lease_expires_at": lease,
    },
    st.sampled_from([s.value for s in RunState]),
    times,
    st.integers(0, 5),
)
docs = st.fixed_dictionaries(
    {
        "status": st.sampled_from([s.value for s in TaskStatus]),
        "options": st.fixed_dictionaries(
            {"concurrency": st.integers(1, 4), "max_retries": st.integers(0, 5)}
        ),
        "successes": st.integers(0, 5),
        "failures": st.integers(0, 7),
        "failed_permanently": st.booleans(),
        "available_at": times,
        "runs": st.lists(runs, max_size=30),
        "waiting_on": st.lists(st.sampled_from(["a", "b"]), max_size=2, unique=True),
    }
)


@given(docs)
def test_status_rules(doc: dict[str, Any]) -> None:
    status = derive_status(doc)
    opts = doc["options"]
    if doc["status"] in ("cancelled", "invalid"):  # sticky: no run's outcome changes them
        assert status.value == doc["status"]
    elif doc["successes"] >= opts["concurrency"]:
        assert status is TaskStatus.SUCCEEDED
    elif doc["failed_permanently"] or doc["failures"] > opts["max_retries"]:
        assert status is TaskStatus.FAILED
    else:
        has_running = any(r["state"] == "RUNNING" for r in doc["runs"])
        assert status is (TaskStatus.RUNNING if has_running else TaskStatus.PENDING)


@given(docs)
def test_next_claim_at_rules(doc: dict[str, Any]) -> None:
    status = derive_status(doc)
    at = compute_next_claim_at(doc, status)
    if status.finished or doc["waiting_on"]:
        assert at is None  # finished, or waiting for a dependency
        return
    assert at is not None and at >= doc["available_at"]
    running = [r for r in doc["runs"] if r["state"] == "RUNNING"]
    if len(running) + doc["successes"] >= doc["options"]["concurrency"]:
        # full: claimable no earlier than the first lease can end
        assert at >= min(r["lease_expires_at"] for r in running)
    else:
        assert at == doc["available_at"]


@given(
    failures=st.integers(1, 200),
    delay=st.integers(0, 10**7),
    factor=st.floats(1.0, 100.0),
    cap=st.integers(0, 10**9),
    seed=st.integers(0, 2**32),
)
def test_backoff_bounds(failures: int, delay: int, factor: float, cap: int, seed: int) -> None:
    rng = random.Random(seed)
    ms = backoff_ms(
        failures, retry_delay_ms=delay, retry_backoff=factor, max_retry_delay_ms=cap, rng=rng
    )
    assert 0 <= ms <= cap
    try:
        exact = min(float(cap), delay * factor ** (failures - 1))
    except OverflowError:
        exact = float(cap)
    assert exact * 0.8 - 1 <= ms <= exact * 1.2 + 1


def test_backoff_grows() -> None:
    kw = {"retry_delay_ms": 100, "retry_backoff": 2.0, "max_retry_delay_ms": 10**6, "jitter": 0}
    assert [backoff_ms(n, **kw) for n in (1, 2, 3, 4)] == [100, 200, 400, 800]  # type: ignore[arg-type]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(doc=docs)
def test_server_pipeline_agrees_with_python(
    mongo: MongoClient[dict[str, Any]], doc: dict[str, Any]
) -> None:
    now = BASE
    result = next(mongo.admin.aggregate([{"$documents": [doc]}, *recompute_stages(now)]))
    running = [r for r in doc["runs"] if r["state"] == "RUNNING"]
    done = [r for r in doc["runs"] if r["state"] != "RUNNING"]
    keep = min(len(done), max(0, MAX_RUNS_KEPT - len(running)))
    expected_runs = (done[len(done) - keep :] if keep else []) + running
    assert [r["run_id"] for r in result["runs"]] == [r["run_id"] for r in expected_runs]
    assert result["runs_folded"] == len(done) - keep
    status = derive_status(doc)
    assert result["status"] == status.value
    assert result["next_claim_at"] == compute_next_claim_at(doc, status)
    assert (result["finished_at"] is None) == (not status.finished)
