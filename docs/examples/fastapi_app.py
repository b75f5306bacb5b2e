"""A FastAPI application with mtask: its lifespan opens the client and an in-process worker,
a route publishes through the dependency, and mtask's dashboard and REST API sit under
``/mtask`` behind the application's own auth. Run as a script it calls itself through httpx
(with ``MTASK_MONGODB_URI`` set); ``uvicorn fastapi_app:app`` serves it."""

import asyncio
import os
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request

from mtask import AsyncTaskClient, Registry
from mtask.contrib.fastapi import Mtask

registry = Registry()


@registry.task("ship")
async def ship(params: dict[str, Any]) -> str:
    return f"shipped {params['order']}"


def staff_only(request: Request) -> None:
    """Your application's auth: a session, OAuth2, … (a header here)."""
    if request.headers.get("x-user") != "alice":
        raise HTTPException(401, "sign in first")
    request.state.mtask_user = "alice"  # the name mtask's audit records


tasks = Mtask(database=os.environ.get("EXAMPLE_DATABASE", "shop"), worker=registry)
app = FastAPI(lifespan=tasks.lifespan)
app.include_router(tasks.router(dependencies=[Depends(staff_only)]), prefix="/mtask")
Client = Annotated[AsyncTaskClient, Depends(tasks.client)]


@app.post("/orders/{order}")
async def place(order: str, client: Client) -> dict[str, Any]:
    published = await client.publish("ship", f"ship-{order}", {"order": order})
    return {"task": published.task.key}


async def main() -> None:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as http:
            print((await http.post("/orders/o-17")).json())
            done = await tasks.client().wait("ship-o-17", timeout=60)
            print(done.status, done.result)
            print((await http.get("/mtask/ui/tasks")).status_code)  # 401: not signed in
            print((await http.get("/mtask/ui/tasks", headers={"x-user": "alice"})).status_code)


if __name__ == "__main__":
    asyncio.run(main())
