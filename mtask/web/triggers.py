"""Triggers over HTTP (docs/triggers.md): the REST routes (``GET /triggers``, ``GET
/triggers/{name}``, ``POST /triggers/{name}:pause``, ``:resume``, ``:reset``) and the dashboard's
page (``/ui/triggers``: each trigger and waited-on collection with its state, lag, last change
and counts, and a form for each action). A name is a trigger's, or ``wait:COLLECTION``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mtask.client import AsyncTaskClient
from mtask.errors import MtaskError, TriggerNotFound
from mtask.models import BsonDate
from mtask.triggers import describe_lag, follower_label, follower_of
from mtask.web import access
from mtask.web.access import authorize
from mtask.web.api import NOT_FOUND, client_of
from mtask.web.audit import status_of
from mtask.web.auth import bearer_scheme, principal_of, signed_in
from mtask.web.dashboard import form_of, login_page, outcome, render, root_of, templates

Client = Annotated[AsyncTaskClient, Depends(client_of)]
router = APIRouter(dependencies=[Depends(authorize), Depends(bearer_scheme)])
pages = APIRouter(include_in_schema=False)
templates.filters["lag"] = describe_lag


class TriggerView(BaseModel):
    """A trigger (``kind`` ``trigger``) or a collection tasks wait on (``wait``), as followed."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    id: str = Field(alias="_id")
    kind: str | None = None
    name: str | None = None
    collection: str | None = None
    spec: dict[str, Any] | None = Field(None, description="the declaration, as a registry says it")
    held: bool = Field(False, description="a worker follows it now")
    holder: str | None = None
    paused: bool = False
    lag_ms: float | None = Field(
        None, description="the server's time less the time up to which every change is handled"
    )
    at: BsonDate | None = Field(None, description="the cluster time of the last change handled")
    through: BsonDate | None = None
    changes: int | None = None
    published: int | None = Field(None, description="tasks published (triggers), or woken (waits)")
    lost: int | None = Field(None, description="times its stream's history was lost (then scanned)")
    lost_at: BsonDate | None = None
    scan: dict[str, Any] | None = None
    problems: list[str] = Field(
        default_factory=list, description="fields the document holds in another shape (left out)"
    )


class ResetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scan: bool = Field(False, description="scan the matching documents first (a task for each)")


def _view(doc: dict[str, Any]) -> TriggerView:
    """A follower's document of any shape: a field in another shape is left out and named in
    ``problems`` (a hand edit, another version's field)."""
    fields = dict(doc)
    problems: list[str] = []
    for _ in range(len(TriggerView.model_fields)):
        try:
            return TriggerView.model_validate({**fields, "problems": problems})
        except ValidationError as exc:
            bad = {str(e["loc"][0]) for e in exc.errors() if e.get("loc")}
            problems += [f"{name}: {str(fields.get(name))[:40]!r}" for name in sorted(bad)]
            fields = {k: v for k, v in fields.items() if k not in bad}
    return TriggerView.model_validate({"_id": str(doc.get("_id")), "problems": problems})


@router.get("/triggers", tags=["triggers"])
async def list_triggers(client: Client) -> list[TriggerView]:
    return [_view(d) for d in await client.triggers()]


@router.get("/triggers/{name}", tags=["triggers"], responses=NOT_FOUND)
async def get_trigger(name: str, client: Client) -> TriggerView:
    kind, bare = follower_of(name)
    for doc in await client.triggers():
        if (doc.get("kind"), doc.get("name")) == (kind, bare):
            return _view(doc)
    raise TriggerNotFound(name)


@router.post("/triggers/{name}:pause", tags=["triggers"], responses=NOT_FOUND)
async def pause_trigger(name: str, client: Client) -> TriggerView:
    return _view(await client.pause_trigger(name))


@router.post("/triggers/{name}:resume", tags=["triggers"], responses=NOT_FOUND)
async def resume_trigger(name: str, client: Client) -> TriggerView:
    return _view(await client.resume_trigger(name))


@router.post("/triggers/{name}:reset", tags=["triggers"], responses=NOT_FOUND)
async def reset_trigger(name: str, client: Client, body: ResetBody | None = None) -> TriggerView:
    return _view(await client.reset_trigger(name, scan=bool(body and body.scan)))


# -- the dashboard's page -------------------------------------------------------------------------


@pages.get("/ui/triggers", response_class=HTMLResponse)
async def triggers_page(request: Request) -> HTMLResponse:
    if not signed_in(request):
        return login_page(request)
    client: AsyncTaskClient = request.app.state.client
    shown = []
    for doc in await client.triggers():
        view = _view(doc)
        label = follower_label(view.kind, view.name if view.name is not None else doc.get("name"))
        shown.append({"label": label, "view": view, "spec": view.spec or {}})
    return render(request, "triggers.html", triggers=shown, now=await client.now())


ACTIONS = ("pause", "resume", "reset", "reset-scan")


@pages.post("/ui/triggers")
async def trigger_action(request: Request) -> Response:
    """Pause, resume or reset (with a scan, or not) one trigger, from its row's form."""
    form = await form_of(request)
    client: AsyncTaskClient = request.app.state.client
    action, target = form.get("action", ""), form.get("target", "")
    page = root_of(request) + "/ui/triggers"
    if action not in ACTIONS:
        return outcome(request, 422, page, problem=f"unknown action {action!r}")
    principal = principal_of(request)
    if not access.may(principal, "trigger"):
        role = principal.role if principal else "nobody"
        problem = f"a {role} may not steer a trigger: it needs the operator role"
        return outcome(request, 403, page, problem=problem)
    try:
        if action == "pause":
            await client.pause_trigger(target)
            said = "paused: its holder stops within seconds, its position kept"
        elif action == "resume":
            await client.resume_trigger(target)
            said = "resumed: followed again from its position within seconds"
        else:
            await client.reset_trigger(target, scan=action == "reset-scan")
            said = "reset: followed from now" + (", after a scan" if action == "reset-scan" else "")
    except MtaskError as exc:
        return outcome(request, status_of(exc), page, problem=str(exc))
    return outcome(request, 200, page, flash=f"{target}: {said}")
