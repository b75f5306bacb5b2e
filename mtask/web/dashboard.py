"""The dashboard: server-rendered pages (Jinja2), no CDN, every action a plain form.

Pages: ``/`` (counts per name and derived state, each a link to the task list; finished and
failed per minute per name as SVG charts with axes; recent failures), ``/ui/tasks`` (the task
list: filter by name, derived state and group, search by key prefix or error words, keyset
pagination, bulk retry / cancel / purge of the filtered set with a dry-run count first),
``/ui/tasks/{key}`` (one task: a header card with its state and why it is not running, then its
steps, log and runs; params and the options that differ from the defaults folded),
``/ui/limits`` (each limit, how full it is, and its groups) and ``/ui/workers``. Actions are
forms posting to ``/ui/act``, ``/ui/signal`` and ``/ui/bulk`` with the session's CSRF token,
answered POST-redirect-GET with a flash message, so everything works without JavaScript;
``static/dashboard.js`` submits them in place and refreshes pages.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import secrets
import urllib.parse
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape

from mtask.client import AsyncTaskClient
from mtask.errors import MtaskError
from mtask.explain import states, tracebacks
from mtask.explain.wording import plural, relative, span
from mtask.flows import MAX_TREE_NODES
from mtask.models import Task
from mtask.security import encryption
from mtask.steps import NEVER, signal_fate
from mtask.store import bulk
from mtask.usage.rules import usage_text
from mtask.vocabulary import TaskStatus
from mtask.web import access, graph
from mtask.web.audit import set_outcome, status_of
from mtask.web.auth import (
    COOKIE,
    LOGIN_COOKIE,
    SESSION_SECONDS,
    Keys,
    csrf_of,
    failed,
    principal_of,
    signed_in,
)
from mtask.web.charts import charts, timeline

router = APIRouter(include_in_schema=False)
templates = Environment(
    loader=PackageLoader("mtask.web", "templates"), autoescape=select_autoescape()
)
templates.filters["json"] = lambda value: json.dumps(value, indent=2, default=str)
templates.filters["when"] = lambda v: v.strftime("%Y-%m-%d %H:%M:%S") if v else "-"
templates.filters["clock"] = lambda v: v.strftime("%H:%M:%S") if v else "-"
templates.filters["url"] = lambda v: urllib.parse.quote(str(v), safe="")
templates.filters["path"] = lambda v: urllib.parse.quote(str(v), safe="/")
templates.filters["lastline"] = lambda v: ((v or "").strip().splitlines() or [""])[-1]
PREVIEW_CHARS = 120
"""The most of a step's result or a signal's payload a task page shows (the JSON has it all)."""


def _deadline(value: dt.datetime | None) -> str:
    """A wait's end: ``no deadline`` for a wait without a timeout (9999-01-01)."""
    if value is None or value.year >= NEVER.year:
        return "no deadline"
    return value.strftime("%Y-%m-%d %H:%M:%S")


def _ticks(text: str | None) -> Markup:
    """A reason as HTML: escaped, its `backticked` keys and names as ``<code>``."""
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", str(escape(text or ""))))


def _breakable(key: Any) -> Markup:
    """A task key as HTML that a line may break after each ``/``, ``:``, ``#``, ``.`` or
    ``_`` (``<wbr>``) rather than anywhere: a wide page keeps a key's parts whole."""
    return Markup(re.sub(r"([/:#._])", r"\1<wbr>", str(escape(str(key)))))


def _preview(value: Any) -> str:
    text = json.dumps(value, default=str, separators=(",", ":"))
    return text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…"


templates.filters["deadline"] = _deadline
templates.filters["state_label"] = states.label
templates.filters["shown"] = encryption.shown
templates.filters["preview"] = _preview
templates.filters["usage"] = usage_text
templates.filters["ticks"] = _ticks
templates.filters["breakable"] = _breakable
templates.globals.update(
    rel=relative,
    span=span,
    plural=plural,
    fold=tracebacks.fold,
    wait_deadline=states.deadline,
    attempt_text=states.attempt_text,
    STATES=states.STATES,
)
templates.globals["qs"] = lambda **kw: urllib.parse.urlencode(
    {k: v for k, v in kw.items() if v not in (None, "")}
)
STATUSES = [s.value for s in TaskStatus]
STATES = list(states.STATES)
FINAL_STATES = [s.value for s in states.State if not s.open]
PAGE_SIZE = 50
CHART_MINUTES = 60
"""The overview's charts: the last hour (``mtask serve`` counts it whole when it starts)."""
BULK_COUNT_LIMIT = 10_000
"""The task list says how many tasks a bulk action would change up to this many ("10,000+")."""


def duration(start: dt.datetime | None, end: dt.datetime | None) -> str:
    if start is None or end is None:
        return "-"
    seconds = (end - start).total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


templates.globals["duration"] = duration


MESSAGE_KEYS = ("flash", "problem", "confirm", "at", "sig", "payload")
"""What an action's answer adds to the page's query (``back``): the message, where it belongs
(``at=signal``: beside the signal form) and the form's input to give back."""


def settled(request: Request) -> str:
    """This page's address without an action's message: what a refresh shows."""
    kept = [(k, v) for k, v in request.query_params.multi_items() if k not in MESSAGE_KEYS]
    return request.url.path + (f"?{urllib.parse.urlencode(kept)}" if kept else "")


def root_of(request: Request) -> str:
    """Where the app is mounted (the ASGI ``root_path``, ``""`` at a server's root): every
    link, form and redirect of the dashboard starts with it."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    query = request.query_params
    page = templates.get_template(name).render(
        root=root_of(request),
        csrf=csrf_of(request),
        nav=signed_in(request),
        signed_in=signed_in(request) and not request.app.state.keys.open,
        may=lambda action: access.may(principal_of(request), action),
        principal=principal_of(request),
        flash=query.get("flash", "")[:300],
        problem=query.get("problem", "")[:300],
        note_at=query.get("at", ""),
        here=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
        settled=settled(request),
        **context,
    )
    return HTMLResponse(page, status_code=status_code)


def client_of(request: Request) -> AsyncTaskClient:
    client: AsyncTaskClient = request.app.state.client
    return client


# -- signing in and out -----------------------------------------------------------------------


def login_page(request: Request, message: str = "") -> HTMLResponse:
    """The sign-in form, with a fresh pre-session CSRF pair: a nonce cookie and its HMAC."""
    keys: Keys = request.app.state.keys
    nonce = secrets.token_urlsafe(18)
    response = render(
        request, "login.html", status_code=401, message=message, login_csrf=keys.login_csrf(nonce)
    )
    response.set_cookie(
        LOGIN_COOKIE,
        nonce,
        max_age=3600,
        httponly=True,
        samesite="strict",
        secure=bool(request.scope.get("mtask_secure")),
    )
    return response


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request) -> HTMLResponse:
    return login_page(request)


@router.post("/login")
async def login(request: Request) -> Response:
    """The guard checked the origin and the form's CSRF pair before this body was read."""
    form = urllib.parse.parse_qs((await request.body()).decode(errors="replace"))
    given = (form.get("token") or [""])[0]
    keys: Keys = request.app.state.keys
    principal = keys.principal(given)
    if principal is None:
        failed(request.scope, "sign-in")
        return login_page(request, "That is not the token.")
    response = RedirectResponse(f"{root_of(request)}/", status_code=303)
    response.set_cookie(
        COOKIE,
        keys.new_session(principal),
        max_age=SESSION_SECONDS,
        httponly=True,
        samesite="strict",
        secure=bool(request.scope.get("mtask_secure")),
    )
    response.delete_cookie(LOGIN_COOKIE)
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Ends the browser's session (the guard checked its origin and CSRF token)."""
    signed_out = urllib.parse.urlencode({"flash": "signed out"})
    response = RedirectResponse(f"{root_of(request)}/login?{signed_out}", 303)
    response.delete_cookie(COOKIE, httponly=True, samesite="strict")
    return response


# -- pages ------------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
async def overview(request: Request) -> HTMLResponse:
    if not signed_in(request):
        return login_page(request)
    client = client_of(request)
    counts = await client.state_counts()
    paused = await client.paused()
    now = await client.now()
    failures = await client.search(status="failed", limit=10)
    totals = {s: sum(row.get(s, 0) for row in counts.counts.values()) for s in STATES}
    return render(
        request,
        "overview.html",
        names=sorted(set(counts.counts) | paused),
        counts=counts,
        totals=totals,
        at_least={s for _, s in counts.stored.at_least},
        states=STATES,
        paused=paused,
        charts=charts(await client.throughput(CHART_MINUTES), now),
        failures=failures,
        groups=await client.groups(top=10),
        workers=await client.workers(),
        now=now,
    )


def _list_filters(q: Any) -> dict[str, Any]:
    state = q.get("state") if q.get("state") in STATES else None
    status = q.get("status") if q.get("status") in STATUSES and state is None else None
    return {
        "name": q.get("name") or None,
        "state": state,
        "status": status,
        "prefix": q.get("prefix") or None,
        "text": q.get("q") or None,
        "group": (q.get("group") or None) if len(q.get("group") or "") <= 200 else None,
        "parent": (q.get("parent") or None) if len(q.get("parent") or "") <= 1024 else None,
    }


async def _listed(
    client: AsyncTaskClient, filters: dict[str, Any], after: str | None
) -> tuple[list[tuple[Task, states.Explained]], str | None, int | None]:
    """A page of the list: the tasks with their derived state, the next page's ``after``, and
    how many tasks were read to find them (a page by state only)."""
    common = {k: filters[k] for k in ("name", "prefix", "text", "group", "parent")}
    if filters["state"] is not None:
        page = await client.search_state(filters["state"], **common, after=after, limit=PAGE_SIZE)
        return page.tasks, page.after, page.examined
    tasks = await client.search(**common, status=filters["status"], after=after, limit=PAGE_SIZE)
    said = await client.explain_all(tasks)
    more = tasks[-1].key if len(tasks) == PAGE_SIZE else None
    return list(zip(tasks, said, strict=True)), more, None


@router.get("/ui/tasks", response_class=HTMLResponse)
async def task_list(request: Request) -> HTMLResponse:
    if not signed_in(request):
        return login_page(request)
    client = client_of(request)
    q = request.query_params
    filters = _list_filters(q)
    problem = ""
    try:
        rows, next_after, examined = await _listed(client, filters, q.get("after") or None)
    except MtaskError as exc:
        rows, next_after, examined, problem = [], None, None, str(exc)
    # bulk actions act on name + status, and on a search's listed tasks by their keys
    final = filters["state"] if filters["state"] in FINAL_STATES else filters["status"]
    narrowed = filters["prefix"] or filters["text"] or filters["group"] or filters["parent"]
    by_keys = narrowed or (filters["state"] is not None and final is None)
    keys = [t.key for t, _ in rows] if by_keys else None
    where = bulk.Filter(filters["name"], [final] if final else None, keys=keys)
    counts: dict[str, tuple[str, int]] = {}
    actions: tuple[bulk.Action, ...] = ("retry", "cancel", "purge")
    for action in actions:
        if not access.may(principal_of(request), action):
            continue  # its form is not shown
        # counted up to a bound: the page must not walk every finished task to say "purge all"
        n = await client.bulk_count(action, where, BULK_COUNT_LIMIT)
        counts[action] = (f"{BULK_COUNT_LIMIT:,}+" if n > BULK_COUNT_LIMIT else f"{n:,}", n)
    return render(
        request,
        "tasks.html",
        rows=rows,
        filters=filters,
        states=STATES,
        names=await client.names(),
        next_after=next_after,
        examined=examined,
        bulk_counts=counts,
        bulk_status=final or "",
        bulk_keys=json.dumps(keys) if keys is not None else None,
        confirm=q.get("confirm", ""),
        list_problem=problem,
        now=await client.now(),
    )


OUTPUT_SHOWN = 200
"""The newest log lines and chunks a task page shows (``mtask logs KEY`` has them all)."""
CHILDREN_SHOWN = 20
"""The first children a task page lists (the task list, filtered by its parent, has them all)."""
FLOW_SHOWN = 300
"""The most tasks a flow page draws (``mtask flow KEY`` and its JSON have up to 10,000)."""
ANCESTORS = 20
"""The most tasks above one a flow page names (the flow's root and the way down to it)."""


SHOWN_ERROR = frozenset({states.State.FAILED, states.State.RETRYING})
"""The derived states whose page shows the task's error at the top (else in its runs)."""
PAYLOAD_KEPT = 4000
"""The longest payload a refused signal form gets back in its page's address."""


@router.get("/ui/tasks/{key:path}", response_class=HTMLResponse)
async def task_page(key: str, request: Request) -> HTMLResponse:
    if not signed_in(request):
        return login_page(request)
    client = client_of(request)
    task = await client.get(key)
    if task is None:
        return render(request, "missing.html", status_code=404, key=key)
    said = await client.explain(task)
    now = await client.now()
    kids: list[tuple[Task, states.Explained]] = []
    kids_total = 0
    if task.spawned is not None or task.children:  # it made tasks: the first ones listed
        made, kids_total = await client.children(key, CHILDREN_SHOWN)
        kids = list(zip(made, await client.explain_all(made), strict=True))
    newest = max(0, (task.output_seq or 0) - OUTPUT_SHOWN)  # the newest lines
    entries = await client.output(key, after=newest, limit=OUTPUT_SHOWN) if task.output_seq else []
    live = task.status is not None and not task.status.finished
    q = request.query_params
    # without JavaScript the page reloads itself while the task is open, but not while a
    # person may be typing a signal's payload (it would be lost)
    typing = q.get("at") == "signal" or (task.waiting is not None and task.waiting.signal)
    return render(
        request,
        "task.html",
        task=task,
        said=said,
        graph=graph.build(task, [(c, cs.state.value) for c, cs in kids], said.state.value, now),
        shown_error=task.error if said.state in SHOWN_ERROR else None,
        changed=task.options.changed(),
        resettable=task.status is not None
        and task.status.value in ("pending", "failed", "cancelled"),
        current=_current_step(task),
        now=now,
        timeline=timeline(task, now),
        entries=entries,
        live=live,
        reloads=live and not typing,
        shown_from=newest,
        sig=q.get("sig"),
        payload=q.get("payload"),
        kids=kids,
        kids_total=kids_total,
    )


@router.get("/ui/flow/{key:path}", response_class=HTMLResponse)
async def flow_page(key: str, request: Request) -> HTMLResponse:
    """The tree ``mtask flow KEY`` draws: the task, the tasks it made (spawned children, next
    steps) and theirs, each with its derived state and why, the first ``FLOW_SHOWN`` in order;
    above it, the way up to the flow's root."""
    if not signed_in(request):
        return login_page(request)
    client = client_of(request)
    tree = await client.flow(key)
    if tree is None:
        return render(request, "missing.html", status_code=404, key=key)
    ancestors: list[str] = []
    task = await client.get(key)
    while task is not None and task.parent and len(ancestors) < ANCESTORS:
        ancestors.insert(0, task.parent)
        task = await client.get(task.parent)
    shown, total = _bounded(tree, FLOW_SHOWN)
    return render(
        request,
        "flow.html",
        tree=tree,
        key=key,
        ancestors=ancestors,
        shown=shown,
        total=total,
        capped=total >= MAX_TREE_NODES,
        now=await client.now(),
    )


def _bounded(tree: dict[str, Any], most: int) -> tuple[int, int]:
    """Keeps at most ``most`` nodes of ``tree``, in its order, each node's children before the
    nodes below them (a node cut goes with the nodes below it; its parent's ``more`` says how
    many of its own were cut); returns how many are kept and how many there were."""
    kept, total = 0, 0
    stack = [tree]
    while stack:
        node = stack.pop()
        total += 1
        kept += 1
        children = node.get("children") or []
        room = max(0, most - kept - len(stack))
        node["more"] = max(0, len(children) - room)
        node["children"] = children[:room]
        total += _count(children[room:])
        stack.extend(reversed(node["children"]))
    return kept, total


def _count(nodes: list[dict[str, Any]]) -> int:
    """How many nodes ``nodes`` and the nodes below them are."""
    found, stack = 0, list(nodes)
    while stack:
        node = stack.pop()
        found += 1
        stack.extend(node.get("children") or [])
    return found


def _current_step(task: Task) -> Any:
    """The step a task is in: the one it waits in, or its last recorded one while it runs."""
    if task.waiting is not None and task.waiting.index < len(task.steps):
        return task.steps[task.waiting.index]
    if task.status is TaskStatus.RUNNING and task.steps:
        return task.steps[-1]
    return None


@router.get("/ui/limits", response_class=HTMLResponse)
async def limits_page(request: Request) -> HTMLResponse:
    if not signed_in(request):
        return login_page(request)
    client = client_of(request)
    return render(
        request,
        "limits.html",
        uses=await client.limit_use(),
        groups=await client.groups(top=20),
        now=await client.now(),
    )


@router.get("/ui/workers", response_class=HTMLResponse)
async def workers_page(request: Request) -> HTMLResponse:
    if not signed_in(request):
        return login_page(request)
    client = client_of(request)
    now = await client.now()
    workers = await client.workers()
    for worker in workers:
        worker["tasks"] = []
        for held in (worker.get("running") or [])[:20]:
            task = await client.get(str(held.get("key")))
            run = (
                next((r for r in task.runs if r.run_id == held.get("run_id")), None)
                if task
                else None
            )
            worker["tasks"].append(
                {"key": held.get("key"), "since": run.claimed_at if run else None}
            )
    counts = await client.runs_by_worker(60)
    for worker in workers:
        worker["counts"] = counts.get(str(worker.get("_id")), {"processed": 0, "failed": 0})
    return render(request, "workers.html", workers=workers, now=now)


@router.get("/ui/audit", response_class=HTMLResponse)
async def audit_page(request: Request) -> HTMLResponse:
    """Who did what, when, from where: the newest 200 actions (operators and admins)."""
    if not signed_in(request):
        return login_page(request)
    if not access.may(principal_of(request), "audit"):
        return render(request, "audit.html", status_code=403, records=None, more=None)
    before = request.query_params.get("before") or None
    records = await client_of(request).audit(200, before)
    more = records[-1]["id"] if len(records) == 200 else None
    return render(request, "audit.html", records=records, more=more)


# -- actions (plain forms; POST-redirect-GET with a flash message) ------------------------------


def local_url(next_url: str) -> str:
    """``next_url`` if it is a path of this site, else ``/``. Read as a browser reads a URL (tabs
    and newlines dropped, ``\\`` as ``/``), it must start with one ``/`` (``//host`` and
    ``/\\host`` are another site) and hold no scheme or host. The redirect then sends it
    percent-encoded (a task key's ``\\`` stays in the path)."""
    seen = next_url.translate({ord("\t"): None, ord("\n"): None, ord("\r"): None})
    seen = seen.replace("\\", "/")
    if not seen.startswith("/") or seen.startswith("//"):
        return "/"
    try:
        parts = urllib.parse.urlsplit(seen)
    except ValueError:
        return "/"
    return "/" if parts.scheme or parts.netloc else next_url


def back(next_url: str, anchor: str = "", **message: str) -> RedirectResponse:
    """Redirect to a local page (never elsewhere) with a flash message (and the ``anchor``
    where it is shown)."""
    parts = urllib.parse.urlsplit(local_url(next_url))
    query = {k: v for k, v in urllib.parse.parse_qsl(parts.query) if k not in MESSAGE_KEYS}
    query.update(message)
    place = f"#{anchor}" if anchor else ""
    return RedirectResponse(f"{parts.path}?{urllib.parse.urlencode(query)}{place}", 303)


async def form_of(request: Request) -> dict[str, str]:
    form = urllib.parse.parse_qs((await request.body()).decode(errors="replace"))
    return {k: v[0] for k, v in form.items() if v}


@router.post("/ui/act")
async def act(request: Request) -> Response:
    """One action: retry or cancel a task (retry from one of its steps: ``step``), reset its
    steps, pause or resume a name, stop a worker."""
    form = await form_of(request)
    client = client_of(request)
    action, target = form.get("action", ""), form.get("target", "")
    next_url = form.get("next") or root_of(request) + "/"
    refused = _refused(request, action)
    if refused:
        return outcome(request, 403, next_url, problem=refused)
    try:
        if action == "reset":
            done = await client.reset_step(target, form.get("step", ""))
            return outcome(request, 200, next_url, flash=_reset_said(done))
        if action == "retry" and form.get("step"):
            task = await client.retry(target, from_step=form["step"])
            said = f"retry: {target} is {task.status or 'unknown'} now, from step {form['step']}"
            return outcome(request, 200, next_url, flash=said)
        if action in ("retry", "cancel"):
            task = await (client.retry(target) if action == "retry" else client.cancel(target))
            said = f"{action}: {target} is {task.status or 'unknown'} now"
            return outcome(request, 200, next_url, flash=said)
        if action in ("pause", "resume"):
            await (client.pause(target) if action == "pause" else client.resume(target))
            return outcome(request, 200, next_url, flash=f"{target}: {action}d")
        if action == "stop":
            if not await client.stop_worker(target):
                problem = f"no worker {target!r} is registered"
                return outcome(request, 404, next_url, problem=problem)
            said = f"stop requested: {target} drains and exits"
            return outcome(request, 200, next_url, flash=said)
    except MtaskError as exc:
        return outcome(request, status_of(exc), next_url, problem=str(exc))
    return outcome(request, 422, next_url, problem=f"unknown action {action!r}")


@router.post("/ui/signal")
async def send_signal(request: Request) -> Response:
    """Send a signal to a task from its page (``client.signal``): a name, and a payload given
    as JSON. An empty payload is sent only when the form says so (``empty``): the wait would
    return ``None`` to its handler, on every retry too. A payload that is not JSON, a bad name,
    a finished task: the problem shown beside the form, its input kept, nothing sent. The
    answer says what becomes of the signal (``signal_fate``)."""
    form = await form_of(request)
    key, name = form.get("target", ""), form.get("name", "").strip()
    next_url = form.get("next") or root_of(request) + "/"
    not_yours = _refused(request, "signal")
    if not_yours:
        return outcome(request, 403, next_url, "send-signal", problem=not_yours, at="signal")
    text = form.get("payload", "").strip()
    kept = {"sig": name, "payload": text if len(text) <= PAYLOAD_KEPT else ""}

    def refused(why: str, status: int = 422) -> Response:
        problem = f"signal not sent: {why}"
        anchor = "send-signal"
        return outcome(request, status, next_url, anchor, problem=problem, at="signal", **kept)

    if not text and form.get("empty") != "1":
        return refused(
            "the payload is empty: the wait would return null to the handler, on every retry "
            "too. Give a payload, or tick 'send it without a payload'"
        )
    try:
        payload = json.loads(text) if text else None
    except (ValueError, RecursionError) as exc:  # deep nesting: the C decoder recurses
        reason = (
            exc.msg
            if isinstance(exc, json.JSONDecodeError)
            else "nested too deeply"
            if isinstance(exc, RecursionError)
            else str(exc).split(":")[0]  # "Exceeds the limit (4300 digits) for integer …"
        )
        return refused(f"the payload is not JSON ({reason})")
    client = client_of(request)
    try:
        woke = await client.signal(key, name, payload)
    except MtaskError as exc:
        return refused(str(exc), status_of(exc))
    task = await client.get(key)
    fate = signal_fate.fate(task, name, woke) if task is not None else "sent"
    said = f"signal {name!r} sent to {key}: {fate}"
    return outcome(request, 200, next_url, "send-signal", flash=said, at="signal")


def outcome(
    request: Request, status: int, next_url: str, anchor: str = "", **message: str
) -> RedirectResponse:
    """``back``, and what became of the form (``200`` applied, else the refusal's status, as
    the API would answer) for the audit: the browser gets the redirect either way."""
    set_outcome(request.scope, status)
    return back(next_url, anchor, **message)


def _refused(request: Request, action: str) -> str:
    """Why the caller may not take ``action`` ('' if it may): the API's rule (``access``)."""
    principal = principal_of(request)
    if action not in access.ACTION_ROLES or access.may(principal, action):
        return ""
    role = principal.role if principal else "nobody"
    return f"a {role} may not {action}: it needs the {access.role_for(action)} role"


def _reset_said(done: Any) -> str:
    removed = ", ".join(done.removed)
    taken = f"; {plural(done.signals, 'signal')} they had taken removed" if done.signals else ""
    woke = "; it runs again now" if done.woke else ""
    if done.status in ("failed", "cancelled"):
        woke = f"; it is {done.status}: retry it to run it again (a signal is refused until then)"
    return f"reset {done.key}: {plural(len(done.removed), 'step')} removed ({removed}){taken}{woke}"


def _keys(text: str) -> list[str]:
    try:
        keys = json.loads(text)
    except (ValueError, RecursionError):  # deep nesting: the C decoder recurses
        return []
    return (
        [k for k in keys if isinstance(k, str)][: bulk.MAX_PER_CALL]
        if isinstance(keys, list)
        else []
    )


@router.post("/ui/bulk")
async def bulk_action(request: Request) -> Response:
    """Retry, cancel or purge the list's filtered set: a count first, then on confirmation."""
    form = await form_of(request)
    client = client_of(request)
    action = form.get("action", "")
    next_url = form.get("next", "/ui/tasks")
    if action not in ("retry", "cancel", "purge"):
        return outcome(request, 422, next_url, problem=f"unknown action {action!r}")
    refused = _refused(request, action)
    if refused:
        return outcome(request, 403, next_url, problem=refused)
    status = form.get("status")
    keys = _keys(form["keys"]) if "keys" in form else None
    where = bulk.Filter(
        form.get("name") or None, [status] if status in STATUSES else None, keys=keys
    )
    confirmed = form.get("confirmed") == action
    result = await client.bulk(action, where, dry_run=not confirmed)  # type: ignore[arg-type]
    if not confirmed:
        return outcome(
            request,
            200,
            next_url,
            flash=f"{action} would apply to {result.matched} tasks: confirm below",
            confirm=action,
        )
    more = " (more match: run it again)" if result.truncated else ""
    said = f"{action}: {result.changed} of {result.matched} tasks{more}"
    return outcome(request, 200, next_url, flash=said)
