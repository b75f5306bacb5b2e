"""MongoDB roles with the fewest privileges each part of mtask needs (pure: no I/O).

A *part* (``publisher``, ``worker``, ``relay``, ``viewer``, ``operator``, ``admin``) is granted
actions on the collections it uses, named relative to the tasks collection (``{tasks}``,
``{tasks}.output``) or by the database's own names (``workers``, ``limits``); ``""`` is the
whole database (MongoDB's privileges name exact collections or all of them: never a prefix).
The shared stream's inboxes, capped collections named at run time, live in a database of
their own (``driver.inbox_database``: ``<database>_inbox``), so that making, writing and
dropping them is granted there (a role's ``inbox`` grants, made as a second MongoDB role in
that database: a role outside ``admin`` holds privileges of its own database only) and
nothing database-wide but reading is granted in mtask's. ``ROLES`` is the one definition;
``role_commands`` writes it as ``createRole`` commands per database for one database and tasks
collection (``mtask collection roles``), ``actions_of`` says which actions one store ``Call``
needs (the tests check every call a part makes against its role, and
``driver.storage_error`` names them when the server refuses one).

What privileges cannot say: they are per collection, not per document or field. A role with
``update`` on the tasks collection may change any task, in any field, so the publisher's role
has none: it inserts (a new key), reads (a key that exists: the idempotent publish reads it
back), follows events and output, and nothing else. What needs ``update`` on tasks (signals,
``on_conflict`` ``update_params``/``reset``, ``depends_on``, a publish in a caller's
transaction) is an operator's, or goes through ``mtask serve`` with an operator token. "Its
own tasks" cannot be enforced for reading either: ``find`` reads every task of the collection
(a view per team, with ``find`` on the view only, is the way to narrow it: docs/deploy.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mtask.driver import Call, actions_of, call_collection, inbox_database
from mtask.security.encryption import (
    KEY_VAULT,
)  # in mtask's database: a role of it can read the keys

READ = ("find",)
WRITE = ("find", "insert", "update", "remove")
FOLLOW = ("find", "changeStream")
INBOXES = (
    "find",
    "listCollections",
    "createCollection",
    "convertToCapped",
    "dropCollection",
    "insert",
)
INBOX_CALLS = "inboxes"
"""The ``driver.collections`` key of a call in the inbox database."""


@dataclass(frozen=True)
class Role:
    name: str
    """The MongoDB role's name (``mtaskPublisher``)."""
    summary: str
    grants: Mapping[str, tuple[str, ...]]
    """Actions per collection (``{tasks}`` stands for the tasks collection's name)."""
    inherits: tuple[str, ...] = ()
    """Parts whose grants this one has as well (MongoDB's inherited ``roles``)."""
    atlas: str = ""
    """The closest built-in Atlas role, for those who do not make custom roles."""
    inbox: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Actions per collection in the inbox database (``driver.inbox_database``), made as the
    role ``inbox_role`` there."""

    @property
    def inbox_role(self) -> str:
        """The MongoDB role of ``inbox``'s grants, in the inbox database."""
        return f"{self.name}Inboxes"


SIDE = ("{tasks}.output", "{tasks}.steps", "{tasks}.usage")
CLUSTER = ("workers", "controls", "limits", "schedules", "retention", "relays")

ROLES: dict[str, Role] = {
    "publisher": Role(
        "mtaskPublisher",
        "publish (insert; a key that exists is read back), read tasks, their events and output",
        {
            "{tasks}": ("find", "insert", "changeStream"),
            "{tasks}.output": FOLLOW,
            "retention": READ,
            KEY_VAULT: READ,
        },
        atlas="none (custom role); read@mtask plus insert is the nearest",
    ),
    "worker": Role(
        "mtaskWorker",
        "claim, ping, record outcomes, steps and output, heartbeats, limits, schedules",
        {
            # finding work: one change stream on the database (the tasks, controls, limits and
            # schedules), which MongoDB grants only with find and changeStream on all of it
            "": FOLLOW,
            "{tasks}": (*WRITE, "changeStream", "createIndex", "listIndexes"),
            **{name: (*WRITE, "createIndex", "listIndexes") for name in SIDE},
            **{name: (*WRITE, "createIndex", "listIndexes") for name in CLUSTER},
            "throughput": WRITE,
            "triggers": (*WRITE, "createIndex", "listIndexes"),
            KEY_VAULT: READ,
        },
        atlas="readWrite@mtask",
    ),
    "relay": Role(
        "mtaskRelay",
        "--stream shared: the worker's, and the relay's and subscribers' capped inboxes "
        "made, written and dropped in the inbox database (<database>_inbox) only",
        {},
        inherits=("worker",),
        atlas="readWrite@mtask + readWrite@mtask_inbox",
        # the inboxes: capped collections named per subscriber ({tasks}.inbox.<digest>),
        # which MongoDB's privileges cannot name ahead (no prefix): made, written, dropped
        # in a database of their own, and the relay's reports ({tasks}.reports) beside them
        inbox={"": INBOXES},
    ),
    "viewer": Role(
        "mtaskViewer",
        "mtask serve read-only (viewer tokens), mtask get/list/stats/logs: read everything",
        {
            "{tasks}": (*FOLLOW, "listIndexes"),
            "{tasks}.output": FOLLOW,
            "{tasks}.steps": READ,
            "{tasks}.usage": READ,
            **{name: READ for name in CLUSTER},
            "throughput": ("find", "insert", "update"),
            "audit": READ,
            "triggers": READ,
        },
        atlas="read@mtask (the charts' sampler then warns: it cannot write throughput)",
    ),
    "operator": Role(
        "mtaskOperator",
        "mtask serve with operator tokens, the CLI's actions: retry, cancel, purge, signal, "
        "pause, limits, schedules, step reset; the audit",
        {
            "{tasks}": (*WRITE, "changeStream", "listIndexes", "createIndex"),
            **{name: WRITE for name in SIDE},
            **{name: WRITE for name in CLUSTER},
            "throughput": WRITE,
            "triggers": WRITE,
            "audit": ("find", "insert", "createCollection", "convertToCapped"),
            KEY_VAULT: READ,
        },
        inherits=("viewer",),
        atlas="readWrite@mtask",
    ),
    "admin": Role(
        "mtaskAdmin",
        "mtask collection init: the collections, indexes and validator; data keys",
        {
            "": (
                "listCollections",
                "createCollection",
                "createIndex",
                "dropIndex",
                "listIndexes",
                "collMod",
            ),
            KEY_VAULT: (*WRITE, "createIndex"),
        },
        inherits=("operator",),
        atlas="dbAdmin@mtask + readWrite@mtask",
    ),
}
PARTS = tuple(ROLES)


def _name(collection: str, tasks: str) -> str:
    return collection.replace("{tasks}", tasks)


def grants(part: str, tasks: str = "tasks") -> dict[str, set[str]]:
    """Every action the part may take, per collection name (``""``: any), inherited ones
    included."""
    role = ROLES[part]
    found: dict[str, set[str]] = {}
    for parent in role.inherits:
        for name, actions in grants(parent, tasks).items():
            found.setdefault(name, set()).update(actions)
    for name, own in role.grants.items():
        found.setdefault(_name(name, tasks), set()).update(own)
    return found


def inbox_grants(part: str) -> dict[str, set[str]]:
    """Every action the part may take in the inbox database, per collection (``""``: any),
    inherited ones included."""
    role = ROLES[part]
    found: dict[str, set[str]] = {}
    for parent in role.inherits:
        for name, actions in inbox_grants(parent).items():
            found.setdefault(name, set()).update(actions)
    for name, own in role.inbox.items():
        found.setdefault(name, set()).update(own)
    return found


def role_commands(database: str, tasks: str = "tasks") -> dict[str, list[dict[str, Any]]]:
    """``createRole`` commands per database to run them in: every part's role in
    ``database``, in an order that creates a role before one that inherits it, and the inbox
    roles in the inbox database (``updateRole`` takes the same fields)."""
    inboxes = inbox_database(database)
    made = [
        {
            "createRole": role.inbox_role,
            "privileges": [
                {"resource": {"db": inboxes, "collection": name}, "actions": [*acts]}
                for name, acts in role.inbox.items()
            ],
            "roles": [],
        }
        for role in ROLES.values()
        if role.inbox
    ]
    return {database: _role_commands(database, tasks), inboxes: made}


def _role_commands(database: str, tasks: str) -> list[dict[str, Any]]:
    ordered: list[str] = []

    def visit(part: str) -> None:
        for parent in ROLES[part].inherits:
            visit(parent)
        if part not in ordered:
            ordered.append(part)

    for part in PARTS:
        visit(part)
    commands = []
    for part in ordered:
        role = ROLES[part]
        privileges = [
            {"resource": {"db": database, "collection": _name(name, tasks)}, "actions": [*acts]}
            for name, acts in role.grants.items()
        ]
        inherited = [{"role": ROLES[p].name, "db": database} for p in role.inherits]
        commands.append({"createRole": role.name, "privileges": privileges, "roles": inherited})
    return commands


def missing(part: str, call: Call, tasks: str = "tasks") -> list[str]:
    """The actions ``call`` needs that ``part``'s role does not grant (``[]``: allowed).
    ``collection`` is the call's key in ``driver.collections`` (``output``: ``<tasks>.output``)."""
    if call.collection == INBOX_CALLS:  # the relay's reports, in the inbox database
        have, name = inbox_grants(part), f"{tasks}.reports"
    else:
        have, name = grants(part, tasks), call_collection(call, tasks)
    allowed = have.get(name, set()) | have.get("", set())
    return [a for a in actions_of(call) if a not in allowed]


ROLE_EXISTS = 51002
"""The server's code for ``createRole`` of a role that exists (``updateRole`` then)."""


def _covers(privilege: Mapping[str, Any], database: str, collection: str) -> bool:
    """Whether a privilege's resource holds ``collection`` of ``database`` (``""``: the whole
    database, which only a resource of every collection holds)."""
    resource = privilege.get("resource") or {}
    if resource.get("anyResource"):
        return True
    if resource.get("db") not in (database, ""):
        return False
    return resource.get("collection") in ({collection, ""} if collection else {""})


def lacking(part: str, auth_info: Mapping[str, Any], database: str, tasks: str) -> list[str]:
    """What ``part``'s role grants that the connection's privileges (``connectionStatus``'s
    ``authInfo``) do not, as ``action, action on database.collection``; ``[]`` when they do,
    or when nobody is authenticated (a server without ``--auth``)."""
    if not auth_info.get("authenticatedUsers"):
        return []
    privileges = auth_info.get("authenticatedUserPrivileges") or []
    said = []
    inboxes = inbox_database(database)
    wanted = [(database, grants(part, tasks)), (inboxes, inbox_grants(part))]
    for db, by_name in wanted:
        for name, needed in sorted(by_name.items()):
            have: set[str] = set()
            for privilege in privileges:
                if _covers(privilege, db, name):
                    have.update(privilege.get("actions") or ())
            if "anyAction" in have:
                continue
            if absent := sorted(set(needed) - have):
                where = f"{db}.{name}" if name else f"{db} (every collection)"
                said.append(f"{', '.join(absent)} on {where}")
    return said


def grants_table(tasks: str = "tasks") -> str:
    """Every role's own grants as a Markdown table (docs/security.md holds it, a test keeps
    it so): one row a role and collection, ``(the database)`` for every collection; an inbox
    role's, in the inbox database, ``(the inbox database)``."""
    rows = ["| role | inherits | collection | actions |", "| --- | --- | --- | --- |"]
    for role in ROLES.values():
        inherits = ", ".join(f"`{ROLES[p].name}`" for p in role.inherits) or "-"
        if not role.grants:
            rows.append(f"| `{role.name}` | {inherits} | - | - |")
        for name, actions in role.grants.items():
            where = f"`{_name(name, tasks)}`" if name else "(the database)"
            acts = ", ".join(f"`{a}`" for a in actions)
            rows.append(f"| `{role.name}` | {inherits} | {where} | {acts} |")
            inherits = ""
        for name, actions in role.inbox.items():
            where = f"`{name}` (the inbox database)" if name else "(the inbox database)"
            acts = ", ".join(f"`{a}`" for a in actions)
            rows.append(f"| `{role.inbox_role}` | - | {where} | {acts} |")
    return "\n".join(rows) + "\n"
