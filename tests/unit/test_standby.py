"""The relay's standby and its lease, without MongoDB (``scripted``): who is asked to stand by,
the watch that takes a silent relay's lease over, the lease's renewals and freshness, and the
frames that move a subscriber to the relay that took over."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pymongo.results import UpdateResult
from scripted import AsyncScriptedDriver, Step

from mtask.driver import MODIFY_ONCE, AsyncDriver, Call
from mtask.store import relays
from mtask.worker.finding.shared import lease as lease_module
from mtask.worker.finding.shared import standby as standby_module
from mtask.worker.finding.shared import wire
from mtask.worker.finding.shared.lease import (
    LEASE_TTL,
    RENEW_EVERY,
    TAKE_OVER_AFTER,
    WATCHED_RENEW_EVERY,
    LeaseLost,
    RelayLease,
)
from mtask.worker.finding.shared.standby import POST_TTL, Appointments, Standby


class Candidate:
    def __init__(self, name: str, closing: bool = False) -> None:
        self.name = name
        self._closing = closing

    def closing(self) -> bool:
        return self._closing


def test_the_relay_asks_one_subscriber_at_a_time_to_stand_by() -> None:
    """Nobody holds the post: the next subscriber in another process is asked, once it had the
    time to take it, another; a relay with a standby asks nobody."""
    asked = Appointments()
    a, b, gone = Candidate("a"), Candidate("b"), Candidate("gone", closing=True)
    nobody, watched = relays.Renewal(None, False), relays.Renewal("a", True)
    assert asked.ask(nobody, []) is None  # no subscriber in another process: nobody to ask
    assert asked.ask(nobody, [gone, a, b]) is a
    assert asked.ask(nobody, [gone, a, b]) is None  # a has POST_TTL to take the post
    assert asked._last is not None
    asked._last -= POST_TTL  # ... and did not
    assert asked.ask(nobody, [a, b]) is b
    assert asked.ask(watched, [a, b]) is None and asked._last is None  # somebody stands by
    assert asked.asked == 2


def relays_driver(*steps: Step) -> AsyncScriptedDriver:
    driver = AsyncScriptedDriver(*steps)
    tasks = SimpleNamespace(name="tasks", database=None)
    driver.collections = {"tasks": tasks, "inboxes": tasks}
    return driver


def on_relays(reply: Any, check: Any = None) -> Step:
    """A renewal of the lease: a ``findAndModify`` that returns the standby's post."""
    return Step(MODIFY_ONCE, reply, collection="relays", check=check)


def looks_at_relays(reply: Any, check: Any = None) -> Step:
    """A standby's look: the ``findAndModify`` whose document says how long ago the relay
    renewed, or that it was taken over."""
    return Step("find_one_and_update", reply, collection="relays", check=check)


def updates_relays(matched: bool, check: Any = None) -> Step:
    """A take of the post or of the lease: an update whose match is the answer."""
    reply = UpdateResult({"n": int(matched), "nModified": int(matched)}, acknowledged=True)
    return Step("update_one", reply, collection="relays", check=check)


async def test_a_standby_takes_the_lease_over_once_the_relay_stops_renewing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It takes its post, then looks at the lease only when the relay could first be taken over
    (``TAKE_OVER_AFTER`` less how long ago the relay renewed, by the server's clock): each look
    one update that takes the lease over only while the relay has not renewed for that long by
    the server's clock, and only for the worker that holds the post, else renews the post."""
    monkeypatch.setattr(standby_module, "TAKE_OVER_AFTER", 0.05)
    waits: list[float] = []
    sleep = asyncio.sleep

    async def recorded(delay: float) -> None:
        waits.append(delay)
        await sleep(0)

    monkeypatch.setattr(standby_module.asyncio, "sleep", recorded)
    taken: dict[str, Any] = {}

    def look(call: Call) -> None:
        filter_, update = call.args
        assert filter_ == {"_id": "tasks", "relay": "r/1", "standby": "w2"}
        silent = update[0]["$set"]["relay"]["$cond"][0]["$cond"][1]
        assert silent["$lte"][1] == {"$subtract": ["$$NOW", 50]}
        new = update[0]["$set"]["relay"]["$cond"][1]["$literal"]
        assert new.startswith("w2/")  # a relay of its own
        assert update[0]["$set"]["standby"]["$cond"][1] is None  # which starts without one
        taken["relay"] = new

    def post(call: Call) -> None:
        filter_, update = call.args
        assert filter_["relay"] == "r/1" and update[0]["$set"]["standby"] == "w2"

    driver = relays_driver(
        updates_relays(True, post),
        looks_at_relays({"relay": "r/1", "ago": 20}, look),  # renewed 20 ms ago: look in 30 ms
        looks_at_relays({"relay": "r/1", "ago": 0}, look),  # renewed just now: look in 50 ms
        looks_at_relays(taken, look),  # it stopped renewing: taken over
    )
    lease = await Standby(cast(AsyncDriver, driver), "tasks", "w2", "r/1").watch()
    assert lease is not None and lease.id == taken["relay"] and driver.done
    assert lease.fresh()  # just taken: it may hand out at once
    assert waits == [0.0, pytest.approx(0.03), pytest.approx(0.05)]  # no look in between


async def test_a_standby_stops_watching_when_its_post_is_anothers() -> None:
    driver = relays_driver(updates_relays(False))  # the post is another's, or the relay changed
    assert await Standby(cast(AsyncDriver, driver), "tasks", "w2", "r/1").watch() is None
    assert driver.done


async def test_the_lease_is_renewed_often_only_while_somebody_could_stand_by() -> None:
    """A lone worker's relay renews as seldom as before (nobody could take it over early); one
    with subscribers in other processes, or a standby, often enough for the standby to take it
    over within a second of its death; a lease another holds stops the relay."""
    driver = relays_driver(
        on_relays({"_id": "tasks", "standby": None, "watched": False}),
        on_relays({"_id": "tasks", "standby": "w2", "watched": True}),
        on_relays(None),
    )
    lease = RelayLease(cast(AsyncDriver, driver), "tasks", "w1/x")
    assert lease.every(candidates=False) == RENEW_EVERY
    assert lease.every(candidates=True) == WATCHED_RENEW_EVERY < TAKE_OVER_AFTER / 2
    assert await lease.renew(candidates=False) == relays.Renewal(None, False)
    assert lease.fresh_until - time.monotonic() > TAKE_OVER_AFTER  # nobody to take it early
    assert await lease.renew(candidates=False) == relays.Renewal("w2", True)
    assert lease.every(candidates=False) == WATCHED_RENEW_EVERY  # watched: often
    assert lease.fresh_until - time.monotonic() <= TAKE_OVER_AFTER
    with pytest.raises(LeaseLost, match="another relay"):
        await lease.renew(candidates=True)


async def test_a_relay_that_cannot_renew_stops_writing_and_then_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Frozen or cut off, its lease may be its standby's by now: its frames wait
    (``until_fresh``) instead of going into the inboxes its successor let go of, and once it
    could not renew for ``LEASE_TTL - RENEW_EVERY`` it stops."""
    monkeypatch.setattr(lease_module, "RENEW_TIMEOUT", 0.01)

    class Hanging:
        collections = {"tasks": SimpleNamespace(name="tasks"), "inboxes": SimpleNamespace()}

        async def run(self, op: Any) -> None:
            await asyncio.Event().wait()  # a socket that never answers

    lease = RelayLease(cast(AsyncDriver, Hanging()), "tasks", "w1/x")
    lease.fresh_until = time.monotonic() - 1  # its last renewal is too old
    waiting = asyncio.create_task(lease.until_fresh())
    assert await lease.renew(candidates=True) is None  # not answered: tried again later
    await asyncio.sleep(0)
    assert not waiting.done()  # frames wait
    lease.renewed -= LEASE_TTL
    with pytest.raises(LeaseLost, match="cannot renew"):
        await lease.renew(candidates=True)
    waiting.cancel()


def test_frames_that_move_a_subscriber_and_free_a_group_are_spelled_in_the_wire() -> None:
    """The frames of protocol 7 (8 since the inboxes have a database of their own): a relay
    that took the lease over names itself in a frame into each inbox it does not serve; the
    end of a group's run is a frame of its own (no made-up limit event); tasks handed over of
    another shape are left out."""
    assert wire.PROTOCOL == 8
    taken = wire.taken("w2/abc")
    assert wire.says(taken) == "taken" and wire.taken_by(taken) == "w2/abc"
    assert wire.taken_by(wire.LET_GO) is None and wire.taken_by({"by": "w2/abc"}) is None
    assert wire.says(wire.STANDBY) == "standby" and wire.says({"relay": 1}) is None
    assert wire.freed(wire.group_freed("n", "g")) == ("n", "g")
    assert wire.freed({"freed": ["n", 3]}) is None and wire.freed({"freed": "n"}) is None
    handed = wire.handed(wire.hand_out([["k", "n", 0, None, "g"], ["bad"], "worse"]))
    assert handed == [wire.Handed("k", "n", 0, None, "g")]
    assert wire.handed({"relay": "open"}) is None
