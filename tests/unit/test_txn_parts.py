"""Parts of transactional runs under faults without MongoDB: which earlier sessions a takeover
kills, and the pinger leaving a run alone while its transaction is open."""

from __future__ import annotations

import time
from typing import Any, cast

from harness import T0
from scripted import ScriptedDriver, Step

from mtask.clock import FixedClock
from mtask.driver import MODIFY_ONCE, SyncDriver
from mtask.store.transactional import stale_sessions
from mtask.worker.running.pinger import LeasePinger


def test_a_takeover_kills_the_sessions_of_expired_runs_only() -> None:
    runs: list[Any] = [
        {"run_id": "r1", "state": "TIMEOUT", "txn": "s1"},
        {"run_id": "r2", "state": "FAIL", "txn": "s2"},  # ended by its own worker: aborted
        {"run_id": "r3", "state": "TIMEOUT"},  # not transactional
        {"run_id": "r4", "state": "RUNNING", "txn": None},  # this run: nothing recorded yet
        "not a run",
        {"run_id": "r5", "state": "TIMEOUT", "output_txn": "o5"},  # its output's session
        {"run_id": "r6", "state": "SUCCESS", "output_txn": "o6"},  # ended by its own worker
        {"run_id": "r7", "state": "TIMEOUT", "txn": "s7", "output_txn": "o7"},
    ]
    assert stale_sessions(runs, "r4") == ["s1", "o5", "s7", "o7"]
    assert stale_sessions(None, "r4") == []


def test_the_pinger_leaves_a_paused_run_alone_until_resumed() -> None:
    driver = ScriptedDriver()  # any call would fail: nothing is scripted
    pinger = LeasePinger(
        cast(SyncDriver, driver), "w1", FixedClock(T0), lambda r, d: None, lambda r, s: None
    )
    claim_sent = time.monotonic()
    pinger.add("k", "r1", 200, 5000, claim_sent)
    lease = pinger._leases["r1"]
    pinger.pause("r1")
    pinger._ping(lease)  # found due just before the pause: skipped
    assert driver.calls == []
    sent = claim_sent + 1.0  # the run's own lease-extending write (begin_run_transaction)
    assert pinger.held("r1", sent) == sent + 5.0 == pinger.expiry("r1")
    assert pinger.held("gone", sent) is None
    pinger.resume("r1")
    assert not lease.paused and lease.next_at <= time.monotonic()  # pinged again at once


def test_the_pinger_tells_a_runs_watchers_each_renewal() -> None:
    """How a process-isolated run's child learns its lease deadline: now, after
    each ping, and after the run's own lease-extending write; not after ``unwatch``."""
    options = {"options": {"ping_interval_ms": 200, "worker_timeout_ms": 5000}}
    driver = ScriptedDriver(Step(MODIFY_ONCE, options))
    pinger = LeasePinger(
        cast(SyncDriver, driver), "w1", FixedClock(T0), lambda r, d: None, lambda r, s: None
    )
    claim_sent = time.monotonic()
    pinger.add("k", "r1", 200, 5000, claim_sent)
    seen: list[float] = []
    unwatch = pinger.watch("r1", seen.append)
    assert seen == [claim_sent + 5.0]
    before = time.monotonic()
    pinger._ping(pinger._leases["r1"])
    assert driver.done and len(seen) == 2 and seen[1] >= before + 5.0
    assert seen[1] == pinger.expiry("r1")
    sent = time.monotonic() + 1.0
    pinger.held("r1", sent)
    assert seen[2] == sent + 5.0
    unwatch()
    pinger.held("r1", sent + 1.0)
    assert len(seen) == 3
    assert pinger.watch("gone", seen.append)() is None and len(seen) == 3
