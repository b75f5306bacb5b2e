"""Transactional handlers under faults: a worker killed between its handler's writes and the
commit, and a worker frozen past its lease. The handler's business writes (a ledger document
and a counter increment per run, ``chaosapp.charge``) land exactly once per task — counted, not
inferred from the runs.

Both once failed (each an expected failure once): the dead or frozen worker's transaction
stayed open on the server until MongoDB reaped it (60 s ``transactionLifetimeLimitSeconds``,
~88 s in the run observed), and the rescuer's transactions met write conflicts on the same
business documents until then. The rescuer now kills the earlier run's session (its id is on
the run entry) before its own transaction starts (``store.transactional.kill_sessions``)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, replica_set_with_workers, until_finished, wait_for
from pymongo import MongoClient
from pymongo.errors import PyMongoError

from mtask import TaskClient

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.timeout(600),
]

OPTIONS = {"worker_timeout_ms": 5000, "ping_interval_ms": 200, "max_retries": 5}
"""A transactional run is not pinged while its transaction is open: the victim's and the
zombie's transactions must still be within their lease when they are killed or frozen (the
writes took over a second on the loaded test machine), so a lease of 5 s, not 1 s."""
KEYS = [f"t{i}" for i in range(3)]
TAKEOVER_S = 45
"""Under the 60 s a dead run's transaction lives on the server: the rescuer must not wait it out."""


def publish(
    client: TaskClient, hold_ms_by_worker: dict[str, int], options: dict[str, int] = OPTIONS
) -> None:
    client.ensure_indexes()
    for name in ("ledger", "counters"):  # not created inside a handler's transaction
        client.db.create_collection(name)
    client.publish_many(
        [
            {
                "name": "charge",
                "key": k,
                "params": {"hold_ms_by_worker": hold_ms_by_worker},
                "options": options,
            }
            for k in KEYS
        ]
    )


def assert_exactly_once(client: TaskClient, worker: str) -> None:
    counters = {d["_id"]: d["n"] for d in client.db["counters"].find()}
    runs = {t.key: [(r.worker_id, r.state, r.error) for r in t.runs] for t in client.list()}
    assert counters == dict.fromkeys(KEYS, 1), (counters, runs)
    ledger = sorted((d["task"], d["worker_id"]) for d in client.db["ledger"].find())
    assert ledger == [(k, worker) for k in KEYS], ledger
    for task in client.list():
        assert task.status == "succeeded", task
        assert [r.state for r in task.runs][-1] == "SUCCESS"
        assert [r.state for r in task.runs].count("SUCCESS") == 1


async def test_killed_between_the_handlers_writes_and_commit(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    publish(client, {"victim": 600_000})
    log = mongo[db_name]["execlog"]
    cluster.spawn("victim", "--concurrency", "4")
    await wait_for(lambda: log.count_documents({"worker_id": "victim", "event": "written"}) == 3)
    cluster.signal("victim", signal.SIGKILL)  # its transactions are open, uncommitted
    cluster.spawn("rescuer", "--concurrency", "4")
    await until_finished(client, len(KEYS), timeout=TAKEOVER_S, explain=cluster.explainer(client))
    assert_exactly_once(client, "rescuer")
    for task in client.list():
        assert [(r.worker_id, r.state) for r in task.runs] == [
            ("victim", "TIMEOUT"),
            ("rescuer", "SUCCESS"),
        ]


async def test_frozen_past_its_lease_mid_handler_then_resumed(
    cluster: Cluster, client: TaskClient, mongo: Any, db_name: str
) -> None:
    """The zombie has written and would commit 2 s later; frozen, it loses its lease, a rescuer
    takes over and commits; resumed, whichever comes first — its deadline stopping the run, or
    the handler returning into a fenced SUCCESS that no longer matches — its transaction
    aborts."""
    publish(client, {"zombie": 2000})
    log = mongo[db_name]["execlog"]
    zombie = cluster.spawn("zombie", "--concurrency", "4")
    await wait_for(lambda: log.count_documents({"worker_id": "zombie", "event": "written"}) == 3)
    zombie.send_signal(signal.SIGSTOP)
    try:
        cluster.spawn("rescuer", "--concurrency", "4")
        await until_finished(
            client, len(KEYS), timeout=TAKEOVER_S, explain=cluster.explainer(client)
        )
    finally:
        zombie.send_signal(signal.SIGCONT)
    cluster.signal("zombie", signal.SIGTERM)  # once it exited, nothing of it can land
    assert await asyncio.to_thread(zombie.wait, 60) == 0
    assert_exactly_once(client, "rescuer")


@pytest.mark.parametrize("rolled_back", [False, True], ids=["caught-up", "rolled-back"])
async def test_failover_during_commit(tmp_path: Path, db_name: str, rolled_back: bool) -> None:
    """The commits are applied on the primary but not yet replicated (the secondaries stopped
    fetching its oplog) when the primary is stepped down, with their majority write concern
    still unanswered. Either the new primary catches up from the old one in its election
    (MongoDB's default): the commits survive, the worker's retried commit is told so, and the
    bodies ran once. Or it does not (``catchUpTimeoutMillis: 0``, the secondaries still cut
    off): the old primary rolls the commits back when it rejoins, the worker's retried commit
    finds no such transaction, and ``with_transaction`` runs the body again on the new primary,
    the run still owning its task (a lease longer than the failover). Business writes: once per
    task, both ways."""
    settings = {"catchUpTimeoutMillis": 0} if rolled_back else {}
    replica_set, cluster = await replica_set_with_workers(
        tmp_path, db_name, test_commands=True, settings=settings
    )
    uri = cluster.uri
    try:
        with TaskClient(uri, database=db_name) as client, MongoClient(uri) as mongo:
            options = {"worker_timeout_ms": 30_000, "ping_interval_ms": 500, "max_retries": 5}
            publish(client, {"a": 3000}, options)
            log = mongo[db_name]["execlog"]
            cluster.spawn("a", "--concurrency", "4")
            await wait_for(lambda: log.count_documents({"event": "written"}) == 3, timeout=60)
            old = replica_set.wait_primary()
            secondaries = [p for p in replica_set.ports if p != old]
            for port in secondaries:  # from now on nothing the primary writes is replicated
                replica_set.fail_point(port, "stopReplProducer")
            primary = replica_set.direct(old)
            try:  # the three commits applied on the primary (read there, "local")
                counters = primary[db_name]["counters"]
                try:
                    await wait_for(lambda: counters.count_documents({"n": 1}) == 3, timeout=60)
                except TimeoutError:  # say what the primary holds and what the worker did
                    raise AssertionError(
                        (list(counters.find()), list(log.find({}, {"_id": 0})),
                         cluster.log_of("a")[-3000:])
                    ) from None  # fmt: skip
                with contextlib.suppress(PyMongoError):  # the step-down drops the connection
                    primary.admin.command(
                        "replSetStepDown", 60, secondaryCatchUpPeriodSecs=1, force=True
                    )
            finally:
                primary.close()
            if rolled_back:  # elected while cut off from the old primary's last writes
                await asyncio.to_thread(replica_set.wait_primary, 60, old)
            for port in secondaries:
                replica_set.fail_point(port, "stopReplProducer", mode="off")
            new = await asyncio.to_thread(replica_set.wait_primary, 60, old)
            await until_finished(client, len(KEYS), timeout=120, explain=cluster.explainer(client))
            assert new != old
            assert_exactly_once(client, "a")
            for task in client.list():  # the same run committed, on its first or second try
                assert [(r.worker_id, r.state) for r in task.runs] == [("a", "SUCCESS")]
            tries = log.count_documents({"event": "written"})
            if rolled_back:
                rollback = replica_set.dbpath(old) / "rollback"
                await wait_for(lambda: rollback.is_dir() and any(rollback.rglob("*.bson")), 60)
                assert tries == 6, tries  # each body ran twice: before and after the failover
            else:
                assert tries == 3, tries

            # counted once committed (after the commit's reply, which may come after the tasks
            # are seen finished), however many times its body ran
            def succeeded() -> list[int]:
                return [cluster.log_of("a").count(f"succeeded key={k} ") for k in KEYS]

            await wait_for(lambda: all(succeeded()), timeout=60)
            assert succeeded() == [1, 1, 1]
    finally:
        cluster.close()
        replica_set.stop()
