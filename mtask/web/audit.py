"""The audit's ASGI middleware: every state-changing request of someone with a role is recorded
once it is answered — who, what, on what, when, from where, and the outcome's status (a refused
attempt too, the guard's refusals included) — into ``store.audit``. It runs before the guard and
reads, once the request is answered, who the guard said was calling: a request without a role
(no credentials, or wrong ones) is not recorded (the rates count those: ``web.rates``). Sign-in
and sign-out are not actions. A record that cannot be written is logged, and the request is not
failed.

The status is the outcome's: a dashboard form is answered ``303`` (a redirect with its flash
message) whatever became of it, so its handler names the outcome (``set_outcome``: ``200``
applied, else the refusal's ``403``, ``404``, ``409``, ``422``, ``503``), as the API's status
would."""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Iterable, Iterator
from typing import Any

from starlette.routing import Match

from mtask.errors import (
    InvalidTask,
    InvalidTransition,
    MtaskError,
    ScheduleNotFound,
    StorageError,
    TaskNotFound,
    TriggerNotFound,
    WorkerNotFound,
)
from mtask.web.access import ROUTE_ACTIONS, SAFE
from mtask.web.auth import Principal
from mtask.web.guard import (
    App,
    Message,
    Receive,
    Scope,
    Send,
    client_address,
    form_field,
    route_path,
)

log = logging.getLogger("mtask.serve")
NOT_ACTIONS = frozenset({"/login", "/logout"})
FORMS = {"/ui/act": "act", "/ui/bulk": "bulk", "/ui/signal": "signal", "/ui/triggers": "trigger"}
"""The dashboard's forms and their own names: the action is the form's ``action`` field (``act``,
``bulk``), else the form's name (``signal``, ``trigger``: the trigger form's field is its
``verb``). A form refused before its body was read is recorded by its form's name."""
NAMED_BY_FIELD = frozenset({"/ui/act", "/ui/bulk"})
TARGETS = ("key", "name", "worker_id", "schedule_id", "resource")
OUTCOME = "mtask_outcome"


def status_of(exc: MtaskError) -> int:
    """The status the API answers ``exc`` with (``app._errors``): the outcome of a dashboard
    form that raised it."""
    if isinstance(exc, TaskNotFound | ScheduleNotFound | TriggerNotFound | WorkerNotFound):
        return 404
    if isinstance(exc, InvalidTransition):
        return 409
    if isinstance(exc, StorageError):
        return 422 if exc.document else 503
    return 422 if isinstance(exc, InvalidTask) else 400


def set_outcome(scope: Scope, status: int) -> None:
    """What became of a dashboard form, for the audit (its answer is a 303 either way)."""
    scope[OUTCOME] = status


def every_route(routes: Iterable[Any]) -> Iterator[Any]:
    """The app's routes, those of the routers it includes too (FastAPI keeps an included
    router as one route, its ``original_router``: serve includes its routers unprefixed)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from every_route(inner.routes)
        else:
            yield route


def _route(scope: Scope) -> tuple[Any, dict[str, Any]]:
    """The route the request matched, and its parameters; the guard may have answered before
    the router ran: then the app's routes are matched here."""
    if scope.get("route") is not None:
        return scope["route"], scope.get("path_params") or {}
    for route in every_route(getattr(getattr(scope.get("app"), "router", None), "routes", ())):
        match, child = route.matches(scope)
        if match is Match.FULL:
            return route, child.get("path_params") or {}
    return None, {}


def describe(scope: Scope, body: bytes) -> dict[str, Any]:
    """What the request did: its action and target, from its route or its form."""
    path = route_path(scope)
    if path in FORMS:
        named = form_field(body, "action") if path in NAMED_BY_FIELD else None
        entry = {"action": (named or FORMS[path])[:64], "path": path, "via": "dashboard"}
        if path == "/ui/triggers":
            entry["verb"] = (form_field(body, "action") or "")[:64]
        target = form_field(body, "target") or form_field(body, "name") or ""
        return {**entry, "target": target[:512]}
    route, params = _route(scope)
    declared = str(getattr(route, "path", path))
    target = next((str(params[k]) for k in TARGETS if k in params), "")
    action = ROUTE_ACTIONS.get((scope["method"], declared), "unknown")
    return {"action": action, "target": target[:512], "path": declared[:512], "via": "api"}


class Audit:
    def __init__(self, app: App, *, trust_proxy: bool = False) -> None:
        self.app, self.trust_proxy = app, trust_proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in SAFE or route_path(scope) in NOT_ACTIONS:
            await self.app(scope, receive, send)
            return
        status = 0
        body = b""

        async def receiving() -> Message:
            nonlocal body
            message = await receive()
            if route_path(scope) in FORMS and len(body) < 16384:
                body += message.get("body", b"")
            return message

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receiving, sending)
        finally:
            if isinstance(scope.get("mtask_principal"), Principal):  # the guard said who
                await self._record(scope, scope.get(OUTCOME) or status, body)

    async def _record(self, scope: Scope, status: int, body: bytes) -> None:
        principal: Principal = scope["mtask_principal"]
        entry = {
            "who": principal.who,
            "role": principal.role,
            **describe(scope, body),
            "method": scope["method"],
            "status": status,
            "from": client_address(scope, self.trust_proxy),
        }
        client = getattr(scope.get("app"), "state", None)
        try:
            await client.client.record_audit(entry)  # type: ignore[union-attr]
        except (MtaskError, AttributeError) as exc:
            log.warning(
                "cannot record the audit of %s %s: %s",
                scope["method"],
                urllib.parse.quote(scope["path"]),
                exc,
            )
