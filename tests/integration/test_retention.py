"""Retention: expire_at written by the finishing update on every path, MongoDB's TTL monitor
removing expired tasks, defaults resolved at publish, purge, and exactly-once of schedule ticks
and flow outboxes after a purge."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from harness import T0
from pymongo import MongoClient

from mtask import TaskClient
from mtask.cli import main
from mtask.clock import FixedClock
from mtask.errors import InvalidTask
from mtask.schedules.ticks import tick_key
from mtask.statemachine import compute_expire_at
from mtask.store import CLAIMED_FIELDS, Outcome, RunState, claim, finish, finish_many, retention
from mtask.store.flows import flush_outboxes
from mtask.store.retention import release_parents
from mtask.store.schedules import due, fire
from mtask.vocabulary import DAY_MS, DEFAULT_KEEP_MS, FOREVER, TaskStatus

Doc = dict[str, Any]


def claimed(tc: TaskClient, keys: list[str], now: dt.datetime, name: str = "n") -> list[Doc]:
    docs: list[Doc] = tc._run(claim(keys, [name], "w", now, fields=CLAIMED_FIELDS))
    assert len(docs) == len(keys)
    return docs


def ms(value: int) -> dt.timedelta:
    return dt.timedelta(milliseconds=value)


def check_expiry(tc: TaskClient, key: str) -> Doc:
    """The stored expire_at is the one the pure rule computes from the stored document."""
    doc = tc.collection.find_one({"_id": key})
    assert doc is not None
    assert doc.get("expire_at") == compute_expire_at(doc, TaskStatus(doc["status"]))
    return doc


def test_every_finishing_path_writes_expire_at(tc: TaskClient, clock: FixedClock) -> None:
    keep = {"keep_succeeded_ms": 5_000}
    tc.publish_many([{"name": "n", "key": f"g{i}", "options": keep} for i in range(3)])
    tc.publish("n", "one", options=keep)
    tc.publish("n", "pipe", options={**keep, "concurrency": 2})
    tc.publish("n", "forever", options={"keep_succeeded_ms": FOREVER})
    tc.publish("n", "fail", options={"max_retries": 0})
    tc.publish("n", "cancel")
    now = clock.now()
    docs = {d["_id"]: d for d in claimed(tc, ["g0", "g1", "g2", "one", "pipe", "forever"], now)}

    def success(key: str, keep_ms: int | None = 5_000) -> Outcome:
        return Outcome(key, docs[key]["claim_run_id"], RunState.SUCCESS, keep_ms=keep_ms)

    # the grouped update_many, the single shortcut, the pipeline (concurrency 2) and forever
    assert tc._run(finish_many([success("g0"), success("g1"), success("g2")], now)) == 3
    assert tc._run(finish_many([success("one")], now)) == 1
    assert tc._run(finish(success("pipe"), now)) is not None
    assert tc._run(finish_many([success("forever", None)], now)) == 1
    for key in ("g0", "g1", "g2", "one"):
        assert check_expiry(tc, key)["expire_at"] == now + ms(5_000)
    assert "expire_at" not in check_expiry(tc, "pipe")  # one success of two: still open
    assert "expire_at" not in check_expiry(tc, "forever")

    [fail] = claimed(tc, ["fail"], now)
    tc._run(finish(Outcome("fail", fail["claim_run_id"], RunState.FAIL, error="x"), now))
    assert check_expiry(tc, "fail")["expire_at"] == now + ms(DEFAULT_KEEP_MS["failed"])
    tc.cancel("cancel")
    assert check_expiry(tc, "cancel")["expire_at"] == now + ms(DEFAULT_KEEP_MS["cancelled"])
    tc.retry("cancel")  # open again: no expiry
    assert "expire_at" not in check_expiry(tc, "cancel")


def test_defaults_are_resolved_at_publish(tc: TaskClient) -> None:
    tc.set_retention("*", failed_ms=DAY_MS)
    tc.set_retention("n", succeeded_ms=60_000, cancelled_ms=FOREVER)
    tc.publish("n", "a")
    tc.publish("n", "b", options={"keep_succeeded_ms": 1000})
    tc.publish_many([{"name": "other", "key": "c"}])
    options = {k: tc.collection.find_one({"_id": k})["options"] for k in "abc"}  # type: ignore[index]
    assert (options["a"]["keep_succeeded_ms"], options["a"]["keep_failed_ms"]) == (60_000, DAY_MS)
    assert options["a"]["keep_cancelled_ms"] == FOREVER
    assert options["b"]["keep_succeeded_ms"] == 1000
    assert options["c"]["keep_succeeded_ms"] == DEFAULT_KEEP_MS["succeeded"]
    assert options["c"]["keep_failed_ms"] == DAY_MS
    with pytest.raises(InvalidTask, match="succeeded_ms"):
        tc.set_retention("n", succeeded_ms=-5)
    with pytest.raises(InvalidTask, match="keep_failed_ms"):
        tc.publish("n", "bad", options={"keep_failed_ms": -2})
    assert tc.get("bad") is None


def test_defaults_are_read_once_per_window_and_at_once_after_a_change(
    tc: TaskClient, mongo_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[object] = []
    original = retention.all_defaults

    def counting() -> Any:
        reads.append(None)
        return original()

    monkeypatch.setattr(retention, "all_defaults", counting)
    tc.publish("n", "a")
    tc.publish_many([{"name": "n", "key": f"m{i}"} for i in range(3)])
    tc.publish("n", "b")
    assert len(reads) == 1  # no extra round trip per publish
    tc.set_retention("n", succeeded_ms=60_000)  # this client applies its own change at once
    tc.publish("n", "c")
    assert tc.collection.find_one({"_id": "c"})["options"]["keep_succeeded_ms"] == 60_000  # type: ignore[index]
    with TaskClient(mongo_uri, database=tc.db.name, clock=tc.clock) as other:
        other.set_retention("n", succeeded_ms=120_000)  # another process's change: ...
    tc.publish("n", "d")  # ... not seen within the window
    assert tc.collection.find_one({"_id": "d"})["options"]["keep_succeeded_ms"] == 60_000  # type: ignore[index]
    monkeypatch.setattr(retention, "CACHE_SECONDS", 0.0)
    tc._core.retention_cache.clear()  # the window ended
    tc.publish("n", "e")
    assert tc.collection.find_one({"_id": "e"})["options"]["keep_succeeded_ms"] == 120_000  # type: ignore[index]


def test_the_ttl_monitor_removes_expired_tasks_only(
    client: TaskClient, mongo: MongoClient[Doc]
) -> None:
    # a runtime parameter: the TTL monitor passes every second instead of every minute (it only
    # makes other databases' TTL indexes work sooner)
    mongo.admin.command("setParameter", 1, ttlMonitorSleepSecs=1)
    client.publish("n", "short", options={"keep_succeeded_ms": 2000})
    client.publish("n", "long", options={"keep_failed_ms": DAY_MS, "max_retries": 0})
    now = client.now()
    docs = {d["_id"]: d for d in claimed(client, ["short", "long"], now)}
    outcomes = [
        Outcome("short", docs["short"]["claim_run_id"], RunState.SUCCESS, keep_ms=2000),
        Outcome("long", docs["long"]["claim_run_id"], RunState.FAIL, error="boom"),
    ]
    deletes = [{"$match": {"operationType": "delete"}}]
    with client.collection.watch(deletes) as stream:
        assert client._run(finish_many(outcomes, now)) == 2
        short = client.collection.find_one({"_id": "short"})
        assert short is not None and short["expire_at"] == now + ms(2000)
        event = stream.next()  # the TTL monitor's delete (the test's timeout bounds the wait)
    assert event["documentKey"]["_id"] == "short"
    assert client.get("short") is None
    long = client.get("long")
    assert long is not None and long.status == "failed"
    assert long.expire_at == now + ms(DAY_MS)


def test_purge_removes_exactly_the_matching_finished_tasks(
    tc: TaskClient, clock: FixedClock
) -> None:
    tc.publish_many([{"name": n, "key": f"{n}{i}"} for n in "ab" for i in range(4)])
    now = clock.now()
    docs = {d["_id"]: d for d in claimed(tc, ["a0", "a1"], now, name="a")}
    docs |= {d["_id"]: d for d in claimed(tc, ["b0", "b1"], now, name="b")}
    done = [Outcome(k, d["claim_run_id"], RunState.SUCCESS) for k, d in docs.items()]
    tc._run(finish_many(done, now))
    tc.cancel("a2")
    clock.advance(days=2)
    [late] = claimed(tc, ["b2"], clock.now(), name="b")
    tc._run(finish_many([Outcome("b2", late["claim_run_id"], RunState.SUCCESS)], clock.now()))
    # open: a3 and b3 pending; everything else finished
    assert tc.purge(name="a", status=["succeeded"], dry_run=True) == 2
    assert tc.purge(name="a", status=["succeeded"]) == 2
    assert {t.key for t in tc.list(name="a")} == {"a2", "a3"}
    assert tc.purge(older_than=dt.timedelta(days=1)) == 3  # a2 (cancelled), b0, b1; not b2
    assert {t.key for t in tc.list()} == {"a3", "b2", "b3"}
    assert tc.purge(keys=["a3", "b3"]) == 0  # open tasks are never purged
    assert tc.purge(keys=["b2", "b3"]) == 1
    assert {t.key for t in tc.list()} == {"a3", "b3"}
    for bad in ({"status": ["running"]}, {"status": ["pending"]}, {"keys": []}):
        with pytest.raises(InvalidTask):
            tc.purge(**bad)


def test_a_purged_schedule_tick_is_not_published_again(tc: TaskClient, clock: FixedClock) -> None:
    tc.add_schedule("beat", "t", every=60)
    for doc in tc._run(due(clock.now())):
        assert tc._run(fire(doc, clock.now())) == 1
    first = tick_key("beat", T0)
    [doc] = claimed(tc, [first], clock.now(), name="t")
    tc._run(finish_many([Outcome(first, doc["claim_run_id"], RunState.SUCCESS)], clock.now()))
    assert tc.purge(keys=[first]) == 1
    clock.advance(seconds=30)  # the same tick is still the latest: nothing is due
    assert [tc._run(fire(d, clock.now())) for d in tc._run(due(clock.now()))] == []
    clock.advance(seconds=30)  # the next tick only
    created = [tc._run(fire(d, clock.now())) for d in tc._run(due(clock.now()))]
    assert created == [1]
    assert [t.key for t in tc.list()] == [tick_key("beat", T0 + dt.timedelta(seconds=60))]


def test_a_flow_parent_is_kept_while_its_steps_run_and_a_purged_flow_does_not_fire_again(
    tc: TaskClient, clock: FixedClock
) -> None:
    tc.publish("n", "p")
    now = clock.now()
    [doc] = claimed(tc, ["p"], now)
    steps = tuple(
        {"name": "m", "key": f"p/m.{i}", "params": {}, "options": {}, "depends_on": []}
        for i in range(2)
    )
    outcome = Outcome("p", doc["claim_run_id"], RunState.SUCCESS, result=["p/m.0"], steps=steps)
    tc._run(finish_many([outcome], now))
    parent = check_expiry(tc, "p")
    assert parent["expire_held"] is True and "expire_at" not in parent
    assert len(tc._run(flush_outboxes(["p"], now))) == 2
    assert tc.purge(keys=["p"]) == 0  # held for its steps: not purged
    assert tc._run(release_parents(now)) == 0  # both steps open
    children = claimed(tc, ["p/m.0", "p/m.1"], now, name="m")
    first = Outcome("p/m.0", children[0]["claim_run_id"], RunState.SUCCESS)
    tc._run(finish_many([first], now))
    assert tc._run(release_parents(now)) == 0  # one step still open
    clock.advance(seconds=5)
    second = Outcome("p/m.1", children[1]["claim_run_id"], RunState.SUCCESS)
    tc._run(finish_many([second], clock.now()))
    assert tc._run(release_parents(clock.now())) == 1
    parent = tc.collection.find_one({"_id": "p"})
    assert parent is not None and "expire_held" not in parent
    assert parent["expire_at"] == clock.now() + ms(DEFAULT_KEEP_MS["succeeded"])
    assert tc.purge() == 3
    later = clock.now() + dt.timedelta(minutes=5)
    assert tc._run(flush_outboxes(None, later, older_than=later)) == []
    assert tc._run(release_parents(later)) == 0
    assert tc.collection.count_documents({}) == 0


def test_mtask_purge_counts_asks_and_refuses_bad_input(
    capsys: pytest.CaptureFixture[str], mongo_uri: str, db_name: str, tc: TaskClient
) -> None:
    tc.publish_many([{"name": "n", "key": f"k{i}"} for i in range(3)])
    tc.cancel("k0")
    tc.cancel("k1")
    common = ("--uri", mongo_uri, "--database", db_name)
    assert main(["purge", "--dry-run", *common]) == 0
    assert "2 finished tasks match" in capsys.readouterr().out
    assert main(["purge", *common]) == 2  # no terminal, no --yes: refused
    assert "pass --yes" in capsys.readouterr().err
    assert tc.collection.count_documents({}) == 3
    for bad in (["--older-than", "soon"], ["--status", "running"], ["--key", ""]):
        with pytest.raises(SystemExit) if bad[0] == "--status" else _nothing():
            assert main(["purge", "--yes", *bad, *common]) == 2
        capsys.readouterr()
    assert main(["purge", "--yes", "--json", *common]) == 0
    assert capsys.readouterr().out.strip() == '{"matched": 2, "removed": 2}'
    assert [t.key for t in tc.list()] == ["k2"]
    assert main(["retention", *common]) == 0
    assert capsys.readouterr().out.strip() == (
        "no retention set: every name keeps the built-in defaults: succeeded 7d, failed 30d, "
        "cancelled 7d; invalid ones until purged"
    )
    assert main(["retention", "n", "--succeeded", "12h", "--failed", "forever", *common]) == 0
    assert (
        capsys.readouterr().out.splitlines()[0] == "n: succeeded 12h, failed forever, cancelled -"
    )
    assert main(["retention", "n", "--succeeded", "often", *common]) == 2
    [doc] = tc.retention()
    assert (doc["succeeded_ms"], doc["failed_ms"], doc["cancelled_ms"]) == (43_200_000, -1, None)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
