"""Who may do what on ``mtask serve``: the roles' policy, one table, and the dependency every
API route runs (``authorize``).

- **viewer**: every read (``GET``), but the audit;
- **operator**: a viewer's, and the actions on tasks and names: publish, retry, cancel, signal,
  step reset, pause and resume (names and schedules); the audit;
- **admin**: an operator's, and what reaches beyond one task or cannot be undone: purge, limits,
  a worker's stop, a schedule's removal.

A route is found by its method and declared path (``ROUTE_ACTIONS``); a state-changing route
the table does not name needs an admin, so a route added without a line here is closed, not
open. A read token's holder (``mtask.security.read_tokens``) may read one task, its output and its
stream (``READ_ROUTES``) and nothing else; the task must be in the token's scope.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import HTTPException, Request

from mtask.security import read_tokens
from mtask.web.auth import Principal, failed, principal_of

ACTION_ROLES = {
    "publish": "operator",
    "retry": "operator",
    "cancel": "operator",
    "signal": "operator",
    "reset": "operator",
    "pause": "operator",
    "resume": "operator",
    "audit": "operator",
    "trigger": "operator",
    "purge": "admin",
    "remark": "admin",
    "limit": "admin",
    "stop": "admin",
    "unschedule": "admin",
}
"""The role each action needs (the dashboard's forms name the same actions)."""
ROUTE_ACTIONS = {
    ("POST", "/tasks"): "publish",
    ("POST", "/tasks:batch"): "publish",
    ("POST", "/tasks:retry"): "retry",
    ("POST", "/tasks:cancel"): "cancel",
    ("POST", "/tasks:purge"): "purge",
    ("POST", "/tasks/{key:path}:cancel"): "cancel",
    ("POST", "/tasks/{key:path}:retry"): "retry",
    ("POST", "/tasks/{key:path}:reset"): "reset",
    ("POST", "/tasks/{key:path}:remark"): "remark",
    ("POST", "/tasks/{key:path}:signal"): "signal",
    ("POST", "/workers/{worker_id}/stop"): "stop",
    ("POST", "/names/{name}/pause"): "pause",
    ("POST", "/names/{name}/resume"): "resume",
    ("POST", "/schedules/{schedule_id}/pause"): "pause",
    ("POST", "/schedules/{schedule_id}/resume"): "resume",
    ("DELETE", "/schedules/{schedule_id}"): "unschedule",
    ("PUT", "/limits/{name}"): "limit",
    ("DELETE", "/limits/{name}"): "limit",
    ("PUT", "/limits/{name}/groups/{group}"): "limit",
    ("DELETE", "/limits/{name}/groups/{group}"): "limit",
    ("PUT", "/resources/{resource}"): "limit",
    ("DELETE", "/resources/{resource}"): "limit",
    ("PUT", "/budgets/{scope}/{scope_id}"): "limit",
    ("DELETE", "/budgets/{scope}/{scope_id}"): "limit",
    ("GET", "/audit"): "audit",
    ("POST", "/triggers/{name}:pause"): "trigger",
    ("POST", "/triggers/{name}:resume"): "trigger",
    ("POST", "/triggers/{name}:reset"): "trigger",
}
READ_ROUTES = frozenset(
    {"/tasks/{key:path}", "/tasks/{key:path}:output", "/tasks/{key:path}:stream"}
)
"""What a read token opens (``GET`` only)."""
SAFE = frozenset({"GET", "HEAD", "OPTIONS"})


def action_of(method: str, path: str) -> str | None:
    """The action a route is (None: a read any viewer may make)."""
    found = ROUTE_ACTIONS.get((method, path))
    if found is None and method not in SAFE:
        return "admin-only"
    return found


def role_for(action: str | None) -> str:
    if action is None:
        return "viewer"
    return ACTION_ROLES.get(action, "admin")


def may(principal: Principal | None, action: str) -> bool:
    """Whether ``principal`` may take ``action`` (the dashboard shows only such forms)."""
    return principal is not None and principal.may(role_for(action))


def refuse(status: int, detail: str) -> HTTPException:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return HTTPException(status_code=status, detail=detail, headers=headers)


async def authorize(request: Request) -> None:
    """The API's dependency: 401 without credentials (the guard decided who calls), 403 for a
    role below the route's, a read token's holder only on its task's routes."""
    who = request.scope.get("mtask_auth")
    if who is None:
        raise refuse(401, "missing or wrong bearer token")
    route = request.scope.get("route")
    path = str(getattr(route, "path", request.url.path))
    if who == "read":
        await read_allowed(request, path)
        return
    principal = principal_of(request)
    need = role_for(action_of(request.method, path))
    if principal is None or not principal.may(need):
        role = principal.role if principal else "nobody"
        raise refuse(403, f"a {role} may not {request.method} {path}: it needs the {need} role")


async def read_allowed(request: Request, path: str) -> None:
    """A read token: its routes only, a valid token, and a task in its scope."""
    if request.method != "GET" or path not in READ_ROUTES or "view" in request.query_params:
        raise refuse(403, "a read token reads one task, its output and its stream only")
    secret: bytes | None = request.app.state.read_secret
    if secret is None:
        failed(request.scope, "read token")
        raise refuse(401, "read tokens are not enabled on this server")
    client: Any = request.app.state.client
    try:
        scope = read_tokens.verify(
            secret, str(request.scope["mtask_read_token"]), client.clock.now()
        )
    except read_tokens.BadToken as exc:
        failed(request.scope, "read token")
        raise refuse(401, str(exc)) from None
    key = request.path_params.get("key")
    if scope.kind == "task":
        if key != scope.key:
            raise refuse(403, "this read token is for another task")
        return
    task = await client.get(key)
    if task is None:  # 403, not 404: a token says nothing of keys beyond its scope
        raise refuse(403, "this read token does not cover this task")
    doc = {
        "_id": task.key,
        "name": task.name,
        "options": {"group": task.options.group},
        "parent": task.parent,
        "depends_on": task.depends_on,
    }
    if not scope.covers(doc):
        raise refuse(403, "this read token does not cover this task")


TOKEN_IN_QUERY = re.compile(r"(token=)[^&\s]+")


class RedactTokens(logging.Filter):
    """Takes read tokens out of the access log's lines (``?token=…``: an ``EventSource`` sends
    its token in the address, and uvicorn logs the address)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                TOKEN_IN_QUERY.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args
            )
        return True
