"""The REST API: tasks, stats, workers, names, schedules, limits, health and metrics.

Every route but ``/healthz`` requires the bearer token (``mtask.web.auth``). Bad input is
refused with 422 naming the field, before anything is written: FastAPI checks the body's shape,
and mtask's own validation (``InvalidTask``) the rest. A missing task or schedule is 404, a
transition the task's state does not allow is 409, MongoDB out of reach 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import urllib.parse
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from mtask.client import MAX_DELAY_SECONDS, AsyncTaskClient
from mtask.errors import InvalidTask, TaskNotFound, WaitTimeout
from mtask.models import TaskKey, TaskName, TaskOptions, WorkerView
from mtask.store import bulk
from mtask.vocabulary import MAX_AGE_SECONDS, MAX_COST, MAX_TOKENS, validate_name
from mtask.web.access import authorize
from mtask.web.auth import bearer_scheme
from mtask.web.schemas import (
    AuditView,
    BatchView,
    BulkView,
    DerivedState,
    GroupView,
    LimitView,
    NameView,
    PausedView,
    PublishView,
    RemarkView,
    ResetView,
    ScheduleView,
    SignalView,
    StopView,
    TaskPage,
    TaskView,
)

MAX_BATCH = 10_000
Status = Literal["pending", "running", "succeeded", "failed", "cancelled", "invalid"]
"""The ``TaskStatus`` values, spelled out for the OpenAPI spec (a test keeps them in step)."""


class NewTaskBody(BaseModel):
    """A task to publish. ``options`` are ``TaskOptions`` (unknown ones are refused)."""

    model_config = ConfigDict(extra="forbid")

    name: TaskName = Field(description="the handler's name")
    key: TaskKey = Field(description="the task's key: publishing it again changes nothing")
    params: dict[str, Any] | None = None
    options: TaskOptions | None = None
    delay: float | None = Field(None, ge=0, le=MAX_DELAY_SECONDS, description="seconds")
    depends_on: list[TaskKey] | None = Field(None, max_length=1000)


class PublishBody(NewTaskBody):
    on_conflict: Literal["ignore", "update_params", "reset"] = "ignore"
    supersede: Literal["drop_newer", "cancel_queued", "cancel_running"] | None = Field(
        None,
        description="one open task of its name and group among those published "
        "with a policy (docs/publishing.md)",
    )
    debounce: float | None = Field(
        None, description="seconds of quiet before the key's one run (docs/publishing.md)"
    )
    debounce_max: float | None = Field(
        None, description="the run starts at most this long after the first publish"
    )


class SignalBody(BaseModel):
    """A signal for a task's ``ctx.wait_for(name)`` (docs/steps.md)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the signal's name", max_length=200)
    payload: Any = Field(None, description="any JSON value (at most 64 KiB as BSON)")


class ResetBody(BaseModel):
    """Which recorded step to reset the task's journal to (it and every later step go)."""

    model_config = ConfigDict(extra="forbid")

    step: str = Field(description="the step's name, as recorded (`wait:approved`, `charge`)")


class RetryBody(BaseModel):
    """Run the task again from a recorded step (the steps before it are kept)."""

    model_config = ConfigDict(extra="forbid")

    from_step: str | None = Field(None, description="the recorded step to run again from")


class RemarkBody(BaseModel):
    """A parked task's recorded step renamed ``to`` (or dropped, without ``to``)."""

    model_config = ConfigDict(extra="forbid")

    step: str = Field(description="the step's name, as recorded")
    to: str | None = Field(None, description="its new name; absent: the step is dropped")


class BatchBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tasks: list[NewTaskBody] = Field(max_length=MAX_BATCH)


class LimitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int | None = Field(None, ge=1, le=1_000_000)
    rate: float | None = Field(None, gt=0, le=1_000_000, description="claims per second")
    burst: int | None = Field(None, ge=1, le=1_000_000)
    group_concurrency: int | None = Field(
        None, ge=1, le=1_000_000, description="runs at once per group (1: a sequence)"
    )
    group_rate: float | None = Field(
        None, gt=0, le=1_000_000, description="claims per second per group"
    )
    group_burst: int | None = Field(None, ge=1, le=1_000_000)
    overflow: Literal["queue", "drop", "fail"] | None = Field(
        None, description="what a full limit does with a task it refuses (default: queue)"
    )


class ResourceLimitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int | None = Field(None, ge=1, le=1_000_000)
    rate: float | None = Field(None, gt=0, le=1_000_000, description="claims per second")
    burst: int | None = Field(None, ge=1, le=1_000_000)
    overflow: Literal["queue", "drop", "fail"] | None = Field(
        None, description="what a full limit does with a task it refuses (default: queue)"
    )
    names: list[str] | None = Field(
        None,
        max_length=1000,
        description="task names whose every run takes a slot of it, besides those whose "
        "handler declares uses= (replaces the list; absent: as it was)",
    )
    tokens_per: tuple[int, float] | None = Field(
        None,
        description="[tokens, seconds]: at most that many tokens charged (ctx.record_usage) in "
        "each window of that many seconds; a run takes the resource only while its window's "
        "count is below it",
    )


class GroupLimitBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int | None = Field(None, ge=1, le=1_000_000)
    rate: float | None = Field(None, gt=0, le=1_000_000, description="claims per second")
    burst: int | None = Field(None, ge=1, le=1_000_000)
    weight: float | None = Field(
        None, gt=0, le=1000, description="share of turns among the name's groups (default 1)"
    )


class BudgetBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: int | None = Field(None, ge=0, le=MAX_TOKENS, description="input + output tokens")
    cost: float | None = Field(None, ge=0, le=MAX_COST, description="in the prices' currency")
    period: Literal["hour", "day", "week", "month"] | float | None = Field(
        None, description="per period of the server's clock, in UTC, or seconds (none: ever)"
    )


class BulkBody(BaseModel):
    """Which tasks a bulk action applies to: every field given must match (none: all tasks the
    action applies to). The action narrows ``status`` itself: retry to failed/cancelled, cancel
    to pending/running, purge to finished statuses — a purge never deletes an open task."""

    model_config = ConfigDict(extra="forbid")

    name: TaskName | None = None
    status: list[Status] | None = Field(None, max_length=6)
    older_than: float | None = Field(
        None, ge=0, le=MAX_AGE_SECONDS, description="seconds since the task last changed"
    )
    keys: list[TaskKey] | None = Field(None, max_length=bulk.MAX_PER_CALL)
    dry_run: bool = Field(False, description="count what would change, change nothing")


class FlowNode(BaseModel):
    key: str
    name: str | None = None
    status: str | None = None
    children: list[FlowNode] = Field(default_factory=list)
    depends_on: list[str] | None = None
    waiting_on: list[str] | None = None


Responses = dict[int | str, dict[str, Any]]
MAX_WAIT_SECONDS = 600.0
NOT_FOUND: Responses = {404: {"description": "no such task (or schedule, or worker)"}}
CONFLICT: Responses = {409: {"description": "the task's state does not allow this"}}


def client_of(request: Request) -> AsyncTaskClient:
    client: AsyncTaskClient = request.app.state.client
    return client


Client = Annotated[AsyncTaskClient, Depends(client_of)]
router = APIRouter(dependencies=[Depends(authorize), Depends(bearer_scheme)])
public = APIRouter()


def view(task: Any) -> TaskView:
    return TaskView.of(task)


async def explained(client: AsyncTaskClient, task: Any) -> TaskView:
    """A task with its derived state and reason (the cluster read once)."""
    return TaskView.of(task, await client.explain(task))


@router.post(
    "/tasks", status_code=201, responses={200: {"description": "it existed", "model": PublishView}}
)
async def publish(body: PublishBody, client: Client, response: Response) -> PublishView:
    """Publish a task: 201 when created, 200 when the key existed (idempotent)."""
    result = await client.publish(
        body.name,
        body.key,
        body.params,
        options=body.options,
        delay=body.delay,
        on_conflict=body.on_conflict,
        depends_on=body.depends_on,
        supersede=body.supersede,
        debounce=body.debounce,
        debounce_max=body.debounce_max,
    )
    if not result.created:
        response.status_code = 200
    return PublishView(
        created=result.created,
        updated=result.updated,
        task=view(result.task),
        superseded=result.superseded,
        dropped=result.dropped,
    )


@router.post("/tasks:batch")
async def publish_batch(body: BatchBody, client: Client) -> BatchView:
    """Publish many tasks (insert if absent); returns how many were created."""
    created = await client.publish_many(t.model_dump(exclude_none=True) for t in body.tasks)
    return BatchView(created=created, given=len(body.tasks))


async def _bulk(action: bulk.Action, body: BulkBody, client: AsyncTaskClient) -> BulkView:
    where = bulk.Filter(body.name, body.status, body.older_than, body.keys)
    result = await client.bulk(action, where, dry_run=body.dry_run)
    return BulkView(**dataclasses.asdict(result))


@router.post("/tasks:retry")
async def retry_many(body: BulkBody, client: Client) -> BulkView:
    """Retry the failed or cancelled tasks the filter matches (at most 1000 per call)."""
    return await _bulk("retry", body, client)


@router.post("/tasks:cancel")
async def cancel_many(body: BulkBody, client: Client) -> BulkView:
    """Cancel the pending or running tasks the filter matches (at most 1000 per call)."""
    return await _bulk("cancel", body, client)


@router.post("/tasks:purge")
async def purge_many(body: BulkBody, client: Client) -> BulkView:
    """Delete the finished tasks the filter matches (never a pending or running one)."""
    return await _bulk("purge", body, client)


@router.get("/tasks")
async def list_tasks(
    client: Client,
    name: Annotated[str | None, Query(max_length=200)] = None,
    status: Status | None = None,
    prefix: Annotated[str | None, Query(max_length=512, description="key prefix")] = None,
    q: Annotated[str | None, Query(max_length=200, description="words of the error")] = None,
    group: Annotated[
        str | None, Query(min_length=1, max_length=200, description="options.group")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    after: str | None = Query(None, description="the last key of the previous page"),
    state: Annotated[
        DerivedState | None,
        Query(description="only tasks in this derived state (docs/web.md); not with `status`"),
    ] = None,
    parent: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=1024,
            description="only the tasks this one made (spawned children, next steps), oldest first",
        ),
    ] = None,
) -> TaskPage:
    """A page of tasks, newest first (keyset pagination: pass ``next_after`` as ``after``;
    below a ``parent``, oldest first), each with its derived state. With ``state``, the tasks
    are read a page at a time and explained until ``limit`` match or ten pages were read: a
    page may hold fewer, and ``next_after`` goes on."""
    if state is not None:
        if status is not None:
            raise InvalidTask("give status or state, not both", field="state")
        found = await client.search_state(
            state,
            name=name,
            prefix=prefix,
            text=q,
            limit=limit,
            after=after,
            group=group,
            parent=parent,
        )
        return TaskPage(
            tasks=[TaskView.of(t, said) for t, said in found.tasks], next_after=found.after
        )
    tasks = await client.search(
        name=name,
        status=status,
        prefix=prefix,
        text=q,
        limit=limit,
        after=after,
        group=group,
        parent=parent,
    )
    states = await client.explain_all(tasks)
    return TaskPage(
        tasks=[TaskView.of(t, said) for t, said in zip(tasks, states, strict=True)],
        next_after=tasks[-1].key if len(tasks) == limit else None,
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None  # a hand-made document may hold anything


def _flow_node(node: dict[str, Any]) -> FlowNode:
    text = _text
    return FlowNode(
        key=str(node.get("key")),
        name=text(node.get("name")),
        status=text(node.get("status")),
        children=[_flow_node(c) for c in node.get("children", [])],
        depends_on=[str(k) for k in node["depends_on"]] if node.get("depends_on") else None,
        waiting_on=[str(k) for k in node["waiting_on"]] if "waiting_on" in node else None,
    )


@router.post("/tasks/{key:path}:cancel", responses={**NOT_FOUND, **CONFLICT})
async def cancel(key: str, client: Client) -> TaskView:
    """Cancel one task (``key`` percent-encoded; the action is always the last ``:verb``)."""
    return await explained(client, await client.cancel(key))


@router.post("/tasks/{key:path}:retry", responses={**NOT_FOUND, **CONFLICT})
async def retry(key: str, client: Client, body: RetryBody | None = None) -> TaskView:
    """Retry one failed or cancelled task; with ``{"from_step": NAME}``, its durable steps
    before NAME are kept and replayed, NAME and the later ones run again (422 no such step)."""
    from_step = body.from_step if body is not None else None
    return await explained(client, await client.retry(key, from_step=from_step))


@router.post(
    "/tasks/{key:path}:remark",
    responses={**NOT_FOUND, **CONFLICT, 422: {"description": "no such step, or a bad name"}},
)
async def remark_step(key: str, body: RemarkBody, client: Client) -> RemarkView:
    """Rename a parked task's recorded step ``step`` ``to`` a new name, or drop it (no
    ``to``), so that changed handlers replay its journal (docs/steps.md). One update, fenced
    like a reset: 409 while a run of the task is RUNNING, once it succeeded, for a name
    another step has, or a spawn whose children are awaited; 404 no such task."""
    if body.to is None:
        done = await client.drop_step(key, body.step)
    else:
        done = await client.rename_step(key, body.step, body.to)
    return RemarkView(key=done.key, step=done.step, to=done.to, index=done.index, woke=done.woke)


@router.post(
    "/tasks/{key:path}:reset",
    responses={**NOT_FOUND, **CONFLICT, 422: {"description": "no such step"}},
)
async def reset_step(key: str, body: ResetBody, client: Client) -> ResetView:
    """Reset a task's durable steps to before step ``step``: it and every later step are
    removed, and the next run calls them again; a removed wait's signal is removed with it, so
    the wait takes the next one (docs/steps.md). One update, fenced: 409 while a run of the
    task is RUNNING (or once it succeeded), 404 no such task, 422 no such step."""
    done = await client.reset_step(key, body.step)
    return ResetView(
        key=done.key, step=done.step, removed=done.removed, signals=done.signals, woke=done.woke
    )


@router.post("/tasks/{key:path}:signal", responses={**NOT_FOUND, **CONFLICT})
async def signal(key: str, body: SignalBody, client: Client) -> SignalView:
    """Send a signal to an open task: its handler's ``ctx.wait_for(name)`` returns the payload,
    whether the wait began before or after. ``woke``: it was waiting for this signal and runs
    again now. 404 no such task; 409 a finished task, or one holding 1,000 signals."""
    woke = await client.signal(key, body.name, body.payload)
    return SignalView(key=key, signal=body.name, woke=woke)


ACTIONS = ("cancel", "retry", "signal", "reset", "remark")
"""The actions ``POST /tasks/{key}:<action>`` takes."""


@router.post("/tasks/{key:path}", include_in_schema=False)
async def unknown_action(key: str) -> JSONResponse:
    """A POST to a task that names no action it takes: 404 naming them (not a bare 405)."""
    _, colon, action = key.rpartition(":")
    said = f"unknown action :{action}" if colon else "no action given"
    listed = ", ".join(f":{a}" for a in ACTIONS)
    detail = f"{said}: POST /tasks/KEY:ACTION takes {listed}"
    return JSONResponse({"detail": detail}, status_code=404)


@router.get("/tasks/{key:path}", responses=NOT_FOUND)
async def get_task(
    key: str,
    client: Client,
    view_: Annotated[
        Literal["task", "flow"],
        Query(alias="view", description="`flow`: the task's flow tree instead of the task"),
    ] = "task",
    wait: Annotated[
        float | None,
        Query(
            ge=0,
            le=MAX_WAIT_SECONDS,
            description="long poll: answer once the task is finished (succeeded, failed, "
            "cancelled or invalid), or as it is after this many seconds",
        ),
    ] = None,
) -> TaskView | FlowNode:
    """One task, or with ``?view=flow`` the flow below it (its next steps, recursively). With
    ``?wait=S``, the answer waits until the task is finished or ``S`` seconds have passed
    (one change stream per server process, shared by every waiting request)."""
    if wait is not None and view_ == "task":
        try:
            return await explained(client, await client.wait(key, timeout=wait))
        except WaitTimeout:
            pass  # answer with the task as it is now
    if view_ == "flow":
        tree = await client.flow(key)
        if tree is None:
            raise TaskNotFound(key)
        return _flow_node(tree)
    task = await client.get(key)
    if task is None:
        raise TaskNotFound(key)
    return await explained(client, task)


AT_LEAST_HEADER = "Mtask-Counts-At-Least"
NOT_SPLIT_HEADER = "Mtask-Pending-Not-Split"


@router.get(
    "/stats",
    responses={
        200: {
            "headers": {
                AT_LEAST_HEADER: {
                    "description": "the counts that are lower bounds (more than 1,000 "
                    "finished tasks), as URL-encoded `name/status` pairs separated by commas "
                    "(absent: every count is exact)",
                    "schema": {"type": "string"},
                },
                NOT_SPLIT_HEADER: {
                    "description": "with `by=state`: pending tasks whose state was not derived "
                    "(beyond the newest 1,000 of their name), as URL-encoded `name=count` "
                    "pairs separated by commas",
                    "schema": {"type": "string"},
                },
            }
        }
    },
)
async def stats(
    client: Client,
    response: Response,
    exact: Annotated[
        bool, Query(description="count every task (cost grows with the collection)")
    ] = False,
    by: Annotated[
        Literal["status", "state"],
        Query(
            description="`state` (the default): per derived state, as every reader says it "
            "(docs/web.md); the newest 1,000 pending tasks of each name are split, the rest "
            "named in the `Mtask-Pending-Not-Split` header. `status`: per stored status"
        ),
    ] = "state",
) -> dict[str, dict[str, int]]:
    """Task counts per name and derived state (``by=status``: per stored status). Open tasks are
    counted exactly; finished ones exactly up to 1,000 per name and status, and above that as
    1,001, a lower bound (named in the ``Mtask-Counts-At-Least`` header), unless ``exact``."""
    if by == "state":
        split = await client.state_counts(exact=exact)
        counts, at_least = split.counts, split.stored.at_least
        if split.unsplit:
            response.headers[NOT_SPLIT_HEADER] = ",".join(
                f"{urllib.parse.quote(name, safe='')}={n}"
                for name, n in sorted(split.unsplit.items())
            )
    else:
        found = await client.stats(exact=exact)
        counts, at_least = found, found.at_least
    if at_least:
        response.headers[AT_LEAST_HEADER] = ",".join(
            f"{urllib.parse.quote(name, safe='')}/{status}" for name, status in sorted(at_least)
        )
    return counts


@router.get("/workers")
async def workers(client: Client) -> list[WorkerView]:
    """Workers that sent a heartbeat in the last 10 seconds, with the runs they hold."""
    return await client.workers()  # type: ignore[return-value] # checked by the response model


@router.post("/workers/{worker_id}/stop", responses=NOT_FOUND)
async def stop_worker(worker_id: str, client: Client) -> StopView:
    if not await client.stop_worker(worker_id):
        return JSONResponse(  # type: ignore[return-value]
            {"detail": f"no worker {worker_id!r} is registered"}, status_code=404
        )
    return StopView(stop_requested=worker_id)


@router.post("/names/{name}/pause")
async def pause(name: str, client: Client) -> NameView:
    await client.pause(name)
    return NameView(name=name, paused=True)


@router.post("/names/{name}/resume")
async def resume(name: str, client: Client) -> NameView:
    await client.resume(name)
    return NameView(name=name, paused=False)


@router.get("/names")
async def names(client: Client) -> PausedView:
    """Paused task names."""
    paused = await client.paused()
    return PausedView(paused=sorted(paused))


@router.get("/schedules")
async def schedules(client: Client) -> list[ScheduleView]:
    return await client.schedules()  # type: ignore[return-value] # checked by the response model


@router.post("/schedules/{schedule_id}/pause", responses=NOT_FOUND)
async def pause_schedule(schedule_id: str, client: Client) -> ScheduleView:
    return await client.pause_schedule(schedule_id)  # type: ignore[return-value]


@router.post("/schedules/{schedule_id}/resume", responses=NOT_FOUND)
async def resume_schedule(schedule_id: str, client: Client) -> ScheduleView:
    return await client.resume_schedule(schedule_id)  # type: ignore[return-value]


@router.delete("/schedules/{schedule_id}", status_code=204, responses=NOT_FOUND)
async def remove_schedule(schedule_id: str, client: Client) -> Response:
    if not await client.remove_schedule(schedule_id):
        return JSONResponse({"detail": f"no schedule {schedule_id!r}"}, status_code=404)
    return Response(status_code=204)


@router.get("/groups")
async def groups(
    client: Client,
    name: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
    top: Annotated[int, Query(ge=1, le=100)] = 10,
) -> list[GroupView]:
    """The groups (``options.group``) with the most open tasks, largest first."""
    return await client.groups(name, top)  # type: ignore[return-value] # the response model


@router.get("/limits")
async def limits(
    client: Client,
    use: Annotated[
        bool,
        Query(
            description="add each limit's `use`: runs at once in use, sequences' locks held, "
            "and per group its tasks open, running, due and blocked and its head"
        ),
    ] = False,
) -> list[LimitView]:
    if not use:
        return await client.limits()  # type: ignore[return-value] # checked by the model
    return [
        {**u.limit, "use": limit_use(u)}  # type: ignore[misc]
        for u in await client.limit_use()
    ]


def limit_use(u: Any) -> dict[str, Any]:
    """A ``store.occupancy.NameUse`` as JSON (without its limit document)."""
    found = dataclasses.asdict(u)
    found.pop("limit")
    return found


@router.put("/limits/{name}")
async def set_limit(name: str, body: LimitBody, client: Client) -> LimitView:
    return await client.set_limit(  # type: ignore[return-value]
        name,
        concurrency=body.concurrency,
        rate=body.rate,
        burst=body.burst,
        group_concurrency=body.group_concurrency,
        group_rate=body.group_rate,
        group_burst=body.group_burst,
        overflow=body.overflow,
    )


@router.put("/limits/{name}/groups/{group}")
async def set_group_limit(name: str, group: str, body: GroupLimitBody, client: Client) -> LimitView:
    """One group's own limit and weight (a tier, a tenant), over the name's group limit."""
    return await client.set_group_limit(  # type: ignore[return-value]
        name,
        group,
        concurrency=body.concurrency,
        rate=body.rate,
        burst=body.burst,
        weight=body.weight,
    )


@router.delete("/limits/{name}/groups/{group}", status_code=204)
async def clear_group_limit(name: str, group: str, client: Client) -> Response:
    await client.clear_group_limit(name, group)
    return Response(status_code=204)


@router.put("/resources/{resource}")
async def set_resource_limit(resource: str, body: ResourceLimitBody, client: Client) -> LimitView:
    """A shared resource's limit (an API quota): every run of a name whose handler uses it, or
    that ``names`` lists, takes a slot of it, exactly across the cluster."""
    return await client.set_limit(  # type: ignore[return-value]
        resource=resource,
        concurrency=body.concurrency,
        rate=body.rate,
        burst=body.burst,
        overflow=body.overflow,
        names=body.names,
        tokens_per=body.tokens_per,
    )


@router.delete("/resources/{resource}", status_code=204)
async def clear_resource_limit(resource: str, client: Client) -> Response:
    await client.clear_limit(resource=resource)
    return Response(status_code=204)


@router.delete("/limits/{name}", status_code=204)
async def clear_limit(name: str, client: Client) -> Response:
    validate_name(name)
    await client.clear_limit(name)
    return Response(status_code=204)


@router.get("/usage")
async def usage(
    client: Client,
    name: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
    group: Annotated[str | None, Query(min_length=1, max_length=200)] = None,
) -> list[dict[str, Any]]:
    """What task names and groups spent (``ctx.record_usage``; all of them without ``name`` or
    ``group``): tokens, requests, ``cost_nanos`` (the cost in nano-units of the currency),
    and each one's budget and its current period's spending (``window``)."""
    return await client.usage(name, group)


@router.put("/budgets/{scope}/{scope_id}")
async def set_budget(
    scope: Literal["name", "group"], scope_id: str, body: BudgetBody, client: Client
) -> dict[str, Any]:
    """A task name's or a group's budget: past it, a step does not start (docs/usage.md)."""
    name, group = (scope_id, None) if scope == "name" else (None, scope_id)
    return await client.set_budget(
        name, group=group, tokens=body.tokens, cost=body.cost, period=body.period
    )


@router.delete("/budgets/{scope}/{scope_id}", status_code=204, responses=NOT_FOUND)
async def clear_budget(scope: Literal["name", "group"], scope_id: str, client: Client) -> Response:
    name, group = (scope_id, None) if scope == "name" else (None, scope_id)
    if not await client.clear_budget(name, group=group):
        return JSONResponse({"detail": f"no budget for {scope} {scope_id!r}"}, status_code=404)
    return Response(status_code=204)


@router.get("/audit")
async def audit(
    client: Client,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before: Annotated[str | None, Query(max_length=24, description="the last `id` seen")] = None,
) -> list[AuditView]:
    """The audit of actions, newest first: who (a token's name and role), what (`action`,
    `target`, `method`, `path`), when (`at`, the server's time), from where (`from`) and the
    answer's `status` (refused attempts too). Operators and admins only."""
    return await client.audit(limit, before)  # type: ignore[return-value] # the response model


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics() -> Response:
    """Prometheus text format (queue depth is one aggregation, cached a few seconds)."""
    body = await asyncio.to_thread(generate_latest)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@public.get("/healthz", responses={503: {"description": "MongoDB unreachable or not primary"}})
async def healthz(client: Client) -> JSONResponse:
    """MongoDB reachable and primary (no token needed)."""
    try:
        hello = await asyncio.wait_for(client.db.command("hello"), timeout=5)
    except Exception as exc:  # noqa: BLE001 - any failure is unhealthy, said in one line
        return JSONResponse({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}, 503)
    primary = bool(hello.get("isWritablePrimary"))
    now = hello.get("localTime")
    body = {
        "ok": primary,
        "primary": primary,
        "set": hello.get("setName"),
        "server_time": (now if now.tzinfo else now.replace(tzinfo=dt.UTC)).isoformat()
        if isinstance(now, dt.datetime)
        else None,
    }
    return JSONResponse(body, status_code=200 if primary else 503)
