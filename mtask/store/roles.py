"""The roles of every part created or updated in MongoDB (``createRole``/``updateRole``), from
their one definition in ``mtask.security.roles``."""

from __future__ import annotations

from pymongo.errors import OperationFailure

from mtask.driver import Call, Doc, Op
from mtask.security.roles import INBOX_CALLS, ROLE_EXISTS, role_commands


def create_roles(database: str, tasks: str = "tasks") -> Op[list[str]]:
    """Create (or bring up to date) every part's role in ``database``, and the inbox roles in
    the inbox database (``driver.inbox_database``); returns their names. The caller needs
    ``createRole``/``grantRole`` on both (``userAdmin``)."""
    made = []
    for db, commands in role_commands(database, tasks).items():
        where = "tasks" if db == database else INBOX_CALLS  # a command runs in its database
        for command in commands:
            name = command["createRole"]
            fields = {"privileges": command["privileges"], "roles": command["roles"]}
            try:
                yield Call("command", ("createRole", name), fields, collection=where)
            except OperationFailure as exc:
                if exc.code != ROLE_EXISTS:
                    raise
                yield Call("command", ("updateRole", name), fields, collection=where)
            made.append(name)
    return made


def connection_status() -> Op[Doc]:
    """The connection's ``authInfo``: its users, roles and every privilege they give
    (``connectionStatus``, which needs no privilege)."""
    reply: Doc = yield Call("command", ("connectionStatus",), {"showPrivileges": True})
    info: Doc = reply.get("authInfo") or {}
    return info
