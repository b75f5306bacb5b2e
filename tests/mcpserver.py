"""A stdio MCP server (the MCP SDK's ``MCPServer``) for ``tests/agentapp.py``'s ``mcpbot``:
its tool ``note`` inserts ``{task, what: "mcp:note", run_id}`` into the test's database
(``agent_calls``, as every counted call there) and answers ``noted <n>``."""

from __future__ import annotations

from mcp.server.mcpserver import MCPServer
from pymongo import MongoClient

server = MCPServer("notes")


@server.tool()
def note(uri: str, db: str, task: str, run_id: str, n: int) -> str:
    """Note a call in ``db``'s ``agent_calls`` and say so."""
    client: MongoClient[dict[str, object]] = MongoClient(uri)
    try:
        row = {"task": task, "what": "mcp:note", "run_id": run_id}
        client[db]["agent_calls"].insert_one(row)
    finally:
        client.close()
    return f"noted {n}"


if __name__ == "__main__":
    server.run("stdio")
