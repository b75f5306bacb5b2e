"""``mtask serve``: the REST API, the dashboard and ``/metrics`` over HTTP (the ``server``
extra: FastAPI, uvicorn, Jinja2)."""

from __future__ import annotations

import argparse
import os
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
    from mtask.web.auth import (
        TOKENS_ENV,
        AuthConfigError,
        check_bind,
        load_read_secret,
        load_token,
        load_tokens,
    )

    try:
        token = load_token(args.token_file)
        tokens_file = args.tokens_file or os.environ.get(TOKENS_ENV)
        tokens = load_tokens(tokens_file) if tokens_file else {}
        check_bind(args.host, token or next(iter(tokens), None))
        read_secret = load_read_secret(args.read_token_secret_file)
    except AuthConfigError as exc:
        raise UsageError(str(exc)) from None
    if args.rate_limit is not None and not 0 < args.rate_limit <= 1_000_000:
        raise UsageError("--rate-limit must be a number of requests a second above 0")
    app = create_app(
        mongodb_uri(args.uri, "mtask serve"),
        database=args.database,
        collection=args.collection,
        token=token,
        max_body=args.max_body,
        trust_proxy=args.trust_proxy,
        tokens=tokens,
        read_secret=read_secret,
        cors_origins=args.cors_origin or (),
        rate=None if args.rate_limit is None else (args.rate_limit, args.rate_burst),
    )
    auth = "bearer token required" if token or tokens else "no token (loopback only)"
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
        help="believe X-Forwarded-Proto/-Host/-For (only behind a proxy that sets them)",
    )
    p.add_argument(
        "--tokens-file",
        help="tokens with roles: one 'ROLE NAME TOKEN' a line, ROLE viewer, operator or admin "
        "(else $MTASK_API_TOKENS_FILE); $MTASK_API_TOKEN is an admin's",
    )
    p.add_argument(
        "--read-token-secret-file",
        help="the secret read tokens are checked with (else $MTASK_READ_TOKEN_SECRET; neither: "
        "read tokens are refused); rotate it to revoke them all",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        metavar="ORIGIN",
        help="a browser app's origin (https://app.example.com) that may read with tokens; "
        "repeat for more",
    )
    p.add_argument(
        "--rate-limit",
        type=float,
        metavar="PER_SECOND",
        help="requests a second per caller (token, read token or address); more get 429 with "
        "Retry-After (default: no limit)",
    )
    p.add_argument(
        "--rate-burst", type=int, default=20, help="requests at once past the rate (default 20)"
    )
