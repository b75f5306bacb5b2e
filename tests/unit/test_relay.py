"""The relay's side of the wire, its subscribers and its stream's filter, without MongoDB."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import pytest
from finders import finder_for
from pymongo.errors import AutoReconnect

from mtask import Registry, TaskContext, store
from mtask.clock import FixedClock
from mtask.driver import AsyncDriver
from mtask.follow import events
from mtask.worker import Worker
from mtask.worker.claim_queue import ClaimQueue
from mtask.worker.finding import stream
from mtask.worker.finding.finder import Others, ReportingSink
from mtask.worker.finding.shared import credit, mailbox, wire
from mtask.worker.finding.shared.channels import FRAME_BYTES
from mtask.worker.finding.shared.dispatch import Dispatcher
from mtask.worker.finding.shared.group_waiters import GroupWaiters
from mtask.worker.finding.shared.lease import RelayLease, new_id
from mtask.worker.finding.shared.mode import RelayMode
from mtask.worker.finding.shared.relay import Relay
from mtask.worker.finding.shared.reporter import Reporter
from mtask.worker.finding.shared.subscriber import SharedStream, SubscriberState
from mtask.worker.finding.shared.subscription import InboxSubscription
from mtask.worker.finding.shared.wire import LET_GO, PROTOCOL, apply_report
from mtask.worker.finding.stream import ClaimsFirst, ClaimsFirstInbox, OwnStream, stream_pipeline
from mtask.worker.inflight import InFlight

WHEN = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)


def test_the_relays_pipeline_leaves_out_only_its_own_workers_writes_while_it_is_alone() -> None:
    one = stream_pipeline("tasks", "w1")
    tag = f"updateDescription.updatedFields.{store.LAST_WRITE}"
    assert one[0]["$match"]["$or"][0]["$or"][1][tag] == {
        "$nin": [store.claim_tag("w1"), store.success_tag("w1")]
    }
    nobody = stream_pipeline("tasks", ())
    assert tag not in nobody[0]["$match"]["$or"][0]["$or"][1]  # every write's event
    assert nobody[1]["$project"][tag] == 1  # whose claim or success it is
    assert one[0]["$match"]["$or"][1] == nobody[0]["$match"]["$or"][1]  # controls etc. alike
    relay = relay_with()
    relay.attach("me", ["n"], 1)
    assert relay._pipeline() == stream_pipeline("tasks", "me")  # its own worker alone
    hello(relay, "w2", "w2/1")
    assert relay._pipeline() == nobody  # handing out: every subscriber's claims and successes


class FakeInbox:
    """A capped collection as the relay's writer sees it: ``insert_many`` records batches,
    ``insert_one`` the last frame before a drop."""

    def __init__(self, name: str = "tasks.inbox.x", fail: bool = False) -> None:
        self.name = name
        self.batches: list[list[dict[str, Any]]] = []
        self.last: list[dict[str, Any]] = []
        self.fail = fail

    def with_options(self, **options: Any) -> FakeInbox:
        return self

    async def insert_many(self, docs: list[dict[str, Any]], **kwargs: Any) -> None:
        if self.fail:
            raise AutoReconnect("cut off")
        self.batches.append(docs)

    async def insert_one(self, doc: dict[str, Any], **kwargs: Any) -> None:
        if self.fail:
            raise AutoReconnect("cut off")
        self.last.append(doc)


class FakeDatabase:
    def __init__(self) -> None:
        self.inboxes: dict[str, FakeInbox] = {}
        self.dropped: list[str] = []

    def __getitem__(self, name: str) -> FakeInbox:
        return self.inboxes.setdefault(name, FakeInbox(name))

    async def drop_collection(self, name: str) -> None:
        self.dropped.append(name)


def relay_with(buffer: int = 100_000) -> Relay:
    waiters = GroupWaiters()
    dispatcher = Dispatcher.build(
        cast(AsyncDriver, None),
        FixedClock(WHEN),
        new_queue=lambda: ClaimQueue(100),
        sweep_interval=30.0,
        waiters=waiters,
    )
    lease = RelayLease(cast(AsyncDriver, None), "tasks", new_id("me"))
    mail = FakeDatabase()  # the inbox database: the tasks' is only the stream's
    return Relay(
        FakeDatabase(), mail, "tasks", "me", buffer, dispatcher, dispatcher.host, lease, waiters
    )


def hello(relay: Relay, worker_id: str, subscription: str, **more: Any) -> None:
    inbox = mailbox.inbox_name("tasks", subscription)
    message = {"hello": PROTOCOL, "worker_id": worker_id, "names": ["n"], "free": 2, "inbox": inbox}
    relay._on_report({"to": relay.id, "from": subscription, "f": {**message, **more}})


EVENT = {"x": "y"}


async def test_subscribers_on_other_hosts_say_hello_and_get_frames_in_their_inboxes() -> None:
    relay = relay_with()
    relay.loop = asyncio.get_running_loop()
    relay.position.streaming = True  # its stream is open
    relay.attach("me", ["n"], 1)  # its own worker, alone: its writes are left out
    relay.excluded = ("me",)
    hello(relay, "a", "a/1")  # no longer alone: the stream reopens without a filter on tags
    hello(relay, "b", "b/1", hello=PROTOCOL + 1)  # another protocol: refused
    hello(relay, "c", "c/1", inbox="elsewhere")  # not an inbox of these tasks: refused
    assert list(relay.subscribers.values()) == ["me", "a"] and relay.position.switching
    [inbox] = relay.inboxes.values()
    relay.broadcast(EVENT)
    relay.broadcast(EVENT)
    await asyncio.sleep(0.01)  # one insert_many for what was sent in one turn
    database = relay.mail
    assert database[mailbox.inbox_name("tasks", "a/1")].batches == [[{"f": EVENT}] * 2]
    relay._on_report({"to": relay.id, "from": "a/1", "f": {"free": 3, "got": 0, "done": 0}})
    found = relay.dispatcher.accounts.get(inbox)
    assert found is not None and found.free == 3
    relay._on_report({"to": relay.id, "from": "x/9", "f": {"free": 3}})  # unknown: ignored
    relay._on_report({"to": relay.id, "from": "a/1", "f": {"bye": True}})
    assert list(relay.subscribers.values()) == ["me"] and len(relay.dispatcher.accounts) == 1
    await asyncio.sleep(0.01)
    assert database.dropped == [mailbox.inbox_name("tasks", "a/1")]  # the relay drops it
    # after a last frame, which ends a tail whose getMore waits (a drop does not wake it)
    assert database[mailbox.inbox_name("tasks", "a/1")].last == [{"f": {"relay": "gone"}}]


async def test_a_slow_or_silent_or_cut_off_subscriber_is_let_go() -> None:
    relay = relay_with(buffer=3 * FRAME_BYTES)
    relay.loop = asyncio.get_running_loop()
    hello(relay, "slow", "s/1")
    for _ in range(4):  # the OPEN frame is not sent (the relay is not open): 4 > 3 frames
        relay.broadcast(EVENT)
    assert relay.dropped == 1 and not relay.subscribers
    hello(relay, "quiet", "q/1")
    [inbox] = relay.inboxes.values()
    relay.dispatcher.host.place(
        {"_id": "k", "name": "n", "status": "pending", "next_claim_at": WHEN, "options": {}}
    )
    assert relay.dispatcher.hand_out(WHEN) == 1  # handed, and never acknowledged
    account = relay.dispatcher.accounts.get(inbox)
    assert account is not None and account.unacked_since is not None
    account.unacked_since -= credit.SILENT_SUBSCRIBER + 1
    relay.let_go_of_the_silent(account.unacked_since + credit.SILENT_SUBSCRIBER + 2)
    assert not relay.subscribers and "k" not in relay.dispatcher.awaiting  # it came back
    hello(relay, "cut", "c/1")
    [inbox] = relay.inboxes.values()
    relay.mail[mailbox.inbox_name("tasks", "c/1")].fail = True
    relay.broadcast(EVENT)
    await asyncio.sleep(0.01)
    assert not relay.subscribers and inbox.closing()
    database = relay.mail
    inboxes = [mailbox.inbox_name("tasks", s) for s in ("s/1", "q/1", "c/1")]
    assert sorted(database.dropped) == sorted(inboxes)  # each, the one cut off too
    assert database[inboxes[1]].last == [{"f": LET_GO}]  # (the cut-off one's failed)


async def test_a_subscriber_in_the_relays_process_gets_documents_bounded_alike() -> None:
    relay = relay_with(buffer=3 * FRAME_BYTES)
    local = relay.attach("me", ["n"], 1)
    for n in range(3):
        relay.broadcast({"n": n})
    assert [await local.next() for _ in range(2)] == [{"n": 0}, {"n": 1}]
    for n in range(3, 6):
        relay.broadcast({"n": n})  # the sixth would be one over
    assert relay.dropped == 1 and not relay.subscribers
    assert await local.next() is None  # dropped: it reconnects


def test_what_a_subscriber_reports_reaches_the_dispatcher() -> None:
    relay = relay_with(buffer=10_000)
    local = relay.attach("me", ["n"], 1)
    dispatcher = relay.dispatcher
    for key in ("k1", "k2"):
        dispatcher.host.place({"_id": key, "name": "n", "status": "pending",
                               "next_claim_at": WHEN, "options": {}})  # fmt: skip
    apply_report(dispatcher, local, {"free": 5, "got": 0, "done": 0, "names": ["n", "m"]})
    found = dispatcher.accounts.get(local)
    assert found is not None and found.credit == 5 and dispatcher.host.scope.names == ["m", "n"]
    assert dispatcher.hand_out(WHEN) == 2 and local.items[-1] == {
        "d": [["k1", "n", 0, None, None], ["k2", "n", 0, None, None]]
    }
    apply_report(dispatcher, local, {"missed": ["k1"], "gone": ["k2"]})
    assert not dispatcher.awaiting and set(dispatcher.host.queue.entries) == {"k1"}
    with pytest.raises(ValueError, match="'done' is not a count"):
        apply_report(dispatcher, local, {"free": 1, "got": 2})  # an earlier protocol's


async def test_the_writer_keeps_order_batches_per_turn_and_fails_once() -> None:
    inbox, failures = FakeInbox(), []
    writer = mailbox.Writer(inbox, failures.append)
    for n in range(3):
        writer.put({"n": n})
    assert len(writer) == 3
    await writer.drain()
    writer.put({"n": 3})
    await writer.drain()
    assert inbox.batches == [[{"n": 0}, {"n": 1}, {"n": 2}], [{"n": 3}]] and not len(writer)
    inbox.fail = True
    writer.put({"n": 4})
    writer.put({"n": 5})
    await writer.drain()
    assert len(failures) == 1 and writer.closed
    writer.put({"n": 6})  # closed: nothing more is written
    assert not len(writer) and len(inbox.batches) == 2


async def test_the_keys_received_count_for_the_whole_subscription() -> None:
    """``got`` answers the relay's ``sent`` on one subscription: finding work alone for a
    while (the relay's ``own``, then ``open``) must not reset it, or the credit sticks."""
    sent: list[dict[str, Any]] = []
    reporter = Reporter(lambda: 4, lambda: ["n"])
    reporter.connect(sent.append, ["n"])
    reporter.held("k0")  # not active: not the relay's business
    reporter.resume()
    reporter.received(3)
    await asyncio.sleep(0)
    reporter.pause()
    reporter.resume()
    reporter.missed("k1")
    await asyncio.sleep(0)
    assert sent == [
        {"free": 4, "got": 3, "done": 0, "sync": True},
        {"free": 4, "got": 3, "done": 0, "sync": True, "missed": ["k1"]},
    ]
    reporter.connect(sent.append, ["n"])  # a new subscription counts afresh
    assert reporter.got == 0 and not reporter.active


async def test_a_subscriber_whose_work_goes_well_says_nothing() -> None:
    """Claims and successes show in the relay's stream: the credit they change is not said;
    a slot freed by anything else is; keys received are acknowledged at a look only if nothing
    else showed the worker alive; a worker with free slots that was handed nothing syncs."""
    sent: list[dict[str, Any]] = []
    slots = {"free": 2}
    reporter = Reporter(lambda: slots["free"], lambda: ["n"])
    reporter.connect(sent.append, ["n"])
    reporter.resume()
    await asyncio.sleep(0)
    assert sent == [{"free": 2, "got": 0, "done": 0, "sync": True}]  # handed work: counts agree
    reporter.received(2)  # queued: two slots taken
    slots["free"] = 0
    reporter.claimed("a", WHEN)
    reporter.claimed("b", WHEN)
    reporter.check()  # their claims came back
    slots["free"] = 0  # a's run ended; its outcome on its way still counts as busy ...
    reporter.check()
    slots["free"] = 1
    reporter.succeeded("a")  # ... until its success is written: the relay counts that
    reporter.check()
    reporter.look()  # handed keys since the last look: no sync; it acted: no acknowledgement
    await asyncio.sleep(0)
    assert len(sent) == 1 and reporter.done == 1  # nothing said
    slots["free"] = 2  # b failed (or was released): no event gives the slot back
    reporter.check()
    await asyncio.sleep(0)
    assert sent[-1] == {"free": 2, "got": 2, "done": 1}
    reporter.received(1)  # handed, not claimed, and nothing else done by the next look
    slots["free"] = 1
    reporter.look()
    await asyncio.sleep(0)
    assert sent[-1] == {"free": 1, "got": 3, "done": 1}  # acknowledged
    reporter.claimed("c", WHEN)
    reporter.succeeded("c")
    slots["free"] = 2
    reporter.look()
    await asyncio.sleep(0)
    assert sent[-1] == {"free": 2, "got": 3, "done": 2, "sync": True}  # free, handed nothing
    reporter.look()
    await asyncio.sleep(0)
    assert len(sent) == 4  # an idle subscriber says nothing more
    # handed keys it claimed and finished between two looks, then nothing: it syncs (a relay
    # that counts its successes short would hand it nothing more), not a plain acknowledgement
    reporter.received(2)
    reporter.claimed("d", WHEN)
    reporter.succeeded("d")
    reporter.claimed("e", WHEN)
    reporter.succeeded("e")
    reporter.look()  # it was handed keys since the last look: nothing yet
    await asyncio.sleep(0)
    assert len(sent) == 4
    reporter.look()  # free, handed nothing since: sync
    await asyncio.sleep(0)
    assert sent[-1] == {"free": 2, "got": 5, "done": 4, "sync": True}
    # more due keys than slots: the relay counts too many of its successes
    reporter.received(3)
    slots["free"] = -1
    reporter.claimed("f", WHEN)
    reporter.look()
    await asyncio.sleep(0)
    assert sent[-1] == {"free": -1, "got": 8, "done": 4, "sync": True}


async def test_a_workers_new_hello_ends_its_earlier_subscription() -> None:
    relay = relay_with()
    relay.loop = asyncio.get_running_loop()
    hello(relay, "a", "a/1")
    hello(relay, "a", "a/2")  # its first subscription died without a goodbye
    assert list(relay.inboxes) == ["a/2"] and list(relay.subscribers.values()) == ["a"]
    await asyncio.sleep(0.01)
    assert relay.mail.dropped == [mailbox.inbox_name("tasks", "a/1")]


async def test_finding_work_alone_that_breaks_stops_the_shared_stream() -> None:
    """An own stream or sweep that dies of a bug must not leave the worker finding nothing:
    the shared stream's ``run`` raises (and the supervised worker stops)."""
    tasks = FakeInbox("tasks")
    tasks.database = FakeDatabase()  # type: ignore[attr-defined]
    fake_driver = cast(AsyncDriver, type("D", (), {"collections": {"tasks": tasks}})())
    finder = finder_for(None, FixedClock(WHEN), ["n"])
    stream = SharedStream(fake_driver, FixedClock(WHEN), "w1", finder, lambda: 1)

    async def broken(own_stream: bool) -> None:
        raise ValueError("a bug in the own stream")

    async def left_alone(relay_id: str | None) -> None:
        stream.alone.start(own_stream=True)
        await asyncio.Event().wait()

    stream.alone._run = broken  # type: ignore[method-assign]
    stream._follow_relay = left_alone  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="finding work alone failed") as caught:
        await asyncio.wait_for(stream.run(), 5)
    assert isinstance(caught.value.__cause__, ValueError)


async def test_finding_alone_reads_the_peers_at_once_and_a_worker_without_inboxes_leads() -> None:
    """The heartbeat reads the peers only while the worker ranks by them (``ranks``), so each
    start of finding work alone asks for a beat with that read at once; a worker that may not
    make an inbox follows its own stream for good, and runs the cluster's duties as a worker of
    ``--stream own`` does (nobody else would: it never takes the relay's lease again)."""
    asked: list[str] = []
    tasks = FakeInbox("tasks")
    tasks.database = FakeDatabase()  # type: ignore[attr-defined]
    fake_driver = cast(AsyncDriver, type("D", (), {"collections": {"tasks": tasks}})())
    others = Others(control=lambda: asked.append("read"))
    finder = finder_for(None, FixedClock(WHEN), ["n"], others=others)
    stream = SharedStream(fake_driver, FixedClock(WHEN), "w1", finder, lambda: 1)

    async def alone(own_stream: bool) -> None:
        await asyncio.Event().wait()

    stream.alone._run = alone  # type: ignore[method-assign]
    stream.state = SubscriberState.DISPATCHED  # the relay hands it its tasks: nothing to rank
    assert not stream.ranks() and not stream.leads()
    stream.state = SubscriberState.BETWEEN  # as a subscription's end leaves it, then alone
    stream.alone.start(own_stream=True)
    assert stream.ranks() and asked == ["read"]
    stream.alone.start(own_stream=True)  # already so: no second read
    assert asked == ["read"] and not stream.leads()
    falling = asyncio.create_task(stream._fall_back("no right to make a capped collection"))
    await asyncio.sleep(0)
    assert stream.leads() and stream.ranks()
    falling.cancel()
    stream.alone.stop()
    await asyncio.gather(falling, return_exceptions=True)


async def test_keys_said_held_stay_with_the_worker_when_a_relay_hands_it_work_again() -> None:
    """A key a limit holds back is said ``held``, and the relay forgets it: it is this worker's.
    When a relay hands this worker its tasks again (it was let go and said hello again, or
    another relay took over), what it found alone goes, but a key it said it keeps stays in its
    queue where it was (else nobody would claim it until the relay's sweep); one it claimed
    since is not kept."""
    tasks = FakeInbox("tasks")
    tasks.database = FakeDatabase()  # type: ignore[attr-defined]
    fake_driver = cast(AsyncDriver, type("D", (), {"collections": {"tasks": tasks}})())
    finder = finder_for(None, FixedClock(WHEN), ["n"])
    stream = SharedStream(fake_driver, FixedClock(WHEN), "w1", finder, lambda: 1)
    sink = ReportingSink(finder, stream.reports)
    later = WHEN + dt.timedelta(seconds=3)
    for key in ("held", "claimed", "alone"):
        finder.placement.place({"_id": key, "name": "n", "next_claim_at": WHEN, "options": {}})
    stream._enter(SubscriberState.DISPATCHED)  # (what it found alone so far goes)
    assert len(finder.placement.queue) == 0
    for key in ("held", "claimed", "alone"):
        finder.placement.hand(key, "n", 0, None, WHEN)
    sink.requeue_at("held", later)  # a limit holds them back: the relay forgets them
    sink.requeue_at("claimed", later)
    sink.claimed({"_id": "claimed", "next_claim_at": later})
    stream._enter(SubscriberState.BETWEEN)  # let go, or its relay went
    finder.placement.queue.note_overflow(later, "left-out")  # found alone: a full queue
    stream._enter(SubscriberState.DISPATCHED)
    assert finder.placement.queue.resume is None  # (a top-up would never come: no sweep)
    assert set(finder.placement.queue.entries) == {"held"} == set(finder.placement.meta)
    assert finder.placement.queue.entries["held"].claim_at == later
    sink.succeeded("held")
    stream._enter(SubscriberState.BETWEEN)
    stream._enter(SubscriberState.DISPATCHED)
    assert len(finder.placement.queue) == 0 and not stream.reports.kept


async def test_the_end_of_a_sequences_run_reaches_only_who_waits_for_its_group() -> None:
    """A sequence's lock is a task's, not a document's: when another worker's run of a grouped
    task ends, the relay tells the subscribers holding keys of that group (its lock may be
    free), and no one else: in a frame of its own (``wire.group_freed``), not a made-up limit
    event."""
    relay = relay_with()
    first = relay.attach("a", ["n"], 4)
    second = relay.attach("b", ["n"], 4)
    for key in ("k1", "k2"):
        relay.dispatcher.host.place(
            {
                "_id": key,
                "name": "n",
                "status": "pending",
                "next_claim_at": WHEN,
                "options": {"group": "g"},
            }
        )
    relay.dispatcher.held("k2", second)  # b keeps k2: it waits for the group's lock

    def ended(key: str, next_claim_at: Any) -> dict[str, Any]:
        return {
            "operationType": "update",
            "ns": {"coll": "tasks"},
            "documentKey": {"_id": key},
            "updateDescription": {"updatedFields": {"next_claim_at": next_claim_at}},
        }

    relay.on_change(ended("k1", WHEN + dt.timedelta(seconds=5)))  # a retry: still holds it
    relay.on_change(ended("k1", None))  # finished: the lock may be free
    notice = wire.group_freed("n", "g")
    assert await second.next() == notice == {"freed": ["n", "g"]}
    assert not first.items and not second.items  # once, to b alone
    relay.on_change(ended("k1", None))  # no one waits any more
    assert not second.items


def test_a_worker_alone_hears_the_end_of_another_workers_run_of_a_sequence() -> None:
    """With its own stream (or alone with the relay), a worker applies the task's event and
    tells its limit gate that the group's lock may be free."""
    heard: list[tuple[str, str]] = []
    finder = finder_for(None, FixedClock(WHEN), ["n"])
    finder.others = Others(group_freed=lambda name, group: heard.append((name, group)))
    finder.placement.place(
        {
            "_id": "k1",
            "name": "n",
            "status": "running",
            "next_claim_at": WHEN,
            "options": {"group": "g"},
        }
    )
    update = {"operationType": "update", "ns": {"coll": "tasks"}, "documentKey": {"_id": "k1"}}
    finder.on_change({**update, "updateDescription": {"updatedFields": {"attempts": 2}}})
    finder.on_change({**update, "updateDescription": {"updatedFields": {"next_claim_at": None}}})
    assert heard == [("n", "g")] and "k1" not in finder.placement.meta


async def test_the_relay_reads_on_once_its_own_workers_claim_is_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its own worker alone: after a change it read last, the relay's next read waits for the
    claim that change led to, so that the claim is sent first (W2); not between changes it read
    together (its worker claims them together), not for a claim begun before the change (a
    limited batch beside the main loop), and never past ``CLAIM_WAIT``."""
    monkeypatch.setattr(stream, "CLAIM_WAIT", 60.0)  # the test decides when the claim is back
    inflight = InFlight()
    relay = relay_with()
    local = relay.attach("me", ["n"], 1, inflight)
    await relay.opened()  # alone: its worker gets the changes in memory
    assert relay.direct is local and await local.next() is not None  # the OWN frame
    back = asyncio.Event()
    claims: list[str] = []

    async def worker() -> None:  # a claimer woken by each change, claiming its key
        while (change := await local.next()) is not None:
            await asyncio.sleep(0)  # the claimer's own turn
            with inflight.claiming([change["documentKey"]["_id"]]):
                claims.append(change["documentKey"]["_id"])
                await back.wait()
            back.clear()

    running = asyncio.create_task(worker())

    async def change(key: str, buffered: bool) -> asyncio.Task[None]:
        event = {"operationType": "insert", "ns": {"coll": "tasks"}, "documentKey": {"_id": key}}
        relay.on_change(event)
        relay.position.buffered = buffered
        await asyncio.sleep(0)  # as ``stream.follow`` does after each change
        return asyncio.create_task(relay.settle())

    earlier = asyncio.Event()

    async def limited_batch() -> None:  # begun before the change, back only at the test's end
        with inflight.claiming(["held"]):
            await earlier.wait()

    batch = asyncio.create_task(limited_batch())
    await asyncio.sleep(0)
    settle = await change("k1", buffered=False)
    for _ in range(20):
        await asyncio.sleep(0)
    assert claims == ["k1"] and not settle.done()  # the next read waits for k1's claim
    back.set()
    await asyncio.wait_for(settle, 5)  # k1's claim is back; the batch begun before is not
    settle = await change("k2", buffered=True)  # more read already: handed on at once
    await asyncio.wait_for(settle, 5)
    assert local.first.mark is not None  # it waits after the last change it read
    monkeypatch.setattr(stream, "CLAIM_WAIT", 0.01)
    await asyncio.sleep(0)
    assert claims == ["k1", "k2"]  # k2's claim is still on its way
    settle = await change("k3", buffered=False)
    await asyncio.wait_for(settle, 5)  # k2's claim never came back: the wait is bounded
    assert local.first.mark is None
    running.cancel()
    earlier.set()
    await batch


async def test_a_worker_built_to_share_its_stream_gives_the_relay_its_claims() -> None:
    """The wiring: without it the relay's wait would silently wait for nothing."""
    registry = Registry()

    @registry.task("noop")
    async def noop(ctx: TaskContext) -> None:
        return None

    worker = Worker(registry, uri="mongodb://127.0.0.1:1/?directConnection=true")
    shared = worker.parts.finding.shared
    assert shared is not None and shared.claims is worker.parts.inflight
    alone = Worker(registry, uri="mongodb://127.0.0.1:1/?directConnection=true", stream="own")
    [own] = [s for s in alone.parts.finding.services if isinstance(s, OwnStream)]
    assert own.claims is alone.parts.inflight


class Heard:
    """An ``Inbox`` that notes what reaches it."""

    def __init__(self) -> None:
        self.changes: list[Any] = []
        self.settled = 0
        self.restarts = 0

    async def opened(self) -> None:
        return None

    def on_change(self, change: Any) -> None:
        self.changes.append(change["documentKey"]["_id"])

    async def settle(self) -> None:
        self.settled += 1

    def restarted(self) -> None:
        self.restarts += 1


async def test_an_own_stream_reads_on_once_its_workers_claim_is_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the relay's (above): an own stream's next read waits for the claim its last change
    led to, not between changes it read together, and not past ``CLAIM_WAIT``; a reopened
    stream waits for nothing handed before."""
    monkeypatch.setattr(stream, "CLAIM_WAIT", 60.0)
    inflight = InFlight()
    heard = Heard()
    at = events.Position(fresh_when_lost=True)
    inbox = ClaimsFirstInbox(heard, ClaimsFirst(inflight), at)
    back = asyncio.Event()

    async def change(key: str, buffered: bool) -> asyncio.Task[None]:
        inbox.on_change({"operationType": "insert", "documentKey": {"_id": key}})
        at.buffered = buffered
        await asyncio.sleep(0)
        return asyncio.create_task(inbox.settle())

    async def claim(key: str) -> None:
        with inflight.claiming([key]):
            await back.wait()

    settle = await change("k1", buffered=False)
    claiming = asyncio.create_task(claim("k1"))  # begun after the change, as the claimer's
    for _ in range(20):
        await asyncio.sleep(0)
    assert heard.changes == ["k1"] and heard.settled == 1 and not settle.done()
    back.set()
    await asyncio.wait_for(settle, 5)
    await claiming
    back.clear()
    await asyncio.wait_for(await change("k2", buffered=True), 5)  # more read: on at once
    assert inbox.first.mark is not None
    monkeypatch.setattr(stream, "CLAIM_WAIT", 0.01)
    claiming = asyncio.create_task(claim("k2"))
    await asyncio.sleep(0)
    await asyncio.wait_for(await change("k3", buffered=False), 5)  # bounded by CLAIM_WAIT
    assert inbox.first.mark is None and heard.changes == ["k1", "k2", "k3"]
    inbox.on_change({"operationType": "insert", "documentKey": {"_id": "k4"}})
    inbox.restarted()  # reopened: what was handed before is not waited for
    assert inbox.first.mark is None and heard.restarts == 1
    back.set()
    await claiming


async def test_a_subscription_ends_at_its_relays_last_frame() -> None:
    """The relay's last frame before it drops an inbox (``wire.LET_GO``) ends the subscription
    as the end of its tail does: the subscriber says hello again."""
    database = FakeDatabase()
    tasks = SimpleNamespace(database=database, name="tasks")
    driver = SimpleNamespace(collections={"tasks": tasks, "inboxes": tasks})
    sub = InboxSubscription(cast(AsyncDriver, driver), "relay-1", "w1", lambda: None)

    async def frames() -> AsyncIterator[dict[str, Any]]:
        yield {"f": {"relay": "open"}}
        yield {"f": LET_GO}
        raise AssertionError("read past the last frame")

    sub._frames = frames()
    assert await sub.next_frame() == {"relay": "open"}
    assert await sub.next_frame() is None


async def test_the_relays_mode_is_one_state_its_transitions_in_one_place() -> None:
    """``RelayMode``: starting until its stream opens; alone with its own worker (the task
    events passed on, the host queue idle); handing out once another subscriber comes (the
    host queue scans at once, ``OPEN`` to everyone); alone again when that one goes."""
    relay = relay_with()
    relay.loop = asyncio.get_running_loop()
    scans: list[bool] = []

    async def rescan(requested: bool = False) -> int:
        scans.append(requested)  # (what a scan reads is the scanner's tests' business)
        return 0

    relay.host.scanner.rescan = rescan  # type: ignore[method-assign]
    own = relay.attach("me", ["n"], 1)
    assert relay.mode is RelayMode.STARTING and not own.items  # nothing before its stream
    await relay.opened()
    assert relay.mode is RelayMode.ALONE and relay.direct is own and scans == []
    assert await own.next() == wire.OWN  # its worker scans for itself
    hello(relay, "a", "a/1")
    assert relay.mode is RelayMode.HANDING and relay.direct is None
    await asyncio.sleep(0)
    assert scans == [True]  # the host queue scans at once, not after the sweep's gap
    assert await own.next() == wire.OPEN
    await asyncio.sleep(0.01)
    inbox = relay.mail[mailbox.inbox_name("tasks", "a/1")]
    assert inbox.batches == [[{"f": wire.OPEN}]]  # once, though it came as the mode changed
    hello(relay, "b", "b/1", names=["m"])  # new names, handing out already: scanned at once
    await asyncio.sleep(0)
    assert scans == [True, True]
    for subscription in ("a/1", "b/1"):
        relay._on_report({"to": relay.id, "from": subscription, "f": {"bye": True}})
    assert relay.mode is RelayMode.ALONE and await own.next() == wire.OWN
    assert await relay.host.rescan() == 0 and scans == [True, True]  # idle: scans nothing


async def test_a_subscriber_hears_a_groups_end_and_its_relays_successor_in_frames() -> None:
    """The end of a run of a group it waits for reaches the worker's limit gate as
    ``Others.group_freed`` (a frame of its own: no made-up limit event); the last frame of a
    relay that took over names it, and ends the subscription to the one before."""
    heard: list[tuple[str, str]] = []
    tasks = FakeInbox("tasks")
    tasks.database = FakeDatabase()  # type: ignore[attr-defined]
    fake_driver = cast(AsyncDriver, type("D", (), {"collections": {"tasks": tasks}})())
    others = Others(group_freed=lambda name, group: heard.append((name, group)))
    finder = finder_for(None, FixedClock(WHEN), ["n"], others=others)
    stream = SharedStream(fake_driver, FixedClock(WHEN), "w1", finder, lambda: 1)
    await stream._on_frame(wire.group_freed("n", "g"), "r/1")
    assert heard == [("n", "g")]

    database = FakeDatabase()
    tasks_ = SimpleNamespace(database=database, name="tasks")
    driver = SimpleNamespace(collections={"tasks": tasks_, "inboxes": tasks_})
    sub = InboxSubscription(cast(AsyncDriver, driver), "relay-1", "w1", lambda: None)

    async def frames() -> AsyncIterator[dict[str, Any]]:
        yield {"f": wire.taken("w2/new")}
        raise AssertionError("read past the last frame")

    sub._frames = frames()
    assert await sub.next_frame() is None and sub.taken_by == "w2/new"


async def test_a_subscription_follows_the_relay_that_took_over_from_the_same_inbox() -> None:
    """A relay that took the lease over writes its name into the inbox (``wire.taken``): the
    subscription says hello to it from the same inbox and reads on (no collection made or
    dropped); one this process holds ends it (the worker follows it in memory)."""
    database = FakeDatabase()
    tasks_ = SimpleNamespace(database=database, name="tasks")
    driver = SimpleNamespace(collections={"tasks": tasks_, "inboxes": tasks_})
    follows = {"w2/new": True, "w1/mine": False}
    sub = InboxSubscription(
        cast(AsyncDriver, driver),
        "relay-1",
        "w1",
        lambda: None,
        hello=lambda: {"worker_id": "w1", "names": ["n"], "free": 3},
        on_moved=follows.__getitem__,
    )

    async def frames() -> AsyncIterator[dict[str, Any]]:
        yield {"f": wire.taken("w2/new")}
        yield {"f": wire.taken("w2/new")}  # (said again: followed already)
        yield {"f": wire.OPEN}
        yield {"f": wire.taken("w1/mine")}
        raise AssertionError("read past the end")

    sub._frames = frames()
    assert await sub.next_frame() == wire.OPEN and sub.relay_id == "w2/new"
    await asyncio.sleep(0.01)
    [[hello]] = database[mailbox.reports_name("tasks")].batches
    assert hello["to"] == "w2/new" and hello["f"]["hello"] == wire.PROTOCOL
    assert hello["f"]["inbox"] == sub.inbox and hello["f"]["free"] == 3  # the same inbox
    assert await sub.next_frame() is None and sub.taken_by == "w1/mine"


async def test_a_subscriber_reads_every_limit_again_when_its_relay_says_open() -> None:
    """``OPEN`` starts (or starts again) a subscription: a change of a limit broadcast before
    the relay had its channel (a new relay, a hello after being let go, its stream reopened)
    reached no frame of this worker, so its limit gate reads them all again, as an own stream
    does when it opens afresh. The periodic read is not the only bound of that gap."""
    opened: list[bool] = []
    tasks = FakeInbox("tasks")
    tasks.database = FakeDatabase()  # type: ignore[attr-defined]
    fake_driver = cast(AsyncDriver, type("D", (), {"collections": {"tasks": tasks}})())
    finder = finder_for(
        None, FixedClock(WHEN), ["n"], others=Others(opened=lambda: opened.append(True))
    )
    stream = SharedStream(fake_driver, FixedClock(WHEN), "w1", finder, lambda: 1)
    await stream._on_frame(wire.OPEN, "r/1")
    assert opened == [True]
    await stream._on_frame(wire.OPEN, "r/1")  # its relay's stream reopened: maybe past events
    assert opened == [True, True]
