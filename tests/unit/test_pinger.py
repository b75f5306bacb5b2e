"""The lease pinger's rules without MongoDB: how often a run is pinged, and never after its
lease has run out by this process's clock."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import cast

from harness import T0
from hypothesis import given
from hypothesis import strategies as st
from scripted import ScriptedDriver, Step

from mtask.clock import FixedClock
from mtask.driver import MODIFY_ONCE, Call, SyncDriver
from mtask.worker.running.pinger import LeasePinger, ping_every


def test_a_lease_past_its_local_deadline_is_never_pinged() -> None:
    """A thawed worker (SIGSTOP past its lease): its pinger thread must not send the ping that
    was due during the freeze. The run has stopped by its own clock (``Deadlines``, and a
    pool child by its deadline); a ping landing now would extend the lease on the server and
    let that run record its outcome after all."""
    driver = ScriptedDriver()  # any call would fail: nothing is scripted
    pinger = LeasePinger(
        cast(SyncDriver, driver), "w1", FixedClock(T0), lambda r, d: None, lambda r, s: None
    )
    now = time.monotonic()
    pinger.add("frozen", "r1", 200, 3000, now - 5.0)  # its lease ended 2 s ago
    pinger.add("alive", "r2", 200, 3000, now)
    frozen, alive = pinger._leases["r1"], pinger._leases["r2"]
    frozen.next_at = alive.next_at = now - 1.0  # both were due during the freeze
    assert pinger._due() == [alive]  # the thread wakes for the live lease only
    pinger._ping(frozen)  # found due just before its deadline passed: skipped
    assert driver.calls == []
    assert pinger.expiry("r1") == now - 2.0  # still there: the loop's timer stops the run


@given(st.integers(50, 3_600_000), st.integers(100, 86_400_000))
def test_a_run_is_pinged_at_least_three_times_a_lease(ping_ms: int, timeout_ms: int) -> None:
    every = ping_every(ping_ms, timeout_ms)
    assert every <= ping_ms / 1000 and every * 3 <= timeout_ms / 1000 * (1 + 1e-12)
    if ping_ms * 3 <= timeout_ms:  # shortened only when the lease is too short for it
        assert every == ping_ms / 1000
    else:
        assert math.isclose(every, timeout_ms / 3000)


def test_the_default_ping_interval_is_shortened_to_a_third_of_a_short_lease() -> None:
    """The task's options say 5 s between pings and a 3 s lease: the lease would run out
    between two pings. The pinger pings every second, from the claim and after each ping (which
    reads the options again)."""
    options = {"options": {"ping_interval_ms": 5000, "worker_timeout_ms": 3000}}
    driver = ScriptedDriver(Step(MODIFY_ONCE, options))
    pinger = LeasePinger(
        cast(SyncDriver, driver), "w1", FixedClock(T0), lambda r, d: None, lambda r, s: None
    )
    pinger.add("k", "r1", 5000, 3000, time.monotonic())
    lease = pinger._leases["r1"]
    assert lease.interval == 1.0
    before = time.monotonic()
    pinger._ping(lease)
    assert driver.done and lease.interval == 1.0 and lease.next_at <= time.monotonic() + 1.0
    assert lease.next_at >= before + 1.0


def test_a_run_granted_only_a_token_takes_a_place_when_its_slot_comes_to_limit_runs() -> None:
    """A run taken under a rate alone holds no place among the slot's holders. Its pings ask
    to join (``slots.extend``'s ``joins``): nothing while the slot limits only a rate; a place
    once a concurrency was added, which it then keeps as any holder — and loses as any holder
    (reported, the run stops) if another run takes it after its lease there ran out."""
    options = {"options": {"ping_interval_ms": 100, "worker_timeout_ms": 30_000}}
    lost: list[tuple[str, str]] = []
    driver = ScriptedDriver()
    pinger = LeasePinger(
        cast(SyncDriver, driver),
        "w1",
        FixedClock(T0),
        lambda r, d: None,
        lambda r, s: lost.append((r, s)),
    )
    pinger.add("k", "r1", 100, 30_000, time.monotonic(), slots=("n",), tokens=frozenset({"n"}))
    lease = pinger._leases["r1"]

    def joins(call: Call) -> None:
        assert "$or" in call.args[0] and isinstance(call.args[1], list)  # the pipeline update

    def keeps(call: Call) -> None:
        assert call.args[0] == {"_id": "n", "holders.run_id": "r1"}

    def ping(*slot_steps: Step) -> None:
        driver.expect(Step(MODIFY_ONCE, options), *slot_steps)
        pinger._ping(lease)
        assert driver.done

    ping(Step("update_one", SimpleNamespace(matched_count=0), collection="limits", check=joins))
    assert lease.joins == {"n"} and not lost  # a rate alone: goes on, holding no place
    ping(Step("update_one", SimpleNamespace(matched_count=1), collection="limits", check=joins))
    assert lease.joins == set() and not lost  # a concurrency now: it took a place
    ping(
        Step("update_one", SimpleNamespace(matched_count=0), collection="limits", check=keeps),
        Step("find_one", {"_id": "n", "concurrency": 1.0}, collection="limits"),
    )
    assert lost == [("r1", "n")] and "r1" not in pinger._leases
