"""``mtask.contrib.fastapi``: a FastAPI application under httpx with its lifespan: a route
publishes through the client dependency, an in-process worker runs the task, and mtask's
dashboard and REST API under the router's prefix answer only the application's own auth."""

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any

import httpx2 as httpx
from fastapi import Depends, FastAPI, HTTPException, Request

from mtask import AsyncTaskClient, Registry
from mtask.contrib.fastapi import Mtask

registry = Registry()


@registry.task("ship")
async def ship(params: dict[str, Any]) -> str:
    return f"shipped {params['order']}"


def staff_only(request: Request) -> None:
    """The application's own auth (here a header; a session or OAuth2 in real life)."""
    user = request.headers.get("x-user")
    if user != "alice":
        raise HTTPException(401, "sign in first")
    request.state.mtask_user = user


def make_app(uri: str, database: str) -> tuple[FastAPI, Mtask]:
    tasks = Mtask(uri, database=database, worker=registry, worker_options={"concurrency": 2})
    app = FastAPI(lifespan=tasks.lifespan)
    app.include_router(tasks.router(dependencies=[Depends(staff_only)]), prefix="/mtask")

    @app.post("/orders/{order}")
    async def place(
        order: str, client: Annotated[AsyncTaskClient, Depends(tasks.client)]
    ) -> dict[str, Any]:
        published = await client.publish("ship", f"ship-{order}", {"order": order})
        return {"key": published.task.key, "created": published.created}

    return app, tasks


@contextlib.asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as http:
            yield http


async def test_publish_from_a_route_and_the_guarded_dashboard(mongo_uri: str, db_name: str) -> None:
    app, tasks = make_app(mongo_uri, db_name)
    alice = {"x-user": "alice"}
    async with serving(app) as http:
        placed = await http.post("/orders/o-17")
        assert placed.status_code == 200 and placed.json() == {"key": "ship-o-17", "created": True}
        client = tasks.client()
        done = await client.wait("ship-o-17", timeout=60)  # the lifespan's worker ran it
        assert done.status == "succeeded" and done.result == "shipped o-17"

        # refused without the application's auth: pages, the API, SSE
        for path in ("/mtask/", "/mtask/ui/tasks", "/mtask/tasks/ship-o-17", "/mtask/events"):
            refused = await http.get(path)
            assert refused.status_code == 401 and refused.json() == {"detail": "sign in first"}
        assert (await http.post("/mtask/tasks/ship-o-17:cancel")).status_code == 401

        # with it: the dashboard under the prefix, its links under the prefix too
        page = await http.get("/mtask/ui/tasks", headers=alice)
        assert page.status_code == 200 and "ship-o-17" in page.text
        assert 'href="/mtask/ui/tasks/ship-o-17"' in page.text
        assert 'href="/ui/' not in page.text and 'src="/static' not in page.text
        style = await http.get("/mtask/static/style.css", headers=alice)
        assert style.status_code == 200
        task = await http.get("/mtask/tasks/ship-o-17", headers=alice)
        assert task.status_code == 200 and task.json()["status"] == "succeeded"
        # an action, recorded under the application's user
        await client.publish("ship", "later", {"order": "o-18"}, delay=3600)
        cancelled = await http.post(
            "/mtask/tasks/later:cancel", headers={**alice, "origin": "http://shop.test"}
        )
        assert cancelled.status_code == 200, cancelled.text
        assert (await client.get("later")).status == "cancelled"
        # a form's answer goes back under the prefix: the triggers page's and the default next
        same_site = {**alice, "origin": "http://shop.test"}
        for path, form in (
            ("/mtask/ui/triggers", {"action": "explode", "target": "trigger:none"}),
            ("/mtask/ui/act", {"action": "cancel", "target": "no-such-task"}),
        ):
            answer = await http.post(path, data=form, headers=same_site)
            assert answer.status_code == 303, (path, answer.text)
            where = answer.headers["location"]
            assert where.startswith("/mtask/") and "problem=" in where, (path, where)
        audit = await http.get("/mtask/audit", headers=alice)
        assert audit.status_code == 200
        assert [r["who"] for r in audit.json()][:1] == ["alice"]
    assert tasks.worker is None  # stopped and closed with the application
