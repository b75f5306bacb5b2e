"""``mtask serve``: the REST API, the dashboard and ``/metrics`` over HTTP (the ``server``
extra: FastAPI, uvicorn, Jinja2)."""

from __future__ import annotations

import argparse
from typing import Any

from mtask.cli.common import Commands, add_connection, err, mongodb_uri, require

commands = Commands()
run = commands.run


@commands.command("serve")
def cmd_serve(args: argparse.Namespace) -> int:
    require("mtask serve", "fastapi", "uvicorn", "jinja2", "fastapi_offline")
    import uvicorn

    from mtask.errors import UsageError
    from mtask.web import create_app
    from mtask.web.auth import AuthConfigError, check_bind, load_token

    try:
        token = load_token(args.token_file)
        check_bind(args.host, token)
    except AuthConfigError as exc:
        raise UsageError(str(exc)) from None
    app = create_app(
        mongodb_uri(args.uri, "mtask serve"),
        database=args.database,
        collection=args.collection,
        token=token,
        max_body=args.max_body,
        trust_proxy=args.trust_proxy,
    )
    auth = "bearer token required" if token else "no token (loopback only)"
    err.print(f"mtask serve: http://{args.host}:{args.port}/ ({auth})", markup=False)
    # The proxy headers are read by the app only with --trust-proxy (not by uvicorn's default).
    # asyncio's own loop: uvicorn's "auto" would take uvloop (a dependency, for the worker),
    # under which the server's event streams left sockets for the collector to close
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        proxy_headers=False,
        loop="asyncio",
    )
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("serve", help="the REST API, dashboard and metrics over HTTP")
    add_connection(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (any other than loopback needs a token)",
    )
    p.add_argument("--port", type=int, default=8080, help="the port to listen on")
    p.add_argument("--token-file", help="a file holding the API token (else $MTASK_API_TOKEN)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's log level",
    )
    p.add_argument(
        "--max-body",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body in bytes (default 8 MiB); larger ones get 413 unread",
    )
    p.add_argument(
        "--trust-proxy",
        action="store_true",
        help="believe X-Forwarded-Proto/-Host (only behind a proxy that sets them)",
    )
