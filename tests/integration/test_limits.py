"""Cluster-wide limits: the token bucket rules, the atomic slot/token update on the real server
(injected clock), and in-process workers sharing a limit."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
from typing import Any

import pytest
import workerapp
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from harness import T0, running_worker, wait_for
from hypothesis import given
from hypothesis import strategies as st
from pymongo import MongoClient

from mtask import TaskClient, TaskOptions, store
from mtask.clock import FixedClock
from mtask.driver import Call, Op, SyncDriver
from mtask.errors import InvalidTask
from mtask.limits import rules as mtask_limits
from mtask.limits.rules import (
    MAX_LIMIT_CONCURRENCY,
    NO_ROOM_WAIT,
    Limit,
    group_slot,
    own_limit,
    parse_rate,
    refill,
    runs_at_once,
    wait_for_token,
)
from mtask.limits.slots import Request, Taken
from mtask.registry import Registry
from mtask.store import limits as store_limits
from mtask.store import slots as store_slots
from mtask.store.slots import extend, take
from mtask.worker.claiming.gate import LimitGate


def acquire(
    slot: str, run_id: str, key: str, worker: str, now: dt.datetime, lease_ms: int
) -> Op[Taken]:
    """One run's slot of a name's limit (``store_slots.take`` of one request)."""
    return (yield from take([Request(slot, run_id, key, lease_ms)], worker, now))[0]


def release(slot: str, run_ids: list[str]) -> Op[None]:
    yield from store_slots.release({slot: run_ids})


def slots_doc(slot: str) -> Op[Any]:
    doc = yield Call("find_one", ({"_id": slot},), collection="limits")
    return doc


@given(
    tokens=st.floats(0, 100),
    elapsed_ms=st.integers(-10_000, 10**7),
    rate=st.floats(0.001, 1e5),
    burst=st.integers(1, 1000),
)
def test_refill_stays_within_the_bucket(
    tokens: float, elapsed_ms: int, rate: float, burst: int
) -> None:
    tokens = min(tokens, burst)
    now = T0 + dt.timedelta(milliseconds=elapsed_ms)
    have = refill(tokens, T0, now, rate, burst)
    assert tokens - 1e-9 <= have <= burst  # never loses tokens (a clock going back adds none)
    if have < 1:
        wait = wait_for_token(have, rate)
        # as limits.retry_at does: MongoDB's dates have millisecond precision
        later = now + dt.timedelta(seconds=wait, milliseconds=1)
        assert refill(have, now, later, rate, burst) >= 1
    else:
        assert wait_for_token(have, rate) == 0


@pytest.mark.parametrize(
    ("text", "per_second"), [("10/s", 10), ("600/m", 10), ("3600/h", 1), ("2.5", 2.5)]
)
def test_parse_rate(text: str, per_second: float) -> None:
    assert parse_rate(text) == pytest.approx(per_second)


@pytest.mark.parametrize("text", ["", "ten/s", "5/day", "-1/s", "0", "nan"])
def test_parse_rate_names_the_problem(text: str) -> None:
    with pytest.raises(InvalidTask, match="^rate: .* is not a rate like 10/s"):
        parse_rate(text)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "limit: give concurrency, rate, group_concurrency or group_rate"),
        ({"concurrency": 0}, "concurrency: must be an integer from 1"),
        ({"concurrency": 2.5}, "concurrency: must be an integer"),
        ({"rate": -1.0}, "rate: must be a number above 0"),
        ({"rate": float("inf")}, "rate: must be a number above 0"),
        ({"concurrency": 2, "burst": 3}, "burst: applies only with a rate"),
        ({"rate": 1.0, "burst": 0}, "burst: must be an integer of at least 1"),
    ],
)
def test_bad_limits_are_refused_and_nothing_is_written(
    client: TaskClient, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidTask, match=f"^{message}"):
        client.set_limit("n", **kwargs)
    assert client.limits() == []


def test_concurrency_slots_are_taken_atomically_and_run_out(client: TaskClient) -> None:
    client.set_limit("n", concurrency=2)
    now = T0
    take = [client._run(acquire("n", f"r{i}", f"k{i}", "w", now, 1000)) for i in range(3)]
    assert [t.taken for t in take] == [True, True, False]
    assert take[2].retry_at == now + dt.timedelta(milliseconds=1001)
    client._run(release("n", ["r0"]))
    assert client._run(acquire("n", "r3", "k3", "w", now, 1000)).taken
    # slots are leases: extended by the pinger, otherwise they run out (the worker died)
    client._run(extend(Request("n", "r1", "k1", 1000), "w", now + dt.timedelta(milliseconds=900)))
    later = now + dt.timedelta(milliseconds=1000)  # r3's slot ends; r1's was extended
    assert client._run(acquire("n", "r4", "k4", "w", later, 1000)).taken
    assert not client._run(acquire("n", "r5", "k5", "w", later, 1000)).taken
    holders = {h["run_id"] for h in client.limits()[0]["holders"]}
    assert holders == {"r1", "r4"}
    # extend says whether the run may go on: r3's place was taken (r4), r1 still holds one
    assert client._run(extend(Request("n", "r1", "k1", 1000), "w", later)) is True
    assert client._run(extend(Request("n", "r3", "k3", 1000), "w", later)) is False
    client.set_limit("n", rate=5.0)  # a rate alone counts no runs at once
    assert client._run(acquire("n", "r6", "k6", "w", later, 1000)).taken
    assert client.limits()[0]["holders"] == []
    assert client._run(extend(Request("n", "r1", "k1", 1000), "w", later)) is None
    assert client.clear_limit("n")  # no limit any more: nothing to hold
    assert client._run(extend(Request("n", "r1", "k1", 1000), "w", later, joins=True)) is None


def test_rate_tokens_refill_by_the_given_clock(mongo_uri: str, db_name: str) -> None:
    clock = FixedClock(T0)
    with TaskClient(mongo_uri, database=db_name, clock=clock) as tc:
        tc.set_limit("n", rate=2.0, burst=2)  # a full bucket: 2 tokens
        got = [tc._run(acquire("n", f"r{i}", "k", "w", T0, 1000)) for i in range(3)]
        assert [g.taken for g in got] == [True, True, False]
        assert got[2].retry_at == T0 + dt.timedelta(milliseconds=501)
        half = T0 + dt.timedelta(milliseconds=499)
        assert not tc._run(acquire("n", "r3", "k", "w", half, 1000)).taken
        assert tc._run(
            acquire("n", "r4", "k", "w", T0 + dt.timedelta(milliseconds=500), 1000)
        ).taken
        doc = tc.limits()[0]
        assert doc["holders"] == [] and doc["tokens"] == pytest.approx(0)


def test_a_take_behind_the_buckets_clock_does_not_move_it_back(
    mongo_uri: str, db_name: str
) -> None:
    """Workers' estimates of the server's clock differ by some milliseconds. A take whose time
    is behind the bucket's adds no token, and must not move the bucket's clock back either:
    the next take would count that time again (a CI run saw four claims within 30 ms under
    2 a second and a burst of 2)."""
    with TaskClient(mongo_uri, database=db_name, clock=FixedClock(T0)) as tc:
        tc.set_limit("n", rate=2.0, burst=2)  # a token every 500 ms
        ms = lambda n: T0 + dt.timedelta(milliseconds=n)  # noqa: E731
        assert tc._run(acquire("n", "a1", "k", "a", ms(1000), 1000)).taken  # 2 → 1
        assert tc._run(acquire("n", "b1", "k", "b", ms(600), 1000)).taken  # b 400 ms behind
        assert tc.limits()[0]["refilled_at"] == ms(1000)
        # 100 ms after the bucket's clock: a fifth of a token, not the 500 ms from b's time
        refused = tc._run(acquire("n", "a2", "k", "a", ms(1100), 1000))
        assert not refused.taken and refused.retry_at == ms(1501)
        # b, behind the bucket's clock, comes back once its own clock reaches the token's time
        # on the bucket's (not 500 ms after its own time, too early by the distance)
        assert tc._run(acquire("n", "b2", "k", "b", ms(700), 1000)).retry_at == ms(1501)
        assert tc._run(acquire("n", "a3", "k", "a", ms(1500), 1000)).taken
        # more than BUCKET_CLOCK_SLACK behind: the server's clock was stepped back since the
        # bucket's was set; the bucket starts again, full, from the taker's time (else it would
        # grant nothing until the server's clock caught up)
        assert tc._run(acquire("n", "c1", "k", "c", ms(-1000), 1000)).taken
        assert tc.limits()[0]["refilled_at"] == ms(-1000)
        assert tc._run(acquire("n", "c2", "k", "c", ms(-1000), 1000)).taken
        assert not tc._run(acquire("n", "c3", "k", "c", ms(-1000), 1000)).taken


def test_no_limit_document_means_unlimited(client: TaskClient) -> None:
    got = client._run(acquire("n", "r", "k", "w", T0, 1000))
    assert got.taken and not got.limited  # go on without a slot: none is held
    client.set_limit("n", concurrency=1)
    assert client.clear_limit("n") and not client.clear_limit("n")


def test_changing_a_limit_keeps_the_slots_held(client: TaskClient) -> None:
    client.set_limit("n", concurrency=1)
    assert client._run(acquire("n", "r0", "k", "w", T0, 60_000)).taken
    client.set_limit("n", concurrency=3, rate=100.0)
    doc = client.limits()[0]
    assert doc["concurrency"] == 3 and [h["run_id"] for h in doc["holders"]] == ["r0"]
    assert doc["burst"] == 100 and doc["tokens"] == 100


def test_a_concurrency_added_to_a_rate_counts_the_runs_in_flight_and_stops_none(
    client: TaskClient,
) -> None:
    """Runs taken under a rate alone hold no place among the holders (only a token). A
    concurrency added later must not stop them at their next ping as if another run had taken
    their place (every run in flight was given back): each takes a place, even beyond the new
    limit — runs in flight are not stopped by a change of limit, as when one is lowered — and
    counts towards it."""
    client.set_limit("n", rate=100.0)
    got = [client._run(acquire("n", f"r{i}", f"k{i}", "w", T0, 60_000)) for i in range(2)]
    assert all(g.taken and not g.holder for g in got)  # a token, no place
    client.set_limit("n", concurrency=1, rate=100.0)
    for i in range(2):  # what the pinger does for a slot it was only granted a token of
        joined = extend(Request("n", f"r{i}", f"k{i}", 60_000), "w", T0, joins=True)
        assert client._run(joined) is True
    holders = client.limits()[0]["holders"]
    assert [(h["run_id"], h["key"], h["worker_id"]) for h in holders] == [
        ("r0", "k0", "w"),
        ("r1", "k1", "w"),
    ]
    assert holders[0]["expires"] == T0 + dt.timedelta(seconds=60)
    # now held like any place: kept by the next pings, and counted
    later = T0 + dt.timedelta(seconds=1)
    assert client._run(extend(Request("n", "r0", "k0", 60_000), "w", later)) is True
    assert client._run(extend(Request("n", "r1", "k1", 60_000), "w", later, joins=True))
    assert [h["run_id"] for h in client.limits()[0]["holders"]] == ["r0", "r1"]
    assert not client._run(acquire("n", "r2", "k2", "w", later, 60_000)).taken
    client._run(release("n", ["r0", "r1"]))
    assert client._run(acquire("n", "r3", "k3", "w", later, 60_000)).holder


def test_a_group_concurrency_added_to_a_group_rate_counts_the_runs_in_flight(
    client: TaskClient,
) -> None:
    """The same for a group: its document limits runs at once from the first take that writes
    the new ``group_concurrency`` into it; the runs granted a token before then join."""
    slot = group_slot("n", "g")
    rate, both = Limit(rate=100.0), Limit(concurrency=1, rate=100.0)
    old = client._run(take([Request(slot, "r0", "k0", 60_000, limit=rate)], "w", T0))[0]
    assert old.taken and not old.holder
    assert client._run(extend(Request(slot, "r0", "k0", 60_000), "w", T0, joins=True)) is None
    new = client._run(take([Request(slot, "r1", "k1", 60_000, limit=both)], "w", T0))[0]
    assert new.taken and new.holder  # the group's document now limits runs at once
    assert client._run(extend(Request(slot, "r0", "k0", 60_000), "w", T0, joins=True)) is True
    doc = client._run(slots_doc(slot))
    assert [h["run_id"] for h in doc["holders"]] == ["r1", "r0"]  # beyond the limit: counted
    assert not client._run(take([Request(slot, "r2", "k2", 60_000, limit=both)], "w", T0))[0].taken


@given(
    value=st.one_of(
        st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True)
    )
)
def test_runs_at_once_admits_what_the_servers_take_admits(value: float) -> None:
    """The take adds a holder while there are fewer live holders than the stored number
    (``store_slots._filter``, ``$lt``); ``runs_at_once`` is the most it admits."""
    n = runs_at_once(value)
    assert n is not None and 0 <= n <= MAX_LIMIT_CONCURRENCY
    for size in {0, 1, n - 1, n, n + 1} - {-1}:
        if size < MAX_LIMIT_CONCURRENCY:  # more than a document can hold
            assert (size < value) == (size < n)


@pytest.mark.parametrize(
    ("value", "admitted"),
    [
        (3, 3),
        (3.0, 3),  # what mongosh writes for 3
        (Int64(3), 3),
        (Decimal128("3"), 3),
        (2.5, 3),
        (0, 0),
        (-1.5, 0),
        (float("nan"), 0),
        (float("inf"), 4),
        ("3", None),
        (True, None),
    ],
)
def test_a_hand_written_concurrency_is_read_as_the_servers_take_reads_it(
    mongo: MongoClient[dict[str, Any]],
    db_name: str,
    client: TaskClient,
    value: Any,
    admitted: int | None,
) -> None:
    """A limit document written by hand (mongosh writes ``3`` as a double): the worker reads
    its concurrency as the take on the server does, so a take that adds a holder is reported
    taken (else the name's tasks were never claimed) and a concurrency alone limits the name
    (else it was not enforced)."""
    limits = mongo[db_name].limits
    bucket = {"rate": 100.0, "burst": 100, "tokens": 100.0, "refilled_at": T0}
    limits.insert_one({"_id": "n", "concurrency": value, "holders": [], **bucket})
    got = [client._run(acquire("n", f"r{i}", f"k{i}", "w", T0, 1000)) for i in range(4)]
    held = [h["run_id"] for h in limits.find_one({"_id": "n"})["holders"]]
    if admitted is None:  # no number: a rate alone, no place held
        assert all(g.taken and not g.holder for g in got) and held == []
    else:
        assert [g.taken for g in got] == [i < admitted for i in range(4)]
        assert all(g.holder for g in got if g.taken)
        assert held == [f"r{i}" for i in range(admitted) if i < 4]
        refused = [g.retry_at for g in got if not g.taken]
        after = NO_ROOM_WAIT if admitted == 0 else dt.timedelta(seconds=1)
        assert refused == [T0 + after + dt.timedelta(milliseconds=1)] * len(refused)
    limits.update_one({"_id": "n"}, {"$set": {"rate": None, "burst": None}})
    alone = own_limit(limits.find_one({"_id": "n"}))
    assert alone.set is (admitted is not None)
    assert alone.concurrency == (None if admitted is None else runs_at_once(value))


@pytest.mark.parametrize(
    ("fields", "admitted"),
    [
        ({"concurrency": 2}, 2),  # mongosh's updateOne({_id}, {$set: {concurrency: 2}}, upsert)
        ({"concurrency": 2, "holders": None}, 2),
        ({"concurrency": 2.0, "holders": []}, 2),
        ({"rate": 2.0}, 2),  # a bucket as large as the rate, as set_limit makes it
        ({"rate": 2.0, "burst": None, "tokens": None}, 2),
        ({"rate": 0.5}, 1),  # at least one token
        ({"rate": 2.0, "burst": 3}, 3),
        ({"concurrency": 1, "rate": 100.0}, 1),
    ],
)
def test_a_hand_written_limit_of_the_documented_fields_alone_works(
    mongo: MongoClient[dict[str, Any]],
    db_name: str,
    client: TaskClient,
    fields: dict[str, Any],
    admitted: int,
) -> None:
    """A limit written by hand holds its limit fields alone: no ``holders`` (a take refused
    every run of such a name, for good and silently), no bucket (a rate without ``burst``
    never had a token). Each works as ``set_limit``'s document of the same limit does."""
    mongo[db_name].limits.insert_one({"_id": "n", **fields})
    got = [client._run(acquire("n", f"r{i}", f"k{i}", "w", T0, 60_000)) for i in range(4)]
    assert [g.taken for g in got] == [i < admitted for i in range(4)]
    assert all(g.retry_at is not None and g.retry_at > T0 for g in got if not g.taken)


@pytest.mark.parametrize("holders", ["absent", None, "junk"])
def test_runs_in_flight_join_and_leave_a_hand_written_limit_without_holders(
    mongo: MongoClient[dict[str, Any]], db_name: str, client: TaskClient, holders: Any
) -> None:
    """Runs in flight count towards a limit written by hand with no array of holders (the
    join skipped such a document: they did not count), and their slots go back (a give-back
    of several slots stopped at one whose ``holders`` was no array)."""
    limits = mongo[db_name].limits
    limits.insert_one(
        {"_id": "n", "concurrency": 1, **({} if holders == "absent" else {"holders": holders})}
    )
    client.set_limit("m", concurrency=1)
    assert client._run(acquire("m", "m0", "k", "w", T0, 60_000)).taken
    requests = [Request("n", "r0", "k0", 60_000), Request("n", "r1", "k1", 60_000)]
    client._run(store_slots.join(requests, "w", T0, set()))
    assert [h["run_id"] for h in limits.find_one({"_id": "n"})["holders"]] == ["r0", "r1"]
    assert not client._run(acquire("n", "r2", "k2", "w", T0, 60_000)).taken
    client._run(store_slots.release({"n": ["r0", "r1"], "m": ["m0"]}))
    assert limits.find_one({"_id": "n"})["holders"] == []
    assert limits.find_one({"_id": "m"})["holders"] == []
    assert client._run(acquire("n", "r3", "k3", "w", T0, 60_000)).taken


async def test_a_worker_claims_under_a_limit_written_by_hand(
    mongo_uri: str, db_name: str, client: TaskClient, mongo: MongoClient[dict[str, Any]]
) -> None:
    """The operator's hand edit, as mongosh makes it: ``db.limits.updateOne({_id: "limited"},
    {$set: {concurrency: 2}}, {upsert: true})``. Every claim of the name stopped, silently."""
    mongo[db_name].limits.update_one(
        {"_id": "limited"}, {"$set": {"concurrency": 2.0}}, upsert=True
    )
    registry, spans, done = spans_registry(6, 0.05)
    async with running_worker(registry, mongo_uri, db_name, concurrency=8):
        client.publish_many([{"name": "limited", "key": f"k{i}"} for i in range(6)])
        await asyncio.wait_for(done.wait(), 20)
    assert _overlap(spans) <= 2


def _overlap(spans: list[tuple[float, float]]) -> int:
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = peak = 0
    for _, step in points:  # an end at the same instant as a start comes first (-1 < 1)
        running += step
        peak = max(peak, running)
    return peak


def spans_registry(
    count: int, seconds: float
) -> tuple[Registry, list[tuple[float, float]], asyncio.Event]:
    """A ``limited`` handler that records its (start, end) on the loop's clock, and an event
    set when ``count`` runs have ended."""
    registry = Registry()
    spans: list[tuple[float, float]] = []
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    @registry.task("limited")
    async def limited(params: dict[str, Any]) -> None:
        start = loop.time()
        await asyncio.sleep(seconds)
        spans.append((start, loop.time()))
        if len(spans) == count:
            done.set()

    return registry, spans, done


async def test_two_workers_share_a_concurrency_limit(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    registry, spans, done = spans_registry(24, 0.03)
    client.set_limit("limited", concurrency=2)
    async with (
        running_worker(registry, mongo_uri, db_name, concurrency=8) as (_, events_a),
        running_worker(registry, mongo_uri, db_name, concurrency=8) as (_, events_b),
    ):
        client.publish_many([{"name": "limited", "key": f"k{i}"} for i in range(24)])
        await asyncio.wait_for(done.wait(), 30)
    # both workers run in this one loop, so their spans share one clock
    assert _overlap(spans) <= 2
    assert client.stats()["limited"].get("succeeded") == 24
    assert client.limits()[0]["holders"] == []  # every slot given back
    assert len(events_a.matching("claimed")) + len(events_b.matching("claimed")) == 24


async def test_a_new_limit_is_known_to_running_workers_on_its_event(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry, spans, done = spans_registry(12, 0.02)
    monkeypatch.setattr(LimitGate, "interval", 3600.0)  # no periodic refresh: the event must do
    async with running_worker(registry, mongo_uri, db_name, concurrency=8) as (worker, _):
        await asyncio.wait_for(worker.parts.gate.refreshed.wait(), 10)  # its first read
        assert not worker.parts.gate.limited
        client.set_limit("limited", concurrency=1)
        await wait_for(lambda: worker.parts.gate.limited.keys() == {"limited"}, timeout=10)
        client.publish_many([{"name": "limited", "key": f"k{i}"} for i in range(12)])
        await asyncio.wait_for(done.wait(), 30)
    assert _overlap(spans) == 1


async def test_runs_in_flight_under_a_rate_go_on_when_a_concurrency_is_added(
    mongo: MongoClient[dict[str, Any]], mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """Two long runs under a rate alone; a concurrency is added. Their next pings stopped both
    as "slot lost" and gave their tasks back (though no other run took a place): instead each
    takes a place, and keeps it with the pings after."""
    db = mongo[db_name]
    client.set_limit("sleep", rate=100.0)
    options = {"ping_interval_ms": 100, "worker_timeout_ms": 30_000}
    for key in ("a", "b"):
        client.publish("sleep", key, {"seconds": 3600}, options=options)
    async with running_worker(workerapp.registry, mongo_uri, db_name, concurrency=4) as (
        worker,
        events,
    ):
        await events.wait("claimed", key="a")
        await events.wait("claimed", key="b")
        runs = {db.tasks.find_one({"_id": k})["runs"][0]["run_id"] for k in ("a", "b")}

        def holders() -> dict[str, dt.datetime]:
            doc = db.limits.find_one({"_id": "sleep"}) or {}
            return {h["run_id"]: h["expires"] for h in doc.get("holders", ())}

        client.set_limit("sleep", concurrency=1, rate=100.0)  # fewer than the runs in flight
        await wait_for(lambda: holders().keys() == runs or events.matching("released"))
        assert not events.matching("released") and worker.stats.slots_lost == 0
        first = holders()
        await wait_for(lambda: all(e > first[r] for r, e in holders().items()))  # pinged on
        assert not events.matching("released") and worker.stats.slots_lost == 0
        assert db.tasks.count_documents({"status": "running"}) == 2


async def test_keys_held_back_by_a_rate_come_back_on_time(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """One worker, no sweep: every held-back key must be retried when its token is due (no
    change event announces a token)."""
    registry = Registry()

    @registry.task("limited")
    async def limited(params: dict[str, Any]) -> None:
        return None

    client.set_limit("limited", rate=20.0, burst=1)
    async with running_worker(registry, mongo_uri, db_name, concurrency=8, sweep_interval=3600) as (
        _,
        events,
    ):
        client.publish_many([{"name": "limited", "key": f"k{i}"} for i in range(10)])
        await events.wait("recorded", count=10, timeout=30)
    claims = sorted(t.runs[0].claimed_at for t in client.list(limit=100))
    assert len(claims) == 10
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(claims)]
    assert min(gaps) >= 0.05 - 0.002  # one token every 50 ms (server-clock milliseconds)


def test_runs_counted_in_after_a_change_are_holders_a_take_counts(
    client: TaskClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    """``store_slots.join`` on the server: runs started before a limit take places beyond it (a run
    already a holder is not added twice), a group's document is made by its first join, and a
    take counts them all: no new run until fewer than the limit run."""
    driver = SyncDriver(mongo[db_name])
    client.set_limit("n", concurrency=1)
    gslot = group_slot("n", "g")
    known: set[str] = set()
    joins = [
        Request("n", "r1", "k1", 5000),
        Request("n", "r2", "k2", 5000),
        Request(gslot, "r1", "k1", 5000, Limit(2)),
    ]
    driver.run(store_slots.join(joins, "w", T0, known))
    driver.run(store_slots.join(joins[:1], "w", T0, known))  # a holder already: nothing
    limits = mongo[db_name].limits
    assert [h["run_id"] for h in limits.find_one({"_id": "n"})["holders"]] == ["r1", "r2"]
    group = limits.find_one({"_id": gslot})
    assert [h["run_id"] for h in group["holders"]] == ["r1"] and group["group"] == "g"
    assert known == {gslot}
    assert not driver.run(take([Request("n", "r3", "k3", 5000)], "w", T0))[0].taken
    taken = driver.run(
        take([Request(gslot, r, f"k-{r}", 5000, Limit(2)) for r in ("r4", "r5")], "w", T0)
    )
    assert [t.taken for t in taken] == [True, False]  # r1 counted: one place left of two
    # a cleared limit is not made again by a join
    client.clear_limit("n")
    driver.run(store_slots.join(joins[:1], "w", T0, known))
    assert limits.find_one({"_id": "n"}) is None


def test_a_sequences_head_is_told_of_a_run_its_groups_slot_holds(
    client: TaskClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    driver = SyncDriver(mongo[db_name])
    for group in ("g", "h"):
        client.publish("n", f"{group}-1", options=TaskOptions(group=group))
    now = client.now()
    live = Request(group_slot("n", "g"), "r1", "k1", 60_000, Limit(3))
    ended = Request(group_slot("n", "h"), "r2", "k2", 1, Limit(3))
    driver.run(store_slots.join([live, ended], "w", now - dt.timedelta(seconds=1), set()))
    pairs = [("n", "g"), ("n", "h")]
    heads = driver.run(store.heads_and_slots(pairs, pairs, now))
    assert heads[("n", "g")]["_id"] == "g-1" and heads[("n", "g")].get("slot_held") is True
    assert heads[("n", "h")]["_id"] == "h-1" and "slot_held" not in heads[("n", "h")]
    assert driver.run(store.heads([("n", "g")])) == {
        ("n", "g"): {k: v for k, v in heads[("n", "g")].items() if k != "slot_held"}
    }


async def test_a_limit_is_read_on_its_change_and_never_on_a_slots(
    mongo_uri: str, db_name: str, client: TaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each run of a limited name gives its slot back (an event on the name's document): no
    read of the limits. A change of the limit: one read by the worker, and it says so."""
    reads: list[list[str]] = []
    limits_of = store_limits.limits_of

    def counted(names: Any) -> Any:
        reads.append(sorted(names))
        return limits_of(names)

    monkeypatch.setattr(store_limits, "limits_of", counted)
    registry, _, done = spans_registry(12, 0.01)
    client.set_limit("limited", concurrency=1)
    async with running_worker(
        registry, mongo_uri, db_name, concurrency=4, stream="own", limits_refresh=3600
    ) as (_, events):
        await events.wait("limits_applied", name="limited")  # its first read
        client.publish_many([{"name": "limited", "key": f"k{i}"} for i in range(12)])
        await asyncio.wait_for(done.wait(), 30)
        await events.wait("recorded", count=12)
        assert reads == []  # twelve slots given back, twelve events: no read
        client.set_limit("limited", concurrency=2)
        await events.wait("limits_applied", count=2, name="limited")
        assert reads == [["limited"]]


def test_a_limit_that_makes_sequences_notes_it_until_no_groups_slot_holds_a_run(
    client: TaskClient, mongo: MongoClient[dict[str, Any]], db_name: str
) -> None:
    """``limits.SLOT_RUNS``: set by a ``set_limit`` that makes the groups sequences (their
    heads are read with the groups' slots), settled once no group's slot holds a live run, and
    only as the value read (a ``set_limit`` since keeps its own)."""
    driver = SyncDriver(mongo[db_name])
    limits = mongo[db_name].limits
    client.set_limit("n", group_concurrency=3)
    assert limits.find_one({"_id": "n"})[mtask_limits.SLOT_RUNS] is None
    client.set_limit("n", group_concurrency=1)
    since = mtask_limits.slot_runs(limits.find_one({"_id": "n"}))
    assert since is not None
    now = since + mtask_limits.SETTLE_AFTER
    live = Request(group_slot("n", "g"), "r1", "k1", 60_000, Limit(3))
    driver.run(store_slots.join([live], "w", now, set()))
    driver.run(
        store_slots.join([Request(group_slot("nn", "g"), "r2", "k2", 60_000)], "w", now, set())
    )
    assert not driver.run(store_limits.settle_slot_runs("n", since, now))  # r1 runs on
    driver.run(store_slots.release({group_slot("n", "g"): ["r1"]}))
    later = dt.datetime(2099, 1, 1, tzinfo=dt.UTC)
    assert not driver.run(store_limits.settle_slot_runs("n", later, now))  # not the value read
    assert driver.run(store_limits.settle_slot_runs("n", since, now))  # another name's: not n's
    assert mtask_limits.slot_runs(limits.find_one({"_id": "n"})) is None
