"""The shared stream's framing, naming and filtering, without MongoDB."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

import bson
import pytest

from mtask import store
from mtask.clock import FixedClock
from mtask.worker.dispatch import Dispatcher
from mtask.worker.presence import Assignment
from mtask.worker.relay_wire import decode, endpoint, frame, read_frame
from mtask.worker.stream import stream_pipeline
from mtask.worker.stream_relay import Local, Relay, _Socket

WHEN = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)


def reader_of(*chunks: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    if eof:
        reader.feed_eof()
    return reader


async def test_frames_round_trip_whatever_the_chunking() -> None:
    events = [
        {"operationType": "insert", "documentKey": {"_id": "k1"}, "fullDocument": {"_id": "k1"}},
        {"updateDescription": {"updatedFields": {"next_claim_at": WHEN}}, "documentKey": {}},
        {"relay": "open"},
    ]
    data = b"".join(frame(e) for e in events)
    for size in (1, 3, 7, len(data)):
        reader = reader_of(*(data[i : i + size] for i in range(0, len(data), size)))
        got = []
        while (one := await read_frame(reader)) is not None:
            got.append(decode(one))
        assert got == events  # datetimes come back timezone-aware, as from the driver


async def test_a_cut_or_bad_frame_is_a_connection_error() -> None:
    whole = frame({"a": 1})
    with pytest.raises(ConnectionError):
        await read_frame(reader_of(whole[:-1]))
    with pytest.raises(ConnectionError):
        await read_frame(reader_of(whole[:2]))
    with pytest.raises(ConnectionError):
        await read_frame(reader_of((2**31 - 1).to_bytes(4, "little") + b"x"))
    with pytest.raises(ConnectionError):
        await read_frame(reader_of((3).to_bytes(4, "little")))
    assert await read_frame(reader_of()) is None  # the end, between frames


def test_endpoint_names_one_collection() -> None:
    u = uuid.uuid4()
    name = endpoint("db", "tasks", u)
    assert name.startswith("\x00mtask-stream-")  # abstract: no file, gone with its process
    assert name == endpoint("db", "tasks", bson.Binary(u.bytes, 4))  # any uuidRepresentation
    others = {endpoint("db2", "tasks", u), endpoint("db", "jobs", u), endpoint("db", "tasks", None)}
    assert name not in others and len(others) == 3
    assert len(name.encode()) < 108  # sun_path


def test_the_relays_pipeline_leaves_out_the_claims_and_successes_of_its_subscribers() -> None:
    one, host = stream_pipeline("tasks", "w1"), stream_pipeline("tasks", ("w1", "w2"))
    tag = f"updateDescription.updatedFields.{store.LAST_WRITE}"
    assert one[0]["$match"]["$or"][0]["$or"][1][tag] == {
        "$nin": [store.claim_tag("w1"), store.success_tag("w1")]
    }
    assert host[0]["$match"]["$or"][0]["$or"][1][tag]["$nin"] == [
        store.claim_tag(w) if i % 2 == 0 else store.success_tag(w)
        for w in ("w1", "w2")
        for i in range(2)
    ]
    nobody = stream_pipeline("tasks", ())
    assert tag not in nobody[0]["$match"]["$or"][0]["$or"][1]  # every write's event
    assert one[0]["$match"]["$or"][1] == host[0]["$match"]["$or"][1]  # controls etc. alike


class FakeTransport:
    def __init__(self, pending: int = 0) -> None:
        self.pending = pending
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.pending

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


class FakeWriter:
    def __init__(self, pending: int = 0) -> None:
        self.transport = FakeTransport(pending)
        self.sent: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sent.append(data)
        self.transport.pending += len(data)


def connection(pending: int = 0) -> tuple[_Socket, FakeWriter]:
    writer = FakeWriter(pending)
    return _Socket(writer), writer  # type: ignore[arg-type]


def relay_with(buffer: int = 100, **subscribers: Any) -> Relay:
    relay = Relay(None, "tasks", "me", buffer, Dispatcher.build(None, "me", FixedClock(WHEN),
                  Assignment(("n",)), 30.0, 25.0, 100))  # fmt: skip
    for name, sub in subscribers.items():
        if isinstance(sub, _Socket | Local):
            sub.relay = relay
        relay._add(sub, name, ["n"], 1)
    return relay


EVENT = {"x": "y" * 7}  # a 20-byte frame


async def test_a_slow_subscriber_is_dropped_and_never_blocks_the_others() -> None:
    assert len(frame(EVENT)) == 20
    (fast, fast_writer), (slow, slow_writer) = connection(), connection(pending=90)
    relay = relay_with(me=fast, slow=slow)
    relay.loop = asyncio.get_running_loop()
    relay.broadcast(EVENT)
    relay.broadcast(EVENT)
    await asyncio.sleep(0)  # one write per turn of the loop
    assert fast_writer.sent == [frame(EVENT) * 2] and slow_writer.sent == []
    assert slow_writer.transport.aborted and relay.dropped == 1
    assert list(relay.subscribers.values()) == ["me"] and list(relay.dispatcher.subscribers)
    assert relay._switch  # its writes are no longer left out: the stream's filter changes
    for _ in range(4):
        relay.broadcast(EVENT)
    assert fast_writer.transport.aborted and relay.dropped == 2  # 6 * 20 > 100: even the owner
    assert not relay.dispatcher.subscribers


async def test_a_subscriber_in_the_relays_process_gets_documents_bounded_alike() -> None:
    local = Local()
    relay = relay_with(buffer=3 * Local.EVENT_BYTES, me=local)
    for n in range(3):
        relay.broadcast({"n": n})
    assert [await local.next() for _ in range(2)] == [{"n": 0}, {"n": 1}]
    for n in range(3, 6):
        relay.broadcast({"n": n})  # the sixth would be one over
    assert relay.dropped == 1 and not relay.subscribers
    assert await local.next() is None  # dropped: it reconnects


def test_what_a_subscriber_reports_reaches_the_dispatcher() -> None:
    local = Local()
    relay = relay_with(buffer=10_000, me=local)
    dispatcher = relay.dispatcher
    for key in ("k1", "k2"):
        dispatcher.host.place({"_id": key, "name": "n", "status": "pending",
                               "next_claim_at": WHEN, "options": {}})  # fmt: skip
    relay.report(local, {"free": 5, "got": 0, "names": ["n", "m"]})
    assert dispatcher.subscribers[local].credit == 5 and dispatcher.host.names == ["m", "n"]
    assert dispatcher.hand_out(WHEN) == 2 and local.items[-1] == {
        "d": [["k1", "n", 0, None], ["k2", "n", 0, None]]
    }
    relay.report(local, {"claimed": [["k1", WHEN]], "done": ["k2"]})
    assert not dispatcher.awaiting and set(dispatcher.host.queue.entries) == {"k1"}
