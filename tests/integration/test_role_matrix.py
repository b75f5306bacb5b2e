"""Every documented role, end to end and no further, on ``mongod --auth`` (a key file, no
TLS: ``test_least_privilege`` has TLS): the roles of ``mtask collection roles --create``, one
SCRAM user each.

Under ``mtaskWorker`` (``--stream own``) and ``mtaskRelay`` (the shared stream) a worker that
is already idle finds a task published to it through its change stream: its sweep is an hour
away, so nothing else could. A trigger follows its collection and a wait on data wakes under
both. Then each role is refused what it must not do (a matrix of plain MongoDB operations).
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import run_cli, spawn_worker, stop_process
from needs import missing
from pymongo import MongoClient
from pymongo.errors import OperationFailure

from mtask import TaskClient
from mtask.embedded import EmbeddedMongo
from mtask.errors import MtaskError
from mtask.security import roles
from mtask.security.encryption import KEY_VAULT

DB = "matrix"
INBOXES = f"{DB}_inbox"
"""The inbox database (``driver.inbox_database``): the relay's inbox role is made there."""
USERS = {
    "root": [("root", "admin")],
    "publisher": [("mtaskPublisher", DB)],
    "worker": [("mtaskWorker", DB)],
    "relay": [("mtaskRelay", DB), ("mtaskRelayInboxes", INBOXES)],
    "viewer": [("mtaskViewer", DB)],
    "operator": [("mtaskOperator", DB)],
    "admin": [("mtaskAdmin", DB)],
}
STREAMS = {"worker": "own", "relay": "shared"}
"""The documented role of each stream mode (docs/deploy.md)."""
UNAUTHORIZED = 13


@dataclass
class Secured:
    host: str
    passwords: dict[str, str]

    def uri(self, user: str) -> str:
        return (
            f"mongodb://{user}:{self.passwords[user]}@{self.host}/?replicaSet=mtask"
            "&authSource=admin"
        )


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    base = tmp_path_factory.mktemp("matrix")
    key_file = base / "keyfile"
    key_file.write_text(secrets.token_hex(32))
    key_file.chmod(0o600)
    server = EmbeddedMongo(
        base / "data", cache_size_gb=0.25, extra_args=("--auth", "--keyFile", str(key_file))
    )
    try:
        uri = server.start()
    except MtaskError as exc:
        missing(f"the auth mongod did not start: {exc}")
    try:
        host = uri.partition("://")[2].partition("/")[0]
        passwords = {user: f"pw-{user}-{secrets.token_hex(8)}" for user in USERS}
        found = Secured(host, passwords)
        with MongoClient(f"mongodb://{host}/?directConnection=true") as local:
            local.admin.command("createUser", "root", pwd=passwords["root"], roles=["root"])
        code, _, err = run_cli(
            "collection", "roles", "--create", "--uri", found.uri("root"), "--database", DB
        )
        assert code == 0, err
        with MongoClient(found.uri("root")) as root:
            for user, given_roles in USERS.items():
                if user != "root":
                    given = [{"role": role, "db": db} for role, db in given_roles]
                    root.admin.command("createUser", user, pwd=passwords[user], roles=given)
            made = roles.role_commands(DB)[DB]
            worker = next(c for c in made if c["createRole"] == "mtaskWorker")
            short = [p for p in worker["privileges"] if p["resource"]["collection"]]
            root[DB].command("createRole", "streamless", privileges=short, roles=[])
            given = [{"role": "streamless", "db": DB}]
            root.admin.command("createUser", "streamless", pwd=passwords["root"], roles=given)
            passwords["streamless"] = passwords["root"]
            # Atlas's built-in for workers, on mtask's database and the inboxes'
            given = [{"role": "readWrite", "db": DB}, {"role": "readWrite", "db": INBOXES}]
            root.admin.command("createUser", "builtin", pwd=passwords["root"], roles=given)
            passwords["builtin"] = passwords["root"]
            root[DB]["orders"].insert_one({"_id": "seed"})
            root[DB]["invoices"].insert_one({"_id": "seed"})
            root[DB]["audit"].insert_one({"_id": "seed", "who": "otto"})
            root[DB][KEY_VAULT].insert_one({"_id": "seed-key"})
        code, _, err = run_cli("collection", "init", "--uri", found.uri("admin"), "--database", DB)
        assert code == 0, err
        yield found
    finally:
        server.stop()


def _await_line(log: Path, proc: subprocess.Popen[Any], text: str, count: int = 1) -> None:
    """Until the worker's log holds ``text`` ``count`` times (its events, as it says them)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        said = log.read_text(errors="replace")
        if said.count(text) >= count:
            return
        assert proc.poll() is None, said[-3000:]
        time.sleep(0.05)  # polling a file the worker writes: no event to await
    pytest.fail(f"the worker never said {text!r}: {log.read_text(errors='replace')[-3000:]}")


@contextlib.contextmanager
def _idle(
    secured: Secured, user: str, log: Path, app: str, ready: str, count: int
) -> Iterator[subprocess.Popen[Any]]:
    """A worker of ``app`` under the role documented for its stream, started and idle: its
    one scan is behind it, its next an hour away (it says ``ready`` ``count`` times)."""
    with open(log, "wb") as sink:
        proc = spawn_worker(
            secured.uri(user),
            DB,
            "--stream",
            STREAMS[user],
            "--sweep-interval",
            "3600",
            "--log-level",
            "INFO",
            app=app,
            stdout=sink,
            stderr=sink,
        )
    try:
        _await_line(log, proc, ready, count)
        yield proc
    finally:
        stop_process(proc)
    said = log.read_text(errors="replace")
    assert "Traceback" not in said and "not authorized" not in said, said[-3000:]
    assert "lacks the privilege" not in said, said[-3000:]


@pytest.mark.parametrize("user", sorted(STREAMS))
def test_an_idle_worker_finds_a_new_task_through_its_stream(
    secured: Secured, user: str, tmp_path: Path
) -> None:
    key = f"stream-{user}"
    with (
        _idle(secured, user, tmp_path / "worker.log", "triggerapp:registry", "started", 1),
        TaskClient(secured.uri("publisher"), database=DB) as client,
    ):
        client.publish("ship", f"{key}-first", {"total": 1})  # its start-up's scan is over
        assert client.wait(f"{key}-first", timeout=60).status == "succeeded"
        client.publish("ship", key, {"total": 3})
        done = client.wait(key, timeout=60)  # the sweep is an hour away: only the stream
    assert done.status == "succeeded" and done.result == 3, done


def test_two_workers_under_the_relay_role_share_one_stream_through_the_inbox_database(
    secured: Secured, tmp_path: Path
) -> None:
    """Two workers under ``mtaskRelay`` (and ``mtaskRelayInboxes``): one holds the relay, the
    other subscribes through an inbox it makes, which the relay writes and drops; the inboxes
    and the relay's reports are in the inbox database, none in mtask's; every task is done."""
    with (
        _idle(secured, "relay", tmp_path / "a.log", "triggerapp:registry", "started", 1),
        _idle(secured, "relay", tmp_path / "b.log", "triggerapp:registry", "started", 1),
        MongoClient(secured.uri("root")) as root,
        TaskClient(secured.uri("publisher"), database=DB) as client,
    ):

        def inboxes() -> list[str]:
            return [n for n in root[INBOXES].list_collection_names() if ".inbox." in n]

        deadline = time.monotonic() + 60
        while not inboxes() and time.monotonic() < deadline:
            time.sleep(0.05)  # the subscriber's inbox, made at its hello: polled by name
        assert inboxes(), root[INBOXES].list_collection_names()
        keys = [f"pair-{i}" for i in range(6)]
        for key in keys:
            client.publish("ship", key, {"total": 2})
        done = [client.wait(key, timeout=60) for key in keys]
        assert all(t.status == "succeeded" for t in done), done
        assert "tasks.reports" in root[INBOXES].list_collection_names()
        ours = root[DB].list_collection_names()
        assert not [n for n in ours if ".inbox." in n or n.endswith(".reports")], ours


@pytest.mark.parametrize("user", sorted(STREAMS))
def test_a_trigger_follows_its_collection_and_a_data_wait_wakes(
    secured: Secured, user: str, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    with (
        _idle(secured, user, log, "triggerapp:registry", "following", 2),  # trigger and waits
        MongoClient(secured.uri("root")) as app,
        TaskClient(secured.uri("publisher"), database=DB) as client,
    ):
        client.publish("settle", f"settle-{user}", {"invoice": f"inv-{user}"})
        app[DB]["invoices"].insert_one({"_id": f"inv-{user}", "status": "open", "total": 7})
        app[DB]["orders"].insert_one({"_id": f"order-{user}", "status": "paid", "total": 5})
        deadline = time.monotonic() + 60
        shipped = None
        while shipped is None and time.monotonic() < deadline:
            shipped = app[DB]["tasks"].find_one(
                {"name": "ship", "params.total": 5, "status": "succeeded"}
            )
            time.sleep(0.05)  # the trigger's task has a key of its own: polled by name
        assert shipped is not None, "the trigger published nothing"
        _await_status(client, f"settle-{user}", "pending")
        app[DB]["invoices"].update_one({"_id": f"inv-{user}"}, {"$set": {"status": "settled"}})
        done = client.wait(f"settle-{user}", timeout=60)
    assert done.status == "succeeded" and done.result == 7, done


def _await_status(client: TaskClient, key: str, status: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        task = client.get(key)
        if task is not None and task.status == status and task.attempts:
            return
        time.sleep(0.05)
    pytest.fail(f"{key} never waited: {client.get(key)}")


def test_a_worker_says_once_at_start_what_its_role_lacks(secured: Secured, tmp_path: Path) -> None:
    """Under a role without the database's ``find`` and ``changeStream`` (mtaskWorker's but
    for them) a worker starts, says so once, and runs on its sweep."""
    log = tmp_path / "worker.log"
    with open(log, "wb") as sink:
        proc = spawn_worker(
            secured.uri("streamless"), DB, "--stream", "own", stdout=sink, stderr=sink
        )
    try:
        _await_line(log, proc, "change stream refused")
    finally:
        stop_process(proc)
    said = log.read_text(errors="replace")
    lacks = f"lacks what a worker with --stream own needs: changeStream, find on {DB} (every"
    assert said.count(lacks) == 1 and "Traceback" not in said, said[-3000:]
    assert "$changeStream" not in said, said[-3000:]  # not the refused command, quoted


@pytest.mark.parametrize("user", ["root", "builtin", "worker", "relay", "streamless"])
def test_what_a_user_lacks_is_read_from_its_privileges(secured: Secured, user: str) -> None:
    """The start-up's check against the server's own account of a user's privileges: root,
    readWrite (Atlas's built-in) and the roles lack nothing a worker of either stream needs."""
    with MongoClient(secured.uri(user)) as client:
        info = client[DB].command("connectionStatus", showPrivileges=True)["authInfo"]
    lacks = {part: roles.lacking(part, info, DB, "tasks") for part in STREAMS}
    if user == "streamless":
        assert lacks["worker"] == [f"changeStream, find on {DB} (every collection)"], lacks
    elif user == "worker":
        assert lacks["worker"] == [] and lacks["relay"], lacks
    else:
        assert lacks == {"worker": [], "relay": []}, lacks


Act = Callable[[Any], Any]
ACTS: dict[str, Act] = {
    "watch the database": lambda db: db.watch(max_await_time_ms=1).close(),
    "insert a task": lambda db: db["tasks"].insert_one({"_id": secrets.token_hex(4)}),
    "delete a data key": lambda db: db[KEY_VAULT].delete_one({"_id": "seed-key"}),
    "drop the data keys": lambda db: db[KEY_VAULT].drop(),
    "rewrite the audit": lambda db: db["audit"].update_one({}, {"$set": {"who": "x"}}),
    "delete the audit": lambda db: db["audit"].delete_many({}),
    "drop the audit": lambda db: db["audit"].drop(),
    "write an application collection": lambda db: db["orders"].update_one(
        {"_id": "seed"}, {"$set": {"x": 1}}
    ),
    "delete from an application collection": lambda db: db["orders"].delete_one({"_id": "x"}),
    "drop an application collection": lambda db: db["orders"].drop(),
    "read the triggers": lambda db: db["triggers"].find_one(),
    "pause a trigger": lambda db: db["triggers"].update_one(
        {"_id": "none"}, {"$set": {"paused": True}}
    ),
    "drop the tasks": lambda db: db["tasks"].drop(),
    "make a collection in mtask's database": lambda db: db.create_collection(
        f"tasks.inbox.{secrets.token_hex(4)}", capped=True, size=4096
    ),
    "make an inbox": lambda db: db.client[INBOXES].create_collection(
        f"tasks.inbox.{secrets.token_hex(4)}", capped=True, size=4096
    ),
    "drop an inbox": lambda db: db.client[INBOXES][f"tasks.inbox.{secrets.token_hex(4)}"].drop(),
}
FOLLOWERS = {"read the triggers", "pause a trigger"}
MAY = {
    "publisher": {"insert a task"},
    "worker": {"watch the database", "insert a task", *FOLLOWERS},
    "relay": {"watch the database", "insert a task", "make an inbox", "drop an inbox", *FOLLOWERS},
    "viewer": {"read the triggers"},
    "operator": {"insert a task", *FOLLOWERS},
}
"""What each role may do of ``ACTS``; it is refused the rest."""


@pytest.mark.parametrize("user", sorted(MAY))
def test_each_role_may_do_its_part_and_nothing_else(secured: Secured, user: str) -> None:
    with MongoClient(secured.uri(user)) as client:
        db = client[DB]
        done, refused = set(), set()
        for name, act in ACTS.items():
            try:
                act(db)
                done.add(name)
            except OperationFailure as exc:
                assert exc.code == UNAUTHORIZED, (name, exc)  # refused by the server itself
                refused.add(name)
    assert done == MAY[user], (user, sorted(done ^ MAY[user]))
    assert refused == ACTS.keys() - MAY[user]
    if user == "relay":  # its inboxes' privileges reach no collection of mtask's database
        assert {"drop the tasks", "drop the audit", "drop the data keys"} <= refused
