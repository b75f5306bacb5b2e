"""The roles (``mtask.security.roles``) against the calls the store's operations make: a publisher's
publish is allowed, a claim and an outcome are not; a refused call names what it lacked."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from pymongo.errors import DuplicateKeyError, OperationFailure
from scripted import ScriptedDriver, Step

from mtask import store
from mtask.driver import MODIFY_ONCE, Call, storage_error
from mtask.models import NewTask
from mtask.security import roles

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
REFUSED = OperationFailure("not authorized on mtask to execute command { update: ... }", 13)


def test_a_publish_needs_only_the_publishers_privileges() -> None:
    """A new key: the retention defaults read, one insert. A key that exists: the upsert is
    refused (no ``update``), and the document is read instead."""
    driver = ScriptedDriver(
        Step("find", reply=[], collection="retention"),
        Step("insert_one", raises=DuplicateKeyError("E11000 duplicate key")),
        Step("find_one_and_update", raises=REFUSED),
        Step("find_one", reply={"_id": "k", "name": "add"}),
    )
    published = driver.run(store.publish(NewTask.build("add", "k"), NOW))
    assert driver.done and not published.created
    refused, *allowed = driver.calls[2], *driver.calls[:2], driver.calls[3]
    assert roles.missing("publisher", refused) == ["update"]
    assert all(roles.missing("publisher", call) == [] for call in allowed)


def test_a_publish_many_without_update_inserts_what_is_new() -> None:
    tasks = [NewTask.build("add", k) for k in ("a", "b")]
    dup = {"writeErrors": [{"index": 1, "code": 11000}], "nInserted": 1}
    from pymongo.errors import BulkWriteError

    driver = ScriptedDriver(
        Step("find", reply=[], collection="retention"),
        Step("bulk_write", raises=REFUSED),
        Step("insert_many", raises=BulkWriteError(dup)),
    )
    by_name: dict[str, int] = {}
    assert driver.run(store.publish_many(tasks, NOW, created_by_name=by_name)) == 1
    assert by_name == {"add": 1}
    assert roles.missing("publisher", driver.calls[2]) == []


def test_a_claim_and_an_outcome_are_the_workers_not_the_publishers() -> None:
    claim = Call(MODIFY_ONCE, ({"_id": "k"}, [{"$set": {"status": "running"}}]))
    outcome = Call("update_many", ({"_id": "k"}, {"$set": {"status": "succeeded"}}))
    drop = Call("command", ("drop", "tasks"))
    for call in (claim, outcome, drop):
        assert roles.missing("publisher", call), call
        assert roles.missing("viewer", call), call
    assert roles.missing("worker", claim) == roles.missing("worker", outcome) == []
    assert roles.missing("worker", drop) == ["dropCollection"]
    assert roles.missing("relay", drop) == ["dropCollection"]  # nothing of mtask's database
    inbox = Call("command", ("drop", "tasks.inbox.x"), collection=roles.INBOX_CALLS)
    assert roles.missing("relay", inbox) == []  # its inboxes: the inbox database's
    assert roles.missing("worker", inbox) == roles.missing("operator", inbox) != []


def test_inherited_roles_are_created_first_and_hold_their_parents_grants() -> None:
    by_database = roles.role_commands("mtask", "jobs")
    assert list(by_database) == ["mtask", "mtask_inbox"]
    [inboxes] = by_database["mtask_inbox"]  # the relay's, on the inbox database only
    assert inboxes["createRole"] == "mtaskRelayInboxes" and inboxes["roles"] == []
    assert {p["resource"]["db"] for p in inboxes["privileges"]} == {"mtask_inbox"}
    commands = by_database["mtask"]
    assert {p["resource"]["db"] for c in commands for p in c["privileges"]} == {"mtask"}
    relay = next(c for c in commands if c["createRole"] == "mtaskRelay")
    assert relay["privileges"] == []  # the worker's, and nothing more on mtask's database
    order = [c["createRole"] for c in commands]
    for command in commands:
        for parent in command["roles"]:
            assert order.index(parent["role"]) < order.index(command["createRole"])
    assert "jobs.output" in roles.grants("publisher", "jobs")
    assert roles.grants("admin")["tasks"] >= roles.grants("operator")["tasks"]


def test_a_refused_call_names_the_privilege_and_never_the_command() -> None:
    call = Call("update_many", ({"_id": "k"}, {"$set": {"params": {"card": "4242"}}}))
    said = str(storage_error(REFUSED, call, "mtask.tasks"))
    assert "update_many on mtask.tasks" in said and "lacks the privilege update" in said
    assert "4242" not in said and "{ update" not in said


def test_the_security_docs_table_is_the_roles_grants() -> None:
    """docs/security.md's table of every role's grants is ``roles.grants_table()``, exactly."""
    text = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    table = text.split("<!-- grants:begin -->\n", 1)[1].split("<!-- grants:end -->", 1)[0]
    assert table == roles.grants_table(), "regenerate it: roles.grants_table()"


def test_a_role_lacking_a_privilege_is_said_which() -> None:
    """``lacking``: connectionStatus's privileges against a part's grants; nothing without
    --auth; a resource of every collection covers one; one collection's never the database."""
    full = {"resource": {"db": "m", "collection": ""}, "actions": ["anyAction"]}
    assert roles.lacking("relay", {"authenticatedUsers": []}, "m", "tasks") == []
    users = {"authenticatedUsers": [{"user": "w", "db": "admin"}]}
    assert roles.lacking("worker", {**users, "authenticatedUserPrivileges": [full]}, "m", "t") == []
    said = roles.lacking("relay", {**users, "authenticatedUserPrivileges": [full]}, "m", "t")
    assert said == [
        "convertToCapped, createCollection, dropCollection, find, insert, listCollections on "
        "m_inbox (every collection)"
    ]
    inboxes = {"resource": {"db": "m_inbox", "collection": ""}, "actions": ["anyAction"]}
    both = {**users, "authenticatedUserPrivileges": [full, inboxes]}
    assert roles.lacking("relay", both, "m", "t") == []
    worker = [
        {"resource": {"db": "m", "collection": c.get("collection", "")}, "actions": a}
        for c, a in (({"collection": n}, list(acts)) for n, acts in roles.grants("worker").items())
        if c["collection"]
    ]
    said = roles.lacking("worker", {**users, "authenticatedUserPrivileges": worker}, "m", "tasks")
    assert said == ["changeStream, find on m (every collection)"]
