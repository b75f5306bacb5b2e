"""The claim path without MongoDB: a ``Claimer`` with a scripted driver, a real ``ClaimQueue``,
``InFlight``, a ``Finder`` (as its queue sink), ``LimitGate`` and ``SlotReleases``."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import pytest
from finders import finder_for
from pymongo.errors import ExecutionTimeout, WriteError
from pymongo.results import UpdateResult
from scripted import AsyncScriptedDriver, Step

from mtask import store
from mtask.clock import Clock, FixedClock
from mtask.driver import MODIFY_ONCE, AsyncDriver, Call
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.claiming.ahead import FixedAhead
from mtask.worker.claiming.claim_calls import ClaimCalls
from mtask.worker.claiming.claimer import Claimer
from mtask.worker.claiming.gate import LimitGate
from mtask.worker.claiming.limited_claims import LimitedClaims
from mtask.worker.claiming.releases import SlotReleases
from mtask.worker.finding.finder import Finder
from mtask.worker.inflight import InFlight
from mtask.worker.presence import Assignment
from mtask.worker.running.recorder import OutcomeRecorder
from mtask.worker.stats import WorkerStats
from mtask.worker.worker_events import Emitter

NOW = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
TOO_LARGE = 17419  # "Resulting document after update is larger than 16777216"


def updated(n: int) -> UpdateResult:
    return UpdateResult({"n": n, "nModified": n, "ok": 1.0}, acknowledged=True)


def too_large() -> WriteError:
    return WriteError("Resulting document after update is larger than 16777216", TOO_LARGE, {})


class Started:
    """Stands in for the ``Executor`` (the claimer's ``RunStarter``): records the runs the
    claimer starts; outcomes and slots go to a real ``OutcomeRecorder``."""

    def __init__(self, inflight: InFlight, recorder: OutcomeRecorder) -> None:
        self.recorder = recorder
        self.docs: list[dict[str, Any]] = []
        self.busy_when_started: list[bool] = []
        self.sent: list[float] = []
        """When each run's local deadline counts from (``Executor.start``'s ``sent``)."""
        self.inflight = inflight

    def start(self, doc: dict[str, Any], sent: float, slot: Any = None, tokens: Any = None) -> None:
        self.busy_when_started.append(self.inflight.busy(doc["_id"]))
        self.docs.append(doc)
        self.sent.append(sent)

    @property
    def unwritten(self) -> int:
        return self.recorder.unwritten

    def give_back(self, slot: str, run_id: str) -> None:
        self.recorder.release_slot(slot, run_id)


class TickingClock:
    """Each read a millisecond after the last, noting when (monotonic) it was read."""

    def __init__(self, start: dt.datetime) -> None:
        self.value = start
        self.read_at: dict[dt.datetime, float] = {}

    def now(self) -> dt.datetime:
        self.value += dt.timedelta(milliseconds=1)
        self.read_at[self.value] = time.monotonic()
        return self.value


class Running:
    state = "running"

    def stop(self, immediate: bool = False) -> None:
        raise AssertionError("not expected")


def build(
    driver: AsyncScriptedDriver, clock: Clock | None = None
) -> tuple[Claimer, Finder, Started]:
    clock = clock or FixedClock(NOW)
    adriver = cast(AsyncDriver, driver)
    inflight, queue, wake = InFlight(), ClaimQueue(100), asyncio.Event()
    assignment = Assignment(("add",))
    watcher = finder_for(
        adriver,
        clock,
        ["add"],
        queue=queue,
        in_flight=inflight.busy,
        wake=wake.set,
        assignment=assignment,
    )
    gate = LimitGate(adriver, "w1", clock, watcher)
    releases = SlotReleases(adriver, clock, gate)
    recorder = OutcomeRecorder(
        adriver,
        clock,
        releases=releases,
        sink=watcher,
        inflight=inflight,
        emit=Emitter(),
        wake=wake,
    )
    started = Started(inflight, recorder)
    calls = ClaimCalls(adriver, clock, worker_id="w1", ignore=watcher.ignore)
    stats = WorkerStats()
    shared: dict[str, Any] = {  # the collaborators both the claimer and its claims use
        "gate": gate, "sink": watcher, "inflight": inflight, "runs": started, "stats": stats,
        "wake": wake,
    }  # fmt: skip
    limited_claims = LimitedClaims(adriver, calls, clock, releases=releases, **shared)
    claimer = Claimer(
        clock, calls, limited_claims, concurrency=10, ahead=FixedAhead(0), queue=queue,
        assignment=assignment, lifecycle=Running(), **shared,
    )  # fmt: skip
    return claimer, watcher, started


def placement(key: str, claim_at: dt.datetime) -> dict[str, Any]:
    return {
        "_id": key,
        "name": "add",
        "next_claim_at": claim_at,
        "status": "pending",  # read by store.placeable
        "options": {},
        "well_formed": True,
    }


async def test_a_bad_document_is_isolated_and_marked_invalid() -> None:
    """A batch claim fails on one document's write error: the claimer reads what the batch
    took anyway (nothing), claims the keys one by one, runs the good one, marks the bad one
    invalid, and does not queue it again."""
    driver = AsyncScriptedDriver(
        Step("update_many", raises=too_large()),  # the batch claim (lean stage)
        Step("find", reply=[]),  # adopt: the failed write took nothing
        Step("update_many", reply=updated(1)),  # isolate "good"
        Step("find", reply=[{"_id": "good", "claim_run_id": "r1"}]),
        Step("update_many", raises=too_large()),  # isolate "bad": its own write error
        Step("update_many", reply=updated(1), check=lambda c: "invalid_reason" in str(c.args)),
        Step("find", reply=[]),  # requeue the missed "bad": it is invalid now, not open
    )
    claimer, watcher, started = build(driver)
    await claimer.claim(["good", "bad"], ["add"], NOW)
    assert driver.done
    assert [d["_id"] for d in started.docs] == ["good"]
    assert started.busy_when_started == [True]  # claiming until its run started
    assert not claimer.inflight.busy("good") and "bad" not in watcher.placement.queue
    assert claimer.stats.claimed == 1


async def test_a_bad_document_that_cannot_be_marked_is_ignored_from_then_on() -> None:
    driver = AsyncScriptedDriver(
        Step(MODIFY_ONCE, raises=too_large()),  # a claim of one key
        Step("find", reply=[]),
        Step("update_many", raises=too_large()),  # isolate "full"
        Step("update_many", raises=too_large()),  # quarantine cannot write it either
        Step("find", reply=[placement("full", NOW - dt.timedelta(seconds=1))]),
    )
    claimer, watcher, started = build(driver)
    await claimer.claim(["full"], ["add"], NOW)
    assert driver.done and started.docs == []
    watcher.scanner.place_safely(placement("full", NOW))  # a later event or scan
    assert "full" not in watcher.placement.queue


async def test_missed_keys_are_requeued_only_if_they_were_not_due() -> None:
    """A key the claim did not get goes back in the queue only if it was not claimable yet
    when the claim was sent (our clock may be early); a due one has another owner."""
    later = NOW + dt.timedelta(seconds=5)
    driver = AsyncScriptedDriver(
        Step("update_many", reply=updated(1)),
        Step("update_many", reply=updated(0)),
        Step("find", reply=[{"_id": "mine", "claim_run_id": "r1"}]),
        Step("find", reply=[placement("taken", NOW), placement("early", later)]),
    )
    claimer, watcher, started = build(driver)
    await claimer.claim(["mine", "taken", "early"], ["add"], NOW)
    assert driver.done and [d["_id"] for d in started.docs] == ["mine"]
    assert "taken" not in watcher.placement.queue
    assert (
        "early" in watcher.placement.queue
        and watcher.placement.queue.entries["early"].claim_at == later
    )


def outcome_event(key: str, claim_at: dt.datetime) -> dict[str, Any]:
    """Another writer's update of ``key`` as a worker's own stream shows it."""
    return {
        "operationType": "update",
        "ns": {"db": "mtask", "coll": "tasks"},
        "documentKey": {"_id": key},
        "updateDescription": {"updatedFields": {"next_claim_at": claim_at}},
    }


async def test_an_event_heard_during_a_claim_that_missed_queues_the_key_again() -> None:
    """A claim is sent while the task's previous run is being recorded: it misses (the run
    still holds the task), and the outcome's event (a retry due at once) arrives while the claim
    is on its way, when the key is in flight and the event cannot queue it. The re-read shows
    the task due: without the event, a due key that missed is another's and waits for the sweep;
    with it, it is queued for one more claim. A second miss with no event in between is final."""
    heard: list[Finder] = []

    def outcome_during_claim(call: Call) -> None:
        heard[0].on_change(outcome_event("odd", NOW))
        assert "odd" not in heard[0].placement.queue  # in flight: not queued by the event

    driver = AsyncScriptedDriver(
        Step(MODIFY_ONCE, reply=None, check=outcome_during_claim),  # a claim of one key
        Step("find", reply=[placement("odd", NOW)]),  # pending, due: the retry
        Step(MODIFY_ONCE, reply=None),  # taken by another in between
        Step("find", reply=[placement("odd", NOW)]),
    )
    claimer, watcher, started = build(driver)
    heard.append(watcher)
    watcher.placement.place(placement("odd", NOW - dt.timedelta(seconds=1)))
    watcher.placement.queue.discard("odd")  # taken from the queue to be claimed
    await claimer.claim(["odd"], ["add"], NOW)
    assert watcher.placement.queue.entries["odd"].claim_at == NOW  # one more claim
    watcher.placement.queue.discard("odd")
    await claimer.claim(["odd"], ["add"], NOW)
    assert driver.done and started.docs == []
    assert "odd" not in watcher.placement.queue  # no event: another's, as before


async def test_a_key_that_changed_during_its_claim_and_is_no_longer_ours_is_said_missed() -> None:
    """The task changed while the claim was on its way, and its re-read shows it due but no
    longer this worker's (it names another worker now): it is not queued, and it is said to be
    missed, as a due key that did not change is (a relay hands it to another)."""
    driver = AsyncScriptedDriver(
        Step("find", reply=[{**placement("k", NOW), "options": {"specific_worker_ids": ["w2"]}}]),
    )
    claimer, watcher, _ = build(driver)
    watcher.placement.place(placement("k", NOW))
    with claimer.inflight.claiming(["k"]):
        watcher.on_change(outcome_event("k", NOW))
    found = await watcher.requeue_found(["k"], later_than=NOW)
    assert driver.done and found is not None
    assert (found.held, found.missed, found.gone) == ([], ["k"], [])
    assert "k" not in watcher.placement.queue and watcher.known("k") is None


async def test_a_failed_claim_call_puts_its_keys_back_shortly() -> None:
    """Not a document's fault (MongoDB away): what the call took is read back; nothing was,
    so the keys wait a second in the queue."""
    from pymongo.errors import AutoReconnect

    driver = AsyncScriptedDriver(
        Step("update_many", raises=AutoReconnect("primary stepped down")),
        Step("find", reply=[]),
    )
    claimer, watcher, started = build(driver)
    await claimer.claim(["a", "b"], ["add"], NOW)
    assert driver.done and started.docs == []
    assert {k: e.claim_at for k, e in watcher.placement.queue.entries.items()} == {
        "a": NOW + dt.timedelta(seconds=1),
        "b": NOW + dt.timedelta(seconds=1),
    }
    assert not claimer.inflight.busy("a")


async def test_a_claim_that_ran_out_of_time_kills_stale_transactions() -> None:
    """A claim waited for an open transaction on a task document (a run frozen between its
    fenced SUCCESS and its commit) until its time limit: the claimer reads the RUNNING runs
    whose lease ended among its keys and kills the sessions they recorded."""
    expired = NOW - dt.timedelta(seconds=1)
    runs = [
        {"state": "TIMEOUT", "lease_expires_at": expired, "txn": "old"},  # killed at takeover
        {"state": "RUNNING", "lease_expires_at": expired, "txn": "frozen"},
        {"state": "RUNNING", "lease_expires_at": NOW + dt.timedelta(seconds=5), "txn": "alive"},
    ]
    driver = AsyncScriptedDriver(
        Step("update_many", raises=ExecutionTimeout("operation exceeded time limit", 50)),
        Step("find", reply=[]),  # adopt: the batch took nothing
        Step("find", reply=[{"_id": "a", "runs": runs}], check=lambda c: "$elemMatch" in str(c)),
        Step("command", check=lambda c: c.args == ("killSessions", [{"id": "frozen"}])),
    )
    claimer, watcher, started = build(driver)
    await claimer.claim(["a", "b"], ["add"], NOW)
    assert driver.done and started.docs == []
    assert "a" in watcher.placement.queue and "b" in watcher.placement.queue  # tried again shortly


def claim_time(into: list[dt.datetime]) -> Callable[[Call], None]:
    """A ``Step`` check noting the server time a claim's filter claims at."""

    def note(call: Call) -> None:
        into.append(call.args[0]["next_claim_at"]["$lte"])

    return note


async def test_a_runs_local_deadline_counts_from_before_its_claims_time_was_read() -> None:
    """The claim's leases end at its time + their timeout (on the server's clock), the run's
    local deadline at ``sent`` + its timeout (this process's): ``sent`` must be no later than
    the moment the claim's time was read, however long the claimer held the keys before."""
    clock = TickingClock(NOW)
    at: list[dt.datetime] = []
    driver = AsyncScriptedDriver(
        Step("update_many", reply=updated(2), check=claim_time(at)),
        Step(
            "find", reply=[{"_id": "a", "claim_run_id": "r1"}, {"_id": "b", "claim_run_id": "r2"}]
        ),
    )
    claimer, _, started = build(driver, clock)
    await claimer.claim(["a", "b"], ["add"], NOW)  # found due at NOW, claimed later
    assert driver.done and len(started.sent) == 2 and len(at) == 1
    assert at[0] in clock.read_at, "the claim's time was read for the claim"
    assert all(sent <= clock.read_at[at[0]] for sent in started.sent)


async def test_a_limited_runs_local_deadline_counts_from_before_its_claims_time_was_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same for a batch of limited keys, claimed beside the main loop once its slots are
    taken: its time is read when the batch begins, not when its keys were found due."""
    clock = TickingClock(NOW)
    batch = uuid.UUID(int=7)
    monkeypatch.setattr(uuid, "uuid4", lambda: batch)
    run_id = store.run_id_for(batch.hex, "k")
    at: list[dt.datetime] = []
    driver = AsyncScriptedDriver(
        Step("bulk_write", collection="limits"),  # the slot, taken
        Step(
            "find",
            collection="limits",
            reply=[{"_id": "add", "concurrency": 2, "holders": [{"run_id": run_id}]}],
        ),
        Step(
            MODIFY_ONCE,
            reply={"_id": "k", "name": "add", "runs": [{"run_id": run_id}]},
            check=claim_time(at),
        ),
    )
    claimer, watcher, started = build(driver, clock)
    claimer.gate.limited = {"add": {"_id": "add", "concurrency": 2}}
    watcher.scanner.place_safely(placement("k", NOW))
    await claimer.limited.claim(["k"], ["add"], NOW)
    assert driver.done and [d["_id"] for d in started.docs] == ["k"] and len(at) == 1
    assert at[0] in clock.read_at, "the claim's time was read for the batch"
    assert started.sent[0] <= clock.read_at[at[0]]


async def test_a_claim_that_leaves_half_of_an_overflowed_queue_asks_for_a_top_up() -> None:
    """The top-up is asked for as the claim goes out, so the queue is read on from where it
    left tasks out while the claims go on from what is left (``Scanner.top_up``)."""
    claimer, watcher, _ = build(AsyncScriptedDriver())
    queue = watcher.placement.queue
    for i in range(100):
        watcher.scanner.place_safely(placement(f"k{i:03}", NOW))
    queue.note_overflow(NOW, "k100")
    claimed: list[list[str]] = []

    async def claim(keys: list[str], names: list[str], now: dt.datetime) -> None:
        claimed.append(keys)

    claimer.claim = claim  # type: ignore[method-assign]
    claimer.concurrency = 50
    assert await claimer.run_once() == (True, None)
    assert claimed[0][:2] == ["k000", "k001"] and len(queue) == 50
    assert watcher.scanner.top_up_requested.is_set()


async def test_no_top_up_is_asked_for_while_more_than_half_is_left() -> None:
    claimer, watcher, _ = build(AsyncScriptedDriver())
    for i in range(100):
        watcher.scanner.place_safely(placement(f"k{i:03}", NOW))
    watcher.placement.queue.note_overflow(NOW, "k100")

    async def claim(keys: list[str], names: list[str], now: dt.datetime) -> None:
        return None

    claimer.claim = claim  # type: ignore[method-assign]
    assert await claimer.run_once() == (True, None)  # 10 of 100 taken
    assert not watcher.scanner.top_up_requested.is_set()


def claims_made(claimer: Claimer) -> list[list[str]]:
    claimed: list[list[str]] = []

    async def claim(keys: list[str], names: list[str], now: dt.datetime) -> None:
        claimed.append(keys)

    claimer.claim = claim  # type: ignore[method-assign]
    return claimed


async def test_the_claimer_claims_ahead_as_many_as_it_is_allowed() -> None:
    claimer, watcher, _ = build(AsyncScriptedDriver())
    claimer.ahead = FixedAhead(5)
    for i in range(30):
        watcher.scanner.place_safely(placement(f"k{i:03}", NOW))
    claimed = claims_made(claimer)
    assert await claimer.run_once() == (True, None)
    assert len(claimed[0]) == 15  # its 10 slots and 5 ahead
    assert claimer.capacity() == 15 - 15  # the 15 due keys it still holds are its own


async def test_outcomes_on_their_way_hold_the_claims_past_the_slots_and_the_runs_ahead() -> None:
    """Backpressure counts the runs claimed ahead: a batch of slots + ahead runs that ended
    does not stop the next claim while its outcomes are written."""
    claimer, watcher, started = build(AsyncScriptedDriver())
    claimer.ahead = FixedAhead(10)
    for i in range(30):
        watcher.scanner.place_safely(placement(f"k{i:03}", NOW))
    claimed = claims_made(claimer)
    started.recorder.writing = 20  # slots + ahead: not more
    assert await claimer.run_once() == (True, None) and len(claimed[0]) == 20
    started.recorder.writing = 21
    assert await claimer.run_once() == (False, None) and len(claimed) == 1


async def test_the_runs_of_a_batch_start_in_the_queues_order() -> None:
    """The server returns a batch's documents in its own order; with runs claimed ahead, the
    first started take the slots, so they start in the order the queue gave the keys."""
    driver = AsyncScriptedDriver(
        Step("update_many", reply=updated(3)),
        Step(
            "find",
            reply=[
                {"_id": "a", "claim_run_id": "r1"},
                {"_id": "b", "claim_run_id": "r2"},
                {"_id": "c", "claim_run_id": "r3"},
            ],
        ),
    )
    claimer, _, started = build(driver)
    await claimer.claim(["c", "a", "b"], ["add"], NOW)
    assert driver.done and [d["_id"] for d in started.docs] == ["c", "a", "b"]
