"""Changing code under parked tasks, on a real replica set with real (in-process)
workers and the preflight's real sandbox process: a task parked under version 1 of a handler
resumes on the old branch of version 2's patch marker while new tasks take the new one; the
preflight reports, before the deploy, which parked tasks version 3 would break (and at which
step), that a handler doing I/O between its steps is not checked, and it writes nothing (the
profiler counts every operation on the database while it runs). At scale: 2,000 parked tasks
here; bench WF measures 100,000."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import pytest
import workflowapp
from harness import run_cli, running_worker
from pymongo import MongoClient

from mtask import AsyncTaskClient, TaskClient
from mtask.errors import RegistryNotFound
from mtask.security.encryption import KEY_FILE_ENV, Encryption, sealed
from mtask.steps.preflight import SEALED, check

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _app(mongo_uri: str, db_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    workflowapp.EFFECTS.update(uri=mongo_uri, db=db_name)
    monkeypatch.chdir(TESTS)  # the sandbox imports workflowapp from its working directory


def _writes(mongo: MongoClient[dict[str, Any]], db_name: str) -> list[dict[str, Any]]:
    """The operations the profiler saw on the database that write."""
    db = mongo[db_name]
    db.command("profile", 0)
    found = db["system.profile"].find({}, {"op": 1, "ns": 1, "command": 1})
    writing = ("insert", "update", "remove", "findAndModify", "delete")
    return [
        e for e in found if e["op"] in writing or next(iter(e.get("command") or {}), "") in writing
    ]


async def test_a_patch_marker_keeps_parked_tasks_on_the_old_branch(
    aclient: AsyncTaskClient,
    client: TaskClient,
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    drain: Any,
) -> None:
    await drain(workflowapp.v1, aclient.publish("ship_order", "old", {}), "old", state="WAITING")

    # before the deploy of version 2: its marker keeps the parked task replaying
    v2 = await asyncio.to_thread(check, client, "workflowapp:v2")
    assert v2.names["ship_order"].counts == {
        "clean": 1,
        "mismatch": 0,
        "error": 0,
        "unchecked": 0,
        "orphaned": 0,
    }

    async with running_worker(workflowapp.v2, mongo_uri, db_name) as (_, events):
        await aclient.publish("ship_order", "new", {})
        await events.wait("recorded", key="new", state="WAITING")
        new_parked = await aclient.get("new")
        assert new_parked is not None
        assert [s.name for s in new_parked.steps] == [
            "charge",
            "patch:ship-first",
            "ship",
            "wait:go",
        ]

        # before a deploy of version 3 (no marker): both parked tasks would mismatch
        v3 = await asyncio.to_thread(check, client, "workflowapp:v3")
        ship = v3.names["ship_order"]
        assert ship.counts["mismatch"] == 2 and ship.counts["clean"] == 0
        by_key = {v.key: v for v in ship.examples}
        assert by_key["old"].step == 2 and "recorded as 'wait:go'" in by_key["old"].detail
        assert by_key["new"].step == 2 and "'patch:ship-first'" in by_key["new"].detail
        # version 3 with deprecate_patch: the task that took the new branch replays, the old
        # one (which took the old branch) still would not
        v3d = await asyncio.to_thread(check, client, "workflowapp:v3_deprecated")
        assert v3d.names["ship_order"].counts["clean"] == 1
        assert [v.key for v in v3d.names["ship_order"].examples] == ["old"]

        for key in ("old", "new"):
            await aclient.signal(key, "go")
        async with asyncio.timeout(30):
            old = await aclient.wait("old")
            new = await aclient.wait("new")
    assert old.result == "v2-old" and new.result == "v2-new"
    assert [s.name for s in old.steps] == ["charge", "wait:go", "ship"]
    effects = mongo[db_name]["effects"]
    for key in ("old", "new"):  # each side effect once, across both versions
        assert effects.count_documents({"key": key, "what": "charge"}) == 1
        assert effects.count_documents({"key": key, "what": "ship"}) == 1


async def test_the_preflight_writes_nothing_and_refuses_io_between_steps(
    aclient: AsyncTaskClient,
    client: TaskClient,
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
) -> None:
    async with running_worker(workflowapp.v1, mongo_uri, db_name) as (_, events):
        for key, params in (("quiet", {}), ("connects", {"connect": 1}), ("writes", {"write": 1})):
            await aclient.publish("leaky", key, params)
            await events.wait("recorded", key=key, state="WAITING")
    client.ensure_indexes()  # the client's own set-up on first use, before the check is watched
    mongo[db_name].command("profile", 2)
    report = await asyncio.to_thread(check, client, "workflowapp:v3", ["leaky"])
    assert _writes(mongo, db_name) == []
    leaky = report.names["leaky"]
    assert leaky.counts == {"clean": 1, "mismatch": 0, "error": 0, "unchecked": 2, "orphaned": 0}
    said = {v.key: v.detail for v in leaky.examples}
    assert "socket" in said["connects"] and "open" in said["writes"]
    with pytest.raises(RegistryNotFound, match="cannot import"):
        await asyncio.to_thread(check, client, "no_such_module:registry")


async def test_the_preflight_at_a_smaller_scale(
    client: TaskClient, db_name: str, mongo: MongoClient[dict[str, Any]]
) -> None:
    """2,000 parked tasks of one journal shape or another, written as a worker leaves them
    (bench WF measures 100,000): every one judged, nothing written."""
    now = client.now()
    docs = []
    for i in range(2000):
        steps = [_entry("charge", "call", "done", now, result=i)]
        steps.append(_entry("wait:go", "signal", "waiting", now, signal="go", nth=0))
        if i % 4 == 0:  # a journal of another shape: what version 2's new branch wrote
            steps.insert(1, _entry("patch:ship-first", "patch", "done", now, result=True))
            steps.insert(2, _entry("ship", "call", "done", now, result="ship"))
        docs.append(_parked(f"p{i:05}", steps, now))
    mongo[db_name]["tasks"].insert_many(docs)
    client.ensure_indexes()  # the client's own set-up on first use, before the check is watched
    mongo[db_name].command("profile", 2)
    report = await asyncio.to_thread(check, client, "workflowapp:v2", ["ship_order"])
    assert _writes(mongo, db_name) == []
    assert report.names["ship_order"].counts == {
        "clean": 2000,
        "mismatch": 0,
        "error": 0,
        "unchecked": 0,
        "orphaned": 0,
    }
    report = await asyncio.to_thread(check, client, "workflowapp:v3", ["ship_order"])
    assert report.names["ship_order"].counts["mismatch"] == 2000


async def test_the_preflight_names_parked_tasks_whose_name_is_gone(
    client: TaskClient, mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]
) -> None:
    """24 tasks parked under a name the new registry no longer has would never run again:
    the check counts them as ``orphaned``, names them, and exits 1 (a bad deploy), as for a
    mismatch; with ``--name`` of another name it leaves them out."""
    now = client.now()
    step = _entry("charge", "call", "done", now, result=1)
    wait = _entry("wait:go", "signal", "waiting", now, signal="go", nth=0)
    docs = [{**_parked(f"gone{i:02}", [step, wait], now), "name": "retired"} for i in range(24)]
    docs.append(_parked("kept", [step, wait], now))
    mongo[db_name]["tasks"].insert_many(docs)
    report = await asyncio.to_thread(check, client, "workflowapp:v2")
    assert report.names["retired"].counts["orphaned"] == 24 and report.orphaned == 24
    assert report.names["ship_order"].counts["clean"] == 1 and report.bad
    said = report.names["retired"].examples[0]
    assert said.outcome == "orphaned" and "no handler of this name" in said.detail
    common = ("--uri", mongo_uri, "--database", db_name)
    code, out, err = await asyncio.to_thread(
        run_cli, "step", "check", "workflowapp:v2", *common, width=200
    )
    assert code == 1, (out, err)
    assert "orphaned: gone23: no handler of this name" in out and "25 parked task(s)" in out
    code, out, _ = await asyncio.to_thread(
        run_cli, "step", "check", "workflowapp:v2", "--name", "ship_order", "--json", *common
    )
    assert code == 0 and "retired" not in json.loads(out)["names"], out


def _entry(name: str, kind: str, state: str, at: dt.datetime, **more: Any) -> dict[str, Any]:
    return {"name": name, "kind": kind, "state": state, "attempts": 1, "run_id": "r",
            "attempt": 1, "started_at": at, **more}  # fmt: skip


def _parked(key: str, steps: list[dict[str, Any]], now: dt.datetime) -> dict[str, Any]:
    from mtask.models import NewTask
    from mtask.store.schema import new_document

    doc = new_document(NewTask.build("ship_order", key, {}), now)
    never = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)
    return {**doc, "steps": steps, "attempts": 1, "next_claim_at": never, "available_at": never,
            "waiting": {"until": never, "index": len(steps) - 1, "step": "wait:go",
                        "signal": "go", "nth": 0}}  # fmt: skip


async def test_the_check_opens_encrypted_params_with_the_key_and_never_replays_ciphertext(
    client: TaskClient,
    mongo_uri: str,
    db_name: str,
    mongo: MongoClient[dict[str, Any]],
    drain: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    master = tmp_path / "master.key"
    master.write_bytes(base64.b64encode(os.urandom(96)))
    monkeypatch.setenv(KEY_FILE_ENV, str(master))  # the worker's key
    encryption = Encryption.local(master, mongo_uri, db_name)
    encryption.ensure_key()
    async with AsyncTaskClient(mongo_uri, database=db_name, encryption=encryption) as keyed:
        publish = keyed.publish("pay", "paid", {"card": "4242 4242 4242 4242"}, encrypt=True)
        await drain(workflowapp.v1, publish, "paid", state="WAITING")
    stored = mongo[db_name].tasks.find_one({"_id": "paid"})
    assert stored is not None and sealed(stored["params"]) and stored["steps"]

    # without the key: not replayed (its handler would get ciphertext), said why
    monkeypatch.delenv(KEY_FILE_ENV)
    blind = (await asyncio.to_thread(check, client, "workflowapp:v2")).names["pay"]
    assert blind.counts["unchecked"] == 1 and blind.counts["clean"] == 0, blind.counts
    assert [v.detail for v in blind.examples] == [SEALED]

    # with it: the params opened, the replay clean (the handler read its card)
    with TaskClient(
        mongo_uri, database=db_name, encryption=Encryption.local(master, mongo_uri, db_name)
    ) as holder:
        seen = (await asyncio.to_thread(check, holder, "workflowapp:v2")).names["pay"]
    assert seen.counts["clean"] == 1 and seen.counts["error"] == 0, (seen.counts, seen.examples)
