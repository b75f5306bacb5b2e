"""The host's relay with several workers in one process (the relay works the same whether its
subscribers are processes or ``Worker`` objects): one claim attempt per task, keys handed to
the workers allowed to run them, a dropped subscriber back, a stopped relay taken over."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from harness import running_worker, wait_for
from pymongo import AsyncMongoClient
from workerapp import registry

from mtask import AsyncTaskClient, TaskClient
from mtask.driver import AsyncDriver, SyncDriver, collections
from mtask.store import relays
from mtask.worker import Worker
from mtask.worker.finding.shared import mailbox
from mtask.worker.finding.shared.lease import (
    LEASE_TTL,
    TAKE_OVER_AFTER,
    WATCHED_RENEW_EVERY,
    RelayLease,
)
from mtask.worker.finding.shared.standby import Standby
from mtask.worker.finding.shared.subscriber import SharedStream
from mtask.worker.finding.shared.wire import LET_GO


def shared(worker: Any) -> SharedStream:
    assert isinstance(worker.parts.finding.shared, SharedStream)
    return worker.parts.finding.shared


def done(client: TaskClient, count: int) -> bool:
    return client.collection.count_documents({"status": "succeeded"}) == count


@contextlib.asynccontextmanager
async def workers(
    uri: str, db: str, ids: list[str], **kwargs: Any
) -> AsyncIterator[list[tuple[Worker, Any]]]:
    async with contextlib.AsyncExitStack() as stack:
        started = []
        for worker_id in ids:
            started.append(
                await stack.enter_async_context(
                    running_worker(
                        registry, uri, db, worker_id=worker_id, stream="shared", **kwargs
                    )
                )
            )
        yield started


async def test_the_relay_hands_each_task_to_one_worker(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with workers(mongo_uri, db_name, ["a", "b", "c"], concurrency=4) as crew:
        relay = shared(crew[0][0]).relay
        assert relay is not None and all(shared(w).relay is None for w, _ in crew[1:])
        await wait_for(lambda: len(relay.subscribers) == 3 and relay.excluded == ())
        client.publish_many(
            [{"name": "add", "key": f"t{i:03}", "params": {"a": i, "b": 1}} for i in range(300)]
        )
        await wait_for(lambda: done(client, 300), timeout=120)
        stats = [w.stats for w, _ in crew]
        assert sum(s.claimed for s in stats) == 300
        # each task claimed once (above); a claim that came to nothing is rare: a worker's own
        # scan meeting a task the relay hands out at the same moment, which a busy machine's
        # slow relay makes likelier (up to 8 of 300 seen beside the whole suite)
        assert 300 <= sum(s.claim_attempts for s in stats) <= 330
        assert all(s.claimed > 0 for s in stats)  # and every worker got some
        assert relay.dispatcher.handed >= 300
        # their claims and successes came through the relay's stream, not as reports: a
        # subscriber whose work goes well says its credit when it is first handed work
        # (the stream may show the last successes a moment after the documents say them)
        await wait_for(lambda: relay.dispatcher.heard == {"claim": 300, "success": 300})
        assert relay.dispatcher.reports < 30  # not one a task
        # a task only one worker may run is handed to that one
        client.publish("add", "for-c", {"a": 1, "b": 2}, options={"specific_worker_ids": ["c"]})
        await crew[2][1].wait("recorded", key="for-c")


async def test_a_task_of_concurrency_two_is_run_by_two_workers_without_a_sweep(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A claim or success of a task that needs two workers may leave its ``next_claim_at`` as
    it was: the relay's stream must still show it (by its tag), so that the task reaches the
    second worker at once and the first one's slot comes back (not by a sweep)."""
    async with workers(mongo_uri, db_name, ["a", "b"], concurrency=1, sweep_interval=3600) as crew:
        relay = shared(crew[0][0]).relay
        assert relay is not None
        await wait_for(lambda: len(relay.subscribers) == 2)
        client.publish_many(
            [
                {
                    "name": "add",
                    "key": f"c{i:02}",
                    "params": {"a": i, "b": 1},
                    "options": {"concurrency": 2},
                }
                for i in range(30)
            ]
        )
        await wait_for(lambda: done(client, 30), timeout=60)
        for doc in client.collection.find({}, {"runs": 1}):
            workers_ok = {r["worker_id"] for r in doc["runs"] if r["state"] == "SUCCESS"}
            assert len(workers_ok) == 2  # two distinct workers, each once


async def test_failures_give_the_slots_back_without_a_sweep(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A failure frees a slot no event gives back to the relay: the subscriber says its credit,
    so workers of concurrency 1 whose every task fails once keep being handed work."""
    ids = ["a", "b", "c"]
    async with workers(mongo_uri, db_name, ids, concurrency=1, sweep_interval=3600) as crew:
        relay = shared(crew[0][0]).relay
        assert relay is not None
        await wait_for(lambda: len(relay.subscribers) == 3 and relay.excluded == ())
        client.publish_many(
            {
                "name": "flaky",
                "key": f"f{i:02}",
                "params": {"fail_times": 1},
                "options": {"retry_delay_ms": 0, "max_retries": 2},
            }
            for i in range(40)
        )
        await wait_for(lambda: done(client, 40), timeout=60)
        stats = [w.stats for w, _ in crew]
        assert sum(s.claimed for s in stats) == 80  # each failed once, then succeeded
        await wait_for(lambda: relay.dispatcher.heard["success"] == 40)  # (a moment later)
        assert relay.dispatcher.reports >= 20  # failures are said (one report may say two)


async def test_a_dropped_subscriber_reconnects_and_gets_tasks_again(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """The relay drops a subscriber past its buffer (tests/unit/test_stream_relay.py): the
    subscriber connects again, and the keys handed to it meanwhile are handed on."""
    async with workers(mongo_uri, db_name, ["a", "b"], concurrency=20) as crew:
        (a, _), (b, b_events) = crew
        relay = shared(a).relay
        assert relay is not None
        await wait_for(lambda: len(relay.subscribers) == 2)
        connections = shared(b).connections
        [b_sub] = [s for s, worker_id in relay.subscribers.items() if worker_id == "b"]
        relay.drop(b_sub)
        assert relay.dropped == 1 and list(relay.subscribers.values()) == ["a"]
        await wait_for(lambda: shared(b).connections > connections)
        await wait_for(lambda: sorted(relay.subscribers.values()) == ["a", "b"])
        client.publish("add", "for-b", {"a": 1, "b": 2}, options={"specific_worker_ids": ["b"]})
        await b_events.wait("recorded", key="for-b")
        client.publish_many(
            [{"name": "add", "key": f"t{i:03}", "params": {"a": i, "b": 1}} for i in range(100)]
        )
        await wait_for(lambda: done(client, 101), timeout=60)
        assert a.state == b.state == "running"


async def test_a_stopped_relay_is_taken_over(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    async with running_worker(registry, mongo_uri, db_name, worker_id="b", stream="shared") as (
        b,
        b_events,
    ):
        async with running_worker(registry, mongo_uri, db_name, worker_id="a", stream="shared") as (
            a,
            _,
        ):
            assert shared(b).relay is not None and shared(a).relay is None
            client.publish("add", "one", {"a": 1, "b": 1})
            await wait_for(lambda: done(client, 1))
        # a was the subscriber; now stop b's relay by hand and see a newcomer take it over
        async with running_worker(registry, mongo_uri, db_name, worker_id="c", stream="shared") as (
            c,
            c_events,
        ):
            await wait_for(lambda: len(shared(b).relay.subscribers) == 2)  # type: ignore[union-attr]
            task = shared(b).holder._task
            assert task is not None
            connections = shared(c).connections
            task.cancel()  # the relay goes (as in a crash of its process, its sockets close)

            def live_relays() -> list[SharedStream]:
                streams = (shared(b), shared(c))
                return [s for s in streams if s.leads()]

            await wait_for(lambda: len(live_relays()) == 1)  # the bind race: one winner
            await wait_for(lambda: shared(c).connections > connections)
            client.publish("add", "for-c", {"a": 2, "b": 2}, options={"specific_worker_ids": ["c"]})
            await c_events.wait("recorded", key="for-c")
            client.publish("add", "for-b", {"a": 3, "b": 3}, options={"specific_worker_ids": ["b"]})
            await b_events.wait("recorded", key="for-b")
            assert b.state == c.state == "running"


async def test_a_look_at_the_relays_lease_reads_how_long_ago_it_was_renewed(
    mongo: Any, db_name: str, client: TaskClient
) -> None:
    run = SyncDriver(collections(mongo[db_name])).run
    leases = mongo[db_name].relays
    run(relays.ensure("tasks"))
    assert run(relays.renewed_ago("tasks", "a/1", 10_000)) is None  # nobody's
    assert run(relays.acquire("tasks", "a/1", 10_000))
    fresh = run(relays.renewed_ago("tasks", "a/1", 10_000))
    assert fresh is not None and 0 <= fresh < 1_000
    assert run(relays.renewed_ago("tasks", "b/1", 10_000)) is None  # not b's
    # renewed 3 s ago by the server's clock: its end 7 s ahead
    leases.update_one({"_id": "tasks"}, [{"$set": {"expires_at": {"$add": ["$$NOW", 7_000]}}}])
    late = run(relays.renewed_ago("tasks", "a/1", 10_000))
    assert late is not None and 3_000 <= late < 4_000
    past = client.now() - dt.timedelta(seconds=1)  # run out
    leases.update_one({"_id": "tasks"}, {"$set": {"expires_at": past}})
    assert run(relays.renewed_ago("tasks", "a/1", 10_000)) is None
    leases.update_one({"_id": "tasks"}, {"$set": {"expires_at": "tomorrow"}})  # any shape
    assert run(relays.renewed_ago("tasks", "a/1", 10_000)) is None


async def test_the_relays_lease_is_one_holders_until_it_runs_out(
    mongo: Any, db_name: str, client: TaskClient
) -> None:
    run = SyncDriver(collections(mongo[db_name])).run
    run(relays.ensure("tasks"))
    run(relays.ensure("tasks"))  # once
    assert run(relays.holder("tasks")) is None
    assert run(relays.acquire("tasks", "a/1", 10_000))
    assert not run(relays.acquire("tasks", "b/1", 10_000))  # a's, and not run out
    assert run(relays.acquire("tasks", "a/1", 10_000))  # renewed
    assert run(relays.holder("tasks")) == "a/1"
    past = client.now() - dt.timedelta(seconds=1)  # a frozen holder's lease, on the server's clock
    mongo[db_name].relays.update_one({"_id": "tasks"}, {"$set": {"expires_at": past}})
    assert run(relays.holder("tasks")) is None
    assert run(relays.acquire("tasks", "b/1", 10_000))
    assert not run(relays.acquire("tasks", "a/1", 10_000))  # a thawed holder finds it b's
    run(relays.release("tasks", "a/1"))  # not a's: nothing
    assert run(relays.holder("tasks")) == "b/1"
    run(relays.release("tasks", "b/1"))
    assert run(relays.holder("tasks")) is None


async def test_inboxes_nobody_reads_are_found(mongo_uri: str, db_name: str) -> None:
    async with AsyncTaskClient(mongo_uri, database=db_name) as aclient:
        db, now = aclient.db, await aclient.now()
        old, fresh, kept = (mailbox.inbox_name("tasks", s) for s in ("old", "fresh", "kept"))
        hour = dt.timedelta(hours=1)
        await mailbox.ensure_capped(db, old, mailbox.INBOX_BYTES, at=now - hour)
        await mailbox.ensure_capped(db, fresh, mailbox.INBOX_BYTES, at=now)
        await mailbox.ensure_capped(db, kept, mailbox.INBOX_BYTES, at=now - hour)
        await db[mailbox.inbox_name("tasks", "remade")].insert_one({"f": {}})  # not capped
        await mailbox.ensure_capped(db, "jobs.inbox.x", mailbox.INBOX_BYTES, at=now - hour)
        stale = await mailbox.stale_inboxes(db, "tasks", {kept}, now - dt.timedelta(minutes=10))
        assert sorted(stale) == sorted([old, mailbox.inbox_name("tasks", "remade")])
        frames = mailbox.tail(db[fresh])
        await db[fresh].insert_one({"f": {"relay": "tick"}})
        assert (await anext(frames))["f"] == {"relay": "tick"}  # the marker is skipped
        await frames.aclose()


async def test_an_inbox_the_relay_drops_ends_its_waiting_tail_at_once(
    mongo_uri: str, db_name: str
) -> None:
    """A drop does not wake a tailing ``getMore`` that waits (it would return only after
    ``mailbox.AWAIT_MS``, a minute); the relay's last frame does, and the subscription ends
    with it (``InboxSubscription.next_frame``: ``None``, and the subscriber says hello
    again)."""
    async with AsyncTaskClient(mongo_uri, database=db_name) as aclient:
        db = aclient.db
        name = mailbox.inbox_name("tasks", "let-go")
        await mailbox.ensure_capped(db, name, mailbox.INBOX_BYTES)
        frames = mailbox.tail(db[name])
        reading = asyncio.ensure_future(anext(frames))

        async def waiting() -> bool:
            cursor = await db.client.admin.aggregate(
                [{"$currentOp": {}}, {"$match": {"ns": f"{db_name}.{name}", "op": "getmore"}}]
            )
            ops = await cursor.to_list()
            return bool(ops)

        await wait_for(waiting)  # its getMore waits on the server
        await mailbox.drop(db, name, {"f": LET_GO})
        # The last frame wakes the getMore; if the drop kills the cursor before the woken
        # getMore returns the frame (seen beside another suite), the tail ends without it, and
        # the subscriber reads that end as it reads the last frame: let go
        # (``InboxSubscription.next_frame``). Either way, at once: not after AWAIT_MS.
        try:
            last = await asyncio.wait_for(reading, timeout=mailbox.AWAIT_MS / 3000)
        except StopAsyncIteration:
            pass
        else:
            assert last["f"] == LET_GO
            with pytest.raises(StopAsyncIteration):  # the inbox is gone: its cursor with it
                await asyncio.wait_for(anext(frames), timeout=mailbox.AWAIT_MS / 3000)
        assert name not in await db.list_collection_names()


async def test_a_dispatched_workers_queue_keeps_no_more_than_it_holds(
    mongo_uri: str, db_name: str, client: TaskClient
) -> None:
    """A dispatched worker never rescans, so its queue is never cleared: each key handed to it
    left an item in the queue's heap of latest claim times (read only when the queue is
    full), which grew by one a task for as long as the worker lived."""
    async with workers(mongo_uri, db_name, ["a", "b"], concurrency=4) as crew:
        relay = shared(crew[0][0]).relay
        assert relay is not None
        await wait_for(lambda: len(relay.subscribers) == 2 and relay.excluded == ())
        client.publish_many(
            [{"name": "add", "key": f"t{i:03}", "params": {"a": i, "b": 1}} for i in range(400)]
        )
        await wait_for(lambda: done(client, 400), timeout=120)
        for worker, _ in crew:
            assert shared(worker).dispatched
            queue = worker.parts.queue
            assert len(queue._latest) <= 2 * len(queue) + 64


async def test_only_the_standby_takes_a_silent_relays_lease_over_before_it_runs_out(
    mongo: Any, db_name: str, client: TaskClient
) -> None:
    """The standby's post and the takeover, decided by the server on its own clock:
    one worker holds the post at a time; it may take the lease over once the relay has not
    renewed it for ``TAKE_OVER_AFTER`` (long before the lease runs out), and no sooner; no one
    else may; the new relay starts without a standby; the old one finds the lease another's."""
    run = SyncDriver(collections(mongo[db_name])).run
    leases = mongo[db_name].relays
    ttl, stale = int(LEASE_TTL * 1000), int(TAKE_OVER_AFTER * 1000)
    run(relays.ensure("tasks"))
    assert run(relays.acquire("tasks", "a/1", ttl))
    assert run(relays.renew("tasks", "a/1", ttl)) == relays.Renewal(None, False)
    assert run(relays.stand_by("tasks", "a/1", "w2", 3_000))
    assert not run(relays.stand_by("tasks", "a/1", "w3", 3_000))  # w2's, and not run out
    assert not run(relays.stand_by("tasks", "b/1", "w3", 3_000))  # not b/1's lease
    assert run(relays.renew("tasks", "a/1", ttl)) == relays.Renewal("w2", True)
    seen = run(relays.watch("tasks", "a/1", "w2", "w2/1", stale, ttl, 3_000))
    assert seen is not None and not seen.taken  # renewed now
    # a/1 last renewed 1 s ago by the server's clock (frozen, dead, cut off): 9 s of lease left
    leases.update_one({"_id": "tasks"}, [{"$set": {"expires_at": {"$add": ["$$NOW", 9_000]}}}])
    assert run(relays.holder("tasks")) == "a/1"  # its lease has not run out
    assert run(relays.watch("tasks", "a/1", "w3", "w3/1", stale, ttl, 3_000)) is None  # not it
    assert not run(relays.acquire("tasks", "c/1", ttl))  # nor anyone else
    assert run(relays.watch("tasks", "a/1", "w2", "w2/1", stale, ttl, 3_000)) == (True, 0)
    assert run(relays.holder("tasks")) == "w2/1"
    assert run(relays.renew("tasks", "w2/1", ttl)) == relays.Renewal(None, False)
    assert run(relays.renew("tasks", "a/1", ttl)) is None  # a thawed relay: another's
    # a post nobody renews runs out: another worker may take it
    assert run(relays.stand_by("tasks", "w2/1", "w4", 3_000))
    leases.update_one({"_id": "tasks"}, {"$set": {"standby_until": client.now()}})
    assert run(relays.renew("tasks", "w2/1", ttl)) == relays.Renewal("w4", False)
    assert run(relays.stand_by("tasks", "w2/1", "w5", 3_000))
    leases.update_one({"_id": "tasks"}, {"$set": {"expires_at": "tomorrow"}})  # any shape
    seen = run(relays.watch("tasks", "w2/1", "w5", "w5/1", stale, ttl, 3_000))
    assert seen is not None and not seen.taken


def test_a_standbys_look_takes_a_silent_relays_lease_over_or_renews_its_post(
    mongo: Any, db_name: str, client: TaskClient
) -> None:
    """``store.relays.watch``, the standby's one command at each look, decided by the server on
    its own clock: while the relay renews it renews the post and says how long ago the relay
    renewed; once the relay has been silent for ``TAKE_OVER_AFTER`` it takes the lease over;
    nothing for a worker that does not hold the post, or once the lease is another's."""
    run = SyncDriver(collections(mongo[db_name])).run
    leases = mongo[db_name].relays
    ttl, stale = int(LEASE_TTL * 1000), int(TAKE_OVER_AFTER * 1000)
    run(relays.ensure("tasks"))
    assert run(relays.acquire("tasks", "a/1", ttl))
    assert run(relays.stand_by("tasks", "a/1", "w2", 1))  # a post that lapses at once
    seen = run(relays.watch("tasks", "a/1", "w2", "w2/1", stale, ttl, 3_000))
    assert seen is not None and not seen.taken and 0 <= seen.ago_ms < stale
    assert run(relays.renew("tasks", "a/1", ttl)) == relays.Renewal("w2", True)  # renewed
    posted = leases.find_one({"_id": "tasks"})["standby_until"]
    assert run(relays.watch("tasks", "a/1", "w2", "w2/1", stale, ttl, 3_000)) is not None
    assert leases.find_one({"_id": "tasks"})["standby_until"] == posted  # more than half left
    assert run(relays.watch("tasks", "a/1", "w3", "w3/1", stale, ttl, 3_000)) is None
    assert run(relays.watch("tasks", "b/1", "w2", "w2/1", stale, ttl, 3_000)) is None
    # a/1 last renewed 1 s ago by the server's clock (frozen, dead, cut off)
    leases.update_one({"_id": "tasks"}, [{"$set": {"expires_at": {"$add": ["$$NOW", 9_000]}}}])
    assert run(relays.watch("tasks", "a/1", "w2", "w2/1", stale, ttl, 3_000)) == (True, 0)
    assert run(relays.holder("tasks")) == "w2/1"
    assert run(relays.renew("tasks", "w2/1", ttl)) == relays.Renewal(None, False)  # no standby
    assert run(relays.renew("tasks", "a/1", ttl)) is None  # a thawed relay: another's
    assert run(relays.stand_by("tasks", "w2/1", "w5", 3_000))
    leases.update_one({"_id": "tasks"}, {"$set": {"expires_at": "tomorrow"}})  # any shape
    seen = run(relays.watch("tasks", "w2/1", "w5", "w5/1", stale, ttl, 3_000))
    assert seen is not None and not seen.taken


class Counted:
    """A driver that counts the commands it sends."""

    def __init__(self, driver: AsyncDriver) -> None:
        self.driver = driver
        self.collections = driver.collections
        self.sent = 0

    async def run(self, op: Any, session: Any = None) -> Any:
        def counted() -> Any:
            reply = None
            while True:
                try:
                    call = op.send(reply)
                except StopIteration as stop:
                    return stop.value
                self.sent += 1
                reply = yield call

        return await self.driver.run(counted())


@pytest.mark.parametrize("standbys", [1, 4])
async def test_an_idle_standby_sends_no_more_commands_than_the_relay_renews(
    mongo_uri: str, db_name: str, standbys: int
) -> None:
    """An idle standby does not poll: it looks at the lease only once the relay could have gone
    silent, so between two of its looks the relay renewed at least once (else the look takes
    the lease over). Its commands are counted against the relay's renewals (a count, not a
    time): at most one a renewal, and the same with one worker asked to stand by as with
    several (the others find the post another's and stop at once)."""
    amongo: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo_uri, tz_aware=True)
    try:
        driver = AsyncDriver(collections(amongo[db_name]))
        lease = await RelayLease.take(driver, "tasks", "w1")
        assert lease is not None
        await lease.renew(candidates=True)
        watchers = [Counted(driver) for _ in range(standbys)]
        watching = [
            asyncio.create_task(Standby(cast(Any, c), "tasks", f"w{i + 2}", lease.id).watch())
            for i, c in enumerate(watchers)
        ]
        renewals = 0
        while renewals < 12:
            await asyncio.sleep(WATCHED_RENEW_EVERY)
            assert await lease.renew(candidates=True) is not None
            renewals += 1
        assert not any(w.done() and w.result() is not None for w in watching)  # none took it
        for task in watching:
            task.cancel()
        await asyncio.gather(*watching, return_exceptions=True)
        sent = sorted(c.sent for c in watchers)
        # the standby: its post, then a look at most once a renewal (and the first, at once)
        assert 2 <= sent[-1] <= 1 + renewals + 1
        assert sent[:-1] == [1] * (standbys - 1)  # the others: one try at the post each
    finally:
        await amongo.close()
