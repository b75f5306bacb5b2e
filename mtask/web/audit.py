"""The audit's ASGI middleware: every state-changing request of someone with a role (after the
guard said who) is recorded once it is answered — who, what, on what, when, from where, and
the answer's status (a refused attempt too) — into ``store.audit``. Sign-in and sign-out are
not actions. A record that cannot be written is logged, and the request is not failed."""

from __future__ import annotations

import logging
import urllib.parse
from typing import Any

from mtask.errors import MtaskError
from mtask.web.access import SAFE, action_of
from mtask.web.auth import Principal
from mtask.web.guard import App, Message, Receive, Scope, Send, form_field, route_path

log = logging.getLogger("mtask.serve")
NOT_ACTIONS = frozenset({"/login", "/logout"})
FORMS = {"/ui/act": None, "/ui/bulk": None, "/ui/signal": "signal"}
"""The dashboard's forms: the action is the form's (``act``, ``bulk``) or the form itself."""
TARGETS = ("key", "name", "worker_id", "schedule_id")


def client_address(scope: Scope, trust_proxy: bool) -> str:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    forwarded = headers.get("x-forwarded-for", "").split(",")[0].strip()
    if trust_proxy and forwarded:
        return str(forwarded)
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def describe(scope: Scope, body: bytes) -> dict[str, Any]:
    """What the request did: its action and target, from its route or its form."""
    path = route_path(scope)
    if path in FORMS:
        action = FORMS[path] or form_field(body, "action") or "unknown"
        target = form_field(body, "target") or form_field(body, "name") or ""
        return {"action": action, "target": target[:512], "via": "dashboard"}
    route = scope.get("route")
    declared = str(getattr(route, "path", path))
    params = scope.get("path_params") or {}
    target = next((str(params[k]) for k in TARGETS if k in params), "")
    action = action_of(scope["method"], declared) or "read"
    return {"action": action, "target": target[:512], "path": declared, "via": "api"}


class Audit:
    def __init__(self, app: App, *, trust_proxy: bool = False) -> None:
        self.app, self.trust_proxy = app, trust_proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] in SAFE
            or route_path(scope) in NOT_ACTIONS
            or not isinstance(scope.get("mtask_principal"), Principal)
        ):
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
            await self._record(scope, status, body)

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
