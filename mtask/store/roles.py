"""The roles of every part created or updated in MongoDB (``createRole``/``updateRole``), from
their one definition in ``mtask.security.roles``."""

from __future__ import annotations

from pymongo.errors import OperationFailure

from mtask.driver import Call, Doc, Op
from mtask.security.roles import ROLE_EXISTS, role_commands


def create_roles(database: str, tasks: str = "tasks") -> Op[list[str]]:
    """Create (or bring up to date) every part's role in ``database``; returns their names. The
    caller needs ``createRole``/``grantRole`` on it (``userAdmin``)."""
    made = []
    for command in role_commands(database, tasks):
        name = command["createRole"]
        fields = {"privileges": command["privileges"], "roles": command["roles"]}
        try:
            yield Call("command", ("createRole", name), fields)
        except OperationFailure as exc:
            if exc.code != ROLE_EXISTS:
                raise
            yield Call("command", ("updateRole", name), fields)
        made.append(name)
    return made


def connection_status() -> Op[Doc]:
    """The connection's ``authInfo``: its users, roles and every privilege they give
    (``connectionStatus``, which needs no privilege)."""
    reply: Doc = yield Call("command", ("connectionStatus",), {"showPrivileges": True})
    info: Doc = reply.get("authInfo") or {}
    return info
