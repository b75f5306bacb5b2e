"""The host's dispatcher without MongoDB: credit, one subscriber a key, names and
``specific_worker_ids``, keys given back, what the subscribers report, and what the relay's
stream shows of their claims and successes (their ``last_write`` tags)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask.clock import FixedClock
from mtask.driver import AsyncDriver
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding.placement import Placement, WorkerScope
from mtask.worker.finding.shared import credit
from mtask.worker.finding.shared.credit import Account
from mtask.worker.finding.shared.dispatch import Dispatcher
from mtask.worker.presence import Assignment

NOW = dt.datetime(2046, 3, 1, 12, 0, tzinfo=dt.UTC)


class Channel:
    def __init__(self) -> None:
        self.handed: list[list[Any]] = []

    def dispatch(self, entries: list[list[Any]]) -> None:
        self.handed += entries

    def got(self) -> list[str]:
        return [e[0] for e in self.handed]


def build() -> tuple[Dispatcher, FixedClock]:
    clock = FixedClock(NOW)
    d = Dispatcher.build(
        cast(AsyncDriver, None), clock, new_queue=lambda: ClaimQueue(1000), sweep_interval=30.0
    )
    return d, clock


def account(d: Dispatcher, channel: Channel) -> Account:
    found = d.accounts.get(channel)
    assert found is not None
    return found


def task(key: str, name: str = "n", **options: Any) -> dict[str, Any]:
    return {"_id": key, "name": name, "status": "pending", "next_claim_at": NOW, "options": options}


def change(key: str, claim_at: dt.datetime | None, tag: str | None = None) -> dict[str, Any]:
    """An update's event as the relay's stream projects it (``stream_pipeline``)."""
    fields: dict[str, Any] = {"next_claim_at": claim_at}
    if tag is not None:
        fields["last_write"] = tag
    return {
        "operationType": "update",
        "documentKey": {"_id": key},
        "updateDescription": {"updatedFields": fields},
    }


def claimed(key: str, worker: str, lease: dt.datetime) -> dict[str, Any]:
    return change(key, lease, f"claim:{worker}")


def succeeded(key: str, worker: str, claim_at: dt.datetime | None = None) -> dict[str, Any]:
    return change(key, claim_at, f"success:{worker}")


def test_each_due_key_goes_to_one_subscriber_with_credit_in_turn() -> None:
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 2)
    d.add(b, "b", ["n"], 1)
    for i in range(5):
        d.host.place(task(f"k{i}"))
    assert d.hand_out(NOW) == 3  # all the credit there is
    assert sorted(a.got() + b.got()) == ["k0", "k1", "k2"]
    assert len(a.handed) == 2 and len(b.handed) == 1  # round robin, within each one's credit
    assert set(d.awaiting) == {"k0", "k1", "k2"} and len(d.host.queue) == 2
    assert d.hand_out(NOW) == 0  # no credit left: the rest waits in the host queue
    d.report(a, free=1, got=2, done=0)  # a took its two; one slot free
    assert d.hand_out(NOW) == 1 and a.got()[-1] in ("k3", "k4")
    assert a.handed[0][1:] == ["n", 0, None, None]  # name, priority, worker_timeout_ms, group


def test_the_relays_own_worker_is_handed_keys_first_while_it_has_credit() -> None:
    """A subscriber in the relay's own process (``near``) costs the server no hand-out: it
    takes what it has credit for, and only the rest goes round the others."""
    d, _ = build()
    a, near, b = Channel(), Channel(), Channel()
    d.add(a, "a", ["n"], 5)
    d.add(near, "near", ["n", "m"], 2, near=True)
    d.add(b, "b", ["n"], 5)
    for i in range(6):
        d.host.place(task(f"k{i}"))
    assert d.hand_out(NOW) == 6
    assert len(near.handed) == 2  # all its credit
    assert len(a.handed) == 2 and len(b.handed) == 2  # the rest in turn
    d.report(near, free=2, got=2, done=2)  # its two succeeded: two slots again
    d.host.place(task("k6"))
    d.host.place(task("k7", "m"))  # a name only it runs
    assert d.hand_out(NOW) == 2 and near.got()[-2:] == ["k6", "k7"]
    d.report(near, free=0, got=4, done=2)
    d.host.place(task("k8"))
    assert d.hand_out(NOW) == 1 and a.got()[-1] == "k8"  # no credit left near: the next in turn
    d.remove(near)
    assert d.accounts.near == []


def test_credit_counts_what_is_on_its_way() -> None:
    d, _ = build()
    a = Channel()
    d.add(a, "a", ["n"], 2)
    for i in range(4):
        d.host.place(task(f"k{i}"))
    d.hand_out(NOW)
    d.report(a, free=2, got=0, done=0)  # said before it got the two: they still count
    assert account(d, a).credit == 0 and d.hand_out(NOW) == 0
    d.report(a, free=2, got=2, done=0)  # got them, and has two more slots
    assert d.hand_out(NOW) == 2


def test_a_subscribers_successes_in_the_stream_give_its_slots_back() -> None:
    d, _ = build()
    a = Channel()
    d.add(a, "a", ["n"], 2)
    for i in range(6):
        d.host.place(task(f"k{i}"))
    assert d.hand_out(NOW) == 2 and account(d, a).credit == 0
    lease = NOW + dt.timedelta(seconds=30)
    for key in a.got():
        d.on_change(claimed(key, "a", lease))
    assert account(d, a).credit == 0 and d.hand_out(NOW) == 0  # a claim changes no credit
    d.on_change(succeeded("k0", "a"))
    assert account(d, a).credit == 1 and d.hand_out(NOW) == 1  # nothing said: a slot back
    d.on_change(succeeded("k1", "b-elsewhere"))  # not a subscriber's: nobody's credit
    assert account(d, a).credit == 0
    d.on_change(claimed("k1", "a", lease))  # (the stream said nothing of its earlier claim)
    # a report counts the successes it says it had recorded (done): one whose event came
    # before it is not counted twice, nor is one whose event comes after it
    d.on_change(succeeded("k1", "a"))  # the stream showed it: +1
    d.report(a, free=2, got=3, done=2)  # counted it too (and k0): no double count
    assert account(d, a).credit == 2 - (3 - 3) + 0
    d.report(a, free=1, got=3, done=3)  # counted a success whose event has not come yet
    d.on_change(claimed("k2", "a", lease))
    d.on_change(succeeded("k2", "a"))  # ... here it is: already in `free`
    assert account(d, a).credit == 1


def test_a_sync_makes_the_counts_agree_and_a_dead_subscriber_still_goes_silent() -> None:
    d, _ = build()
    a = Channel()
    d.add(a, "a", ["n"], 1)
    lease = NOW + dt.timedelta(seconds=30)
    d.host.place(task("k"))
    d.hand_out(NOW)
    d.report(a, free=0, got=1, done=5)  # (its counts, whatever they are)
    d.on_change(claimed("k", "a", lease))
    d.on_change(succeeded("k", "a"))
    assert account(d, a).seen == 1 and account(d, a).credit == 0  # counted short: 1 < 6
    d.report(a, free=1, got=1, done=6, sync=True)  # free, handed nothing for a look: sync
    assert account(d, a).seen == 6 and account(d, a).credit == 1
    # heard through its events while busy, then handed more and never heard again: silent
    d.host.place(task("j"))
    d.hand_out(NOW)
    d.on_change(claimed("j", "a", lease))
    d.on_change(succeeded("j", "a"))
    assert account(d, a).unacked_since is None
    d.host.place(task("dead"))
    assert d.hand_out(NOW) == 1
    since = account(d, a).unacked_since
    assert since is not None and d.accounts.silent(since + credit.SILENT_SUBSCRIBER + 1) == [a]


def test_names_and_specific_workers_decide_who_may_take_a_key() -> None:
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 5)
    d.add(b, "b", ["m"], 5)
    d.host.place(task("for-b", "m"))
    d.host.place(task("only-a", specific_worker_ids=["a"]))
    d.host.place(task("nobody-here", specific_worker_ids=["elsewhere"]))
    assert d.host.known("nobody-here") is None  # no subscriber may run it: not queued
    d.hand_out(NOW)
    assert a.got() == ["only-a"] and b.got() == ["for-b"]


def test_a_key_nobody_with_credit_may_take_stays_queued() -> None:
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 5)
    d.add(b, "b", ["m"], 0)
    d.host.place(task("for-b", "m"))
    assert d.hand_out(NOW) == 0 and "for-b" in d.host.queue
    assert d.run_once() is None  # stuck: no busy loop, waits for a change
    d.report(b, free=1, got=0, done=0)
    assert d.hand_out(NOW) == 1 and b.got() == ["for-b"]


def test_a_key_not_claimed_in_time_or_whose_subscriber_went_goes_back() -> None:
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 1)
    d.add(b, "b", ["n"], 1)
    d.host.place(task("k0"))
    d.host.place(task("k1"))
    d.hand_out(NOW)
    d.awaiting["k0"] = (d.awaiting["k0"][0], 0.0)  # its time is up
    d.run_once()
    assert d.returned >= 1
    who = d.awaiting.get("k1", (None,))[0]
    d.remove(who.channel if who is not None else a)
    assert "k1" not in d.awaiting and d.returned == 2


def test_what_a_subscriber_claimed_waits_for_its_lease_and_what_it_finished_goes() -> None:
    d, _ = build()
    a = Channel()
    d.add(a, "a", ["n"], 3)
    for key in ("run", "done", "held"):
        d.host.place(task(key))
    d.hand_out(NOW)
    lease = NOW + dt.timedelta(seconds=30)
    d.on_change(claimed("run", "a", lease))  # its claim, in the stream
    assert "run" not in d.awaiting and d.host.queue.entries["run"].claim_at == lease
    d.on_change(claimed("done", "a", lease))
    d.on_change(succeeded("done", "a"))
    d.held("held")
    assert not d.awaiting and set(d.host.queue.entries) == {"run"}
    assert d.host.known("done") is None and d.heard == {"claim": 2, "success": 1}
    assert d.hand_out(lease) == 1 and a.got()[-1] == "run"  # its lease ran out: hand it on


def test_an_event_for_a_handed_key_ends_the_wait() -> None:
    d, _ = build()
    a = Channel()
    d.add(a, "a", ["n"], 1)
    d.host.place(task("k"))
    d.hand_out(NOW)
    d.on_change(claimed("k", "elsewhere", NOW + dt.timedelta(seconds=30)))  # another's claim
    assert not d.awaiting and account(d, a).credit == 0  # a's credit comes back when it says


def test_new_names_or_workers_make_the_host_queue_scan_again() -> None:
    d, _ = build()
    d.add(Channel(), "a", ["n"], 1)
    assert d.host.scanner.rescan_requested.is_set()
    d.host.scanner.rescan_requested.clear()
    d.add(Channel(), "b", ["n"], 1)  # a new worker: tasks may name it
    assert d.host.scanner.rescan_requested.is_set() and d.host.scope.ids == ("a", "b")
    d.host.scanner.rescan_requested.clear()
    c = Channel()
    d.add(c, "c", ["n"], 1)
    d.host.scanner.rescan_requested.clear()
    d.remove(c)  # fewer: nothing new to find
    assert not d.host.scanner.rescan_requested.is_set() and d.host.scope.names == ["n"]


def test_a_subscriber_that_leaves_handed_keys_unacknowledged_is_silent() -> None:
    d, _ = build()
    a, idle = Channel(), Channel()
    d.add(a, "a", ["n"], 1)
    d.add(idle, "idle", ["m"], 1)
    d.host.place(task("k"))
    d.hand_out(NOW)
    handed_at = account(d, a).unacked_since
    assert handed_at is not None and account(d, idle).unacked_since is None
    later = handed_at + credit.SILENT_SUBSCRIBER + 1
    assert d.accounts.silent(later) == [a]  # an idle subscriber is asked nothing
    d.report(a, free=1, got=1, done=0)  # it acknowledged: alive
    assert d.accounts.silent(later) == []
    lease = NOW + dt.timedelta(seconds=30)
    d.on_change(claimed("k", "a", lease))
    d.host.place(task("k2"))
    d.host.place(task("k3"))
    d.report(a, free=2, got=1, done=0)
    d.hand_out(NOW)
    assert account(d, a).unacked_since is not None
    d.on_change(claimed("k2", "a", lease))  # heard through the stream; k3 still on its way
    restarted = account(d, a).unacked_since
    assert restarted is not None and restarted >= handed_at
    d.on_change(claimed("k3", "a", lease))  # nothing left on its way
    assert account(d, a).unacked_since is None and d.accounts.silent(later) == []


def test_a_missed_claim_hands_the_key_to_another_subscriber_not_back() -> None:
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 5)
    d.add(b, "b", ["n"], 5)
    d.host.place(task("k"))
    d.hand_out(NOW)
    first, other = (a, b) if a.got() else (b, a)
    d.missed("k", first)  # e.g. it ran it already (concurrency > 1)
    assert "k" not in d.awaiting and d.hand_out(NOW) == 1
    assert other.got() == ["k"] and first.got() == ["k"]  # not handed to `first` again
    d.missed("k", other)  # nobody here can claim it now: out of the way of the due keys
    d.host.place(task("due"))
    assert d.hand_out(NOW) == 1 and "k" not in d.awaiting
    assert d.host.queue.entries["k"].claim_at > NOW
    d.on_change(change("k", NOW))  # its document changed: anyone may try it again
    assert "k" not in d.refused.by_key


def test_a_task_of_concurrency_two_goes_to_a_second_subscriber() -> None:
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 5)
    d.add(b, "b", ["n"], 5)
    d.host.place(task("k", concurrency=2))
    d.hand_out(NOW)
    first, other = (a, b) if a.got() else (b, a)
    by = account(d, first).worker_id
    d.on_change(claimed("k", by, NOW))  # one slot left, claimable now: for the other one
    d.hand_out(NOW)
    assert other.got() == ["k"] and first.got() == ["k"]
    d.on_change(succeeded("k", by, NOW))  # still open, as its event says: not back to `first`
    meta = d.host.known("k")
    assert meta is not None and meta.multi and "k" in d.host.queue
    assert d.awaiting == {}  # the event ended the wait of the other one too: its claim decides
    d.missed("k", other)  # (say the other could not claim it after all)
    assert "k" in d.host.queue and d.hand_out(NOW) == 0  # both ran or run it: it waits
    assert d.host.queue.entries["k"].claim_at > NOW
    d.gone("k")  # the other's claim found it finished
    assert d.host.known("k") is None and "k" not in d.refused.by_key
    d.host.place(task("one"))
    d.hand_out(NOW)
    d.on_change(succeeded("one", by))  # concurrency 1: finished
    assert d.host.known("one") is None


def test_keys_nobody_with_credit_may_take_do_not_hold_up_the_rest() -> None:
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 2)
    d.add(b, "b", ["n"], 0)  # busy: may run them, cannot take them now
    for key in ("k1", "k2"):
        d.host.place(task(key, priority=9, concurrency=2))
        d.refused.by_key[key] = {account(d, a): float("inf")}  # a ran them already
    d.host.place(task("low"))
    assert d.hand_out(NOW) == 1 and a.got() == ["low"]  # not starved behind k1 and k2
    assert {"k1", "k2"} <= set(d.host.queue.entries)  # waiting for b's credit


def test_a_worker_handed_a_key_it_runs_says_it_missed() -> None:
    placement = Placement(
        ClaimQueue(10),
        WorkerScope("w1", Assignment(("n",))),
        in_flight=lambda key: key == "running",
        wake=lambda: None,
    )
    assert not placement.hand("running", "n", 0, None, NOW)  # a second slot of a task it runs
    assert placement.hand("new", "n", 0, None, NOW)
    assert list(placement.queue.entries) == ["new"]


def test_a_key_whose_hand_over_lapses_goes_to_another_and_its_subscriber_gets_no_more() -> None:
    """A subscriber that stops acknowledging (dead, frozen, cut off: no claim, no word): the key
    handed to it waits less than a second, then goes to another subscriber, and nothing more is
    handed to it until it is heard from again (it waited 5 s, and took new keys)."""
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 2)
    d.add(b, "b", ["n"], 2)
    d.host.place(task("k0"))
    before = time.monotonic()
    assert d.hand_out(NOW) == 1 and a.got() == ["k0"]
    handed_to, until = d.awaiting["k0"]
    assert handed_to is account(d, a) and until - before < 1.0  # it lapses within a second
    d.awaiting["k0"] = (handed_to, 0.0)  # ... and it has: a said nothing, claimed nothing
    d.run_once()
    assert b.got() == ["k0"] and d.awaiting["k0"][0] is account(d, b) and d.returned == 1
    d.host.place(task("k1"))  # a's turn, and credit left: but it is unheard
    assert d.hand_out(NOW) == 1 and b.got() == ["k0", "k1"] and a.got() == ["k0"]
    assert d.stats()["unheard"] == 1
    d.report(a, free=2, got=1, done=0)  # a speaks (its claim of k0 missed, say): heard again
    d.host.place(task("k2"))
    assert d.hand_out(NOW) == 1 and a.got() == ["k0", "k2"]


def test_a_subscriber_unheard_after_its_last_report_is_let_go_not_starved() -> None:
    """A subscriber acknowledged the key it was handed (its report counted it), then said
    nothing of it (its claim came back empty, its re-read failed), and is idle: nothing it does
    would be heard again. Its key lapses and goes to another; it is handed nothing more until
    heard from, and if it is not, it goes silent and is let go (it says hello again): a relay
    whose every subscriber is unheard would otherwise hand nothing out for good."""
    d, _ = build()
    a, b = Channel(), Channel()
    d.add(a, "a", ["n"], 2)
    d.add(b, "b", ["n"], 2)
    d.host.place(task("k0"))
    assert d.hand_out(NOW) == 1 and a.got() == ["k0"]
    d.report(a, free=1, got=1, done=0)  # received: acknowledged, nothing left unacknowledged
    assert account(d, a).unacked_since is None
    handed_to, _ = d.awaiting["k0"]
    d.awaiting["k0"] = (handed_to, 0.0)  # no claim heard in time
    lapsed_at = time.monotonic()
    d.run_once()
    assert b.got() == ["k0"] and account(d, a).room == 0
    d.report(b, free=1, got=1, done=0)  # b acknowledges what it got: not silent
    since = account(d, a).unacked_since
    assert since is not None and since >= lapsed_at
    assert d.accounts.silent(since + credit.SILENT_SUBSCRIBER + 1) == [a]


def test_a_key_said_held_then_missed_is_read_again() -> None:
    """A subscriber said it keeps a key (a limit held it back): the relay forgot it. When its
    next claim of it misses although it was due, the relay reads the task again to hand it to
    another (it cannot place a key it does not know)."""
    d, _ = build()
    a = Channel()
    d.add(a, "a", ["n"], 2)
    d.host.place(task("k"))
    d.hand_out(NOW)
    d.held("k", a)
    assert d.host.known("k") is None
    d.missed("k", a)
    assert "k" in d.host.scanner.unknown  # looked up at the next settle


@given(st.lists(st.floats(min_value=0.0, max_value=60.0), max_size=40))
def test_a_hand_over_lapses_after_half_a_second_unless_every_claim_takes_longer(
    took: list[float],
) -> None:
    """While claims are heard of within milliseconds, a hand-over lapses after
    ``HAND_OVER_TIMEOUT``; while every claim takes longer (an overloaded cluster), it waits
    longer, or each key would be handed twice; never longer than ``HAND_OVER_MOST``."""
    waits = credit.HandOvers()
    a = credit.Account(Channel(), "a", frozenset({"n"}), 1)
    for i, seconds in enumerate(took):
        waits.hand(f"k{i}", a, 100.0)
        waits.heard(f"k{i}", 100.0 + seconds)
        assert credit.HAND_OVER_TIMEOUT <= waits.timeout() <= credit.HAND_OVER_MOST
    assert not waits and not waits.since  # every wait over, nothing kept
    if took and max(took) < 0.05:
        assert waits.timeout() == credit.HAND_OVER_TIMEOUT
    if len(took) >= 20 and min(took) > 1.0:
        assert waits.timeout() > 1.0  # (a key still lapses, only later)


def test_what_a_hand_over_waits_is_learnt_from_the_events_that_end_it() -> None:
    d, _ = build()
    a = Channel()
    d.add(a, "a", ["n"], 10)
    d.host.place(task("k"))
    d.hand_out(NOW)
    handed_at = d.awaiting.since["k"]
    d.awaiting.since["k"] = handed_at - 2.0  # its claim's event comes 2 s after the hand-over
    d.on_change(claimed("k", "a", NOW + dt.timedelta(seconds=30)))
    assert "k" not in d.awaiting and d.awaiting.heard_in is not None
    assert d.awaiting.timeout() > credit.HAND_OVER_TIMEOUT  # the next one waits longer


def test_hand_overs_that_lapse_wait_longer_until_a_claim_is_heard_in_time() -> None:
    """A round that saw lapses doubles the next wait (an overloaded cluster: every claim late);
    a key handed again after a lapse teaches nothing (whose claim is it?); a claim heard in
    time brings the wait back down."""
    waits = credit.HandOvers()
    a = credit.Account(Channel(), "a", frozenset({"n"}), 1)
    waits.hand("k", a, 100.0)
    assert waits.lapsed(100.0 + credit.HAND_OVER_TIMEOUT) == ["k"]
    assert waits.timeout() == 2 * credit.HAND_OVER_TIMEOUT
    waits.pop("k")  # (given back: the dispatcher's)
    waits.hand("k", a, 101.0)  # handed again
    waits.heard("k", 101.9)  # a claim: its first subscriber's, or its second's?
    assert waits.heard_in is None and waits.timeout() == 2 * credit.HAND_OVER_TIMEOUT
    waits.hand("j", a, 102.0)
    waits.heard("j", 102.01)  # heard in time
    assert waits.timeout() == credit.HAND_OVER_TIMEOUT and not waits.since and not waits.retried


async def test_a_stopped_relays_queue_cancels_the_scan_on_its_way(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A relay that stops leaves no scan running on a client its worker then closes (it
    logged "the relay's queue could not scan … AsyncMongoClient after close" at every stop)."""
    d, _ = build()
    host = d.host
    started, never = asyncio.Event(), asyncio.Event()

    async def scanning(requested: bool = False) -> int:
        started.set()
        await never.wait()
        return 0

    host.scanner.rescan = scanning  # type: ignore[method-assign]
    host.idle()
    host.activate()  # a scan at once, in a task of its own
    await started.wait()
    scan = host._scan
    assert scan is not None and not scan.done()
    host.stop()
    await asyncio.gather(scan, return_exceptions=True)
    assert scan.cancelled()
    assert await host.rescan() == 0  # a stopped queue scans nothing more
    assert "could not scan" not in caplog.text
