"""The dashboard: server-rendered pages (Jinja2) with a little JS, no CDN.

``/`` shows counts per name and status, throughput over the last minutes, live workers and the
runs they hold, recent failures, and buttons (retry, cancel, pause, resume, stop worker) that
call the API. ``/ui/tasks/{key}`` shows one task: params, options, flow and run history.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import json
import urllib.parse
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape

from mtask.client import AsyncTaskClient
from mtask.models import TaskStatus
from mtask.web.auth import COOKIE, token_ok

router = APIRouter(include_in_schema=False)
templates = Environment(
    loader=PackageLoader("mtask.web", "templates"), autoescape=select_autoescape()
)
templates.filters["json"] = lambda value: json.dumps(value, indent=2, default=str)
templates.filters["when"] = lambda v: v.strftime("%Y-%m-%d %H:%M:%S") if v else "-"
templates.filters["url"] = lambda v: urllib.parse.quote(str(v), safe="")
templates.filters["path"] = lambda v: urllib.parse.quote(str(v), safe="/")
STATUSES = [s.value for s in TaskStatus]


def render(name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(templates.get_template(name).render(**context), status_code=status_code)


def login_page(message: str = "") -> HTMLResponse:
    return render("login.html", status_code=401, message=message)


@router.post("/login")
async def login(request: Request) -> Response:
    form = urllib.parse.parse_qs((await request.body()).decode(errors="replace"))
    given = (form.get("token") or [""])[0].strip()
    expected: str | None = request.app.state.token
    if expected is not None and not hmac.compare_digest(given.encode(), expected.encode()):
        return login_page("That is not the token.")
    response = RedirectResponse("/", status_code=303)
    response.set_cookie(COOKIE, given, httponly=True, samesite="strict", max_age=7 * 86400)
    return response


def chart(samples: collections.deque[Any], width: int = 600, height: int = 110) -> dict[str, Any]:
    """Tasks finished per second between samples, as an SVG polyline."""
    points = list(samples)
    rates = [
        (b.at, max(0.0, (b.finished - a.finished) / max(1e-3, (b.at - a.at).total_seconds())))
        for a, b in itertools.pairwise(points)
    ]
    if not rates:
        return {"points": "", "peak": 0.0, "last": 0.0, "minutes": 0, "width": width}
    peak = max(r for _, r in rates) or 1.0
    span = max(1e-3, (rates[-1][0] - rates[0][0]).total_seconds())
    coords = [
        f"{(t - rates[0][0]).total_seconds() / span * width:.1f},"
        f"{height - r / peak * (height - 10):.1f}"
        for t, r in rates
    ]
    return {
        "points": " ".join(coords),
        "peak": peak,
        "last": rates[-1][1],
        "minutes": round(span / 60, 1),
        "width": width,
    }


@router.get("/", response_class=HTMLResponse)
async def overview(request: Request) -> HTMLResponse:
    if not token_ok(request):
        return login_page()
    client: AsyncTaskClient = request.app.state.client
    counts = await client.stats()
    paused = await client.paused()
    names = sorted(set(counts) | paused)
    return render(
        "overview.html",
        names=names,
        counts=counts,
        statuses=STATUSES,
        paused=paused,
        workers=await client.workers(),
        failures=await client.list(status="failed", limit=10),
        chart=chart(request.app.state.samples),
        now=await client.now(),
    )


@router.get("/ui/tasks/{key:path}", response_class=HTMLResponse)
async def task_page(key: str, request: Request) -> HTMLResponse:
    if not token_ok(request):
        return login_page()
    client: AsyncTaskClient = request.app.state.client
    task = await client.get(key)
    if task is None:
        return render("missing.html", status_code=404, key=key)
    return render("task.html", task=task, now=await client.now())
