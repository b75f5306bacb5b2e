"""``mtask serve`` tried as an attacker would, against a real ``mtask serve`` process: CSRF on
cookie-authorised requests and on the sign-in form, bodies refused before they are read (the
server's RSS, read from /proc, barely moves), deep nesting, keys that look like routes, and
malformed bearer headers."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mtask import TaskClient
from mtask.embedded import free_port
from mtask.errors import InvalidTask

TOKEN = "sec-token-1234"
MTASK = Path(sys.executable).parent / "mtask"


@dataclass
class Server:
    port: int
    pid: int

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(
        self, method: str, path: str, body: bytes | None = None, **headers: str
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(
                method,
                path,
                body=body,
                headers={k.replace("_", "-"): v for k, v in headers.items()},
            )
            response = conn.getresponse()
            got = {k.lower(): v for k, v in response.getheaders()}
            got["set-cookie"] = " || ".join(response.msg.get_all("set-cookie") or [])
            return response.status, got, response.read()
        finally:
            conn.close()

    def rss_kb(self) -> int:
        status = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        assert match
        return int(match.group(1))


@contextlib.contextmanager
def mtask_serve(uri: str, db: str, *extra: str) -> Iterator[Server]:
    port = free_port()
    env = {**os.environ, "MTASK_API_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [
            str(MTASK),
            "serve",
            "--uri",
            uri,
            "--database",
            db,
            "--port",
            str(port),
            "--log-level",
            "warning",
            *extra,
        ],
        env=env,
    )
    server = Server(port, proc.pid)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "mtask serve exited"
            with contextlib.suppress(OSError):
                if server.request("GET", "/healthz")[0] == 200:
                    break
            assert time.monotonic() < deadline, "mtask serve did not start"
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def server(mongo_uri: str, db_name: str) -> Iterator[Server]:
    with mtask_serve(mongo_uri, db_name, "--max-body", str(2 * 1024 * 1024)) as s:
        yield s


def set_cookies(headers: dict[str, str]) -> dict[str, str]:
    # http.client joins several Set-Cookie headers with ", "
    found = re.findall(r"(mtask_\w+)=([^;]*)", headers.get("set-cookie", ""))
    return dict(found)


def sign_in(server: Server) -> tuple[str, str]:
    """The session cookie and its CSRF token, as a browser gets them."""
    status, headers, page = server.request("GET", "/login")
    nonce = set_cookies(headers)["mtask_login"]
    csrf = re.search(rb'name="csrf" value="([^"]+)"', page)
    assert csrf
    form = urllib.parse.urlencode({"token": TOKEN, "csrf": csrf.group(1).decode()}).encode()
    status, headers, _ = server.request(
        "POST",
        "/login",
        form,
        Content_Type="application/x-www-form-urlencoded",
        Origin=server.origin,
        Cookie=f"mtask_login={nonce}",
    )
    assert status == 303, status
    session = set_cookies(headers)["mtask_session"]
    assert TOKEN not in session and "HttpOnly" in headers["set-cookie"]
    assert "SameSite=strict" in headers["set-cookie"] or "SameSite=Strict" in headers["set-cookie"]
    status, _, page = server.request("GET", "/", Cookie=f"mtask_session={session}")
    token = re.search(rb'name="csrf-token" content="([^"]+)"', page)
    assert status == 200 and token
    return session, token.group(1).decode()


def test_cookie_requests_need_our_origin_and_the_csrf_token(
    server: Server, client: TaskClient
) -> None:
    client.publish("n", "victim")
    session, csrf = sign_in(server)
    cookie = f"mtask_session={session}"
    for headers in [
        {"Origin": "http://evil.example"},
        {"Origin": "http://127.0.0.1:1"},  # another port of the same host
        {"Origin": "http://evil.example", "X_CSRF_Token": csrf},
        {"Origin": server.origin},  # no CSRF token
        {"Origin": server.origin, "X_CSRF_Token": "0" * 64},
        {},  # neither Origin nor Referer
    ]:
        for path in [
            "/tasks/victim:cancel",
            "/names/n/pause",
            "/tasks:cancel",
            "/tasks/victim:reset",
        ]:
            status, _, _ = server.request(
                "POST", path, b"{}", Cookie=cookie, Content_Type="application/json", **headers
            )
            assert status == 403, (path, headers, status)
    task = client.get("victim")
    assert task is not None and task.status == "pending" and client.paused() == set()
    # a cross-site form post with a guessed form field is refused too
    form = urllib.parse.urlencode({"csrf": csrf}).encode()
    status, _, _ = server.request(
        "POST",
        "/tasks/victim:cancel",
        form,
        Cookie=cookie,
        Origin="http://evil.example",
        Content_Type="application/x-www-form-urlencoded",
    )
    assert status == 403
    # the dashboard's own request: same origin and the session's token
    status, _, body = server.request(
        "POST", "/tasks/victim:cancel", Cookie=cookie, Origin=server.origin, X_CSRF_Token=csrf
    )
    assert status == 200 and json.loads(body)["status"] == "cancelled"
    # Referer stands in for a missing Origin
    status, _, _ = server.request(
        "POST",
        "/tasks/victim:retry",
        Cookie=cookie,
        Referer=server.origin + "/ui/tasks",
        X_CSRF_Token=csrf,
    )
    assert status == 200
    # bearer calls need neither (no browser sends a bearer header cross-site)
    status, _, _ = server.request("POST", "/tasks/victim:cancel", Authorization=f"Bearer {TOKEN}")
    assert status == 200
    # a forged or expired session is no session
    # (its signature is hex: a last pair already "00" made the first "forgery" the session
    # itself, one run in 256)
    forged = session[:-2] + ("00" if session[-2:] != "00" else "11")
    for bad in [forged, "x.1.abc", session.replace(".", ".9", 1)]:
        assert server.request("GET", "/stats", Cookie=f"mtask_session={bad}")[0] == 401
    # a dashboard form without a session goes to the sign-in page, unread and unchanged
    for path in ("/ui/act", "/ui/signal"):
        status, headers, _ = server.request("POST", path, b"action=cancel&target=victim&name=go")
        assert status == 303 and headers["location"].startswith("/login")
    # logout ends the cookie
    status, headers, _ = server.request(
        "POST", "/logout", Cookie=cookie, Origin=server.origin, X_CSRF_Token=csrf
    )
    assert status == 303 and 'mtask_session=""' in headers["set-cookie"]


def test_the_signal_form_refuses_bad_input_and_sends_nothing(
    server: Server, client: TaskClient
) -> None:
    """The task page's signal form (``POST /ui/signal``), signed in with its CSRF token: a
    payload that is not JSON or nested too deeply, a bad name, an unknown or a finished task
    each come back to the page with the problem named, and nothing is written."""
    session, csrf = sign_in(server)
    client.publish("anything", "open-task")
    client.publish("anything", "done-task")
    client.cancel("done-task")

    def send(target: str, name: str, payload: str) -> str:
        form = {"csrf": csrf, "target": target, "name": name, "payload": payload, "next": "/"}
        status, headers, _ = server.request(
            "POST",
            "/ui/signal",
            urllib.parse.urlencode(form).encode(),
            Cookie=f"mtask_session={session}",
            Origin=server.origin,
            Content_Type="application/x-www-form-urlencoded",
        )
        assert status == 303, status
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(headers["location"]).query)
        return (query.get("problem") or query.get("flash") or [""])[0]

    assert send("open-task", "go", "{oops").startswith("signal not sent: the payload is not JSON")
    deep = send("open-task", "go", "[" * 200_000 + "]" * 200_000)
    assert deep == "signal not sent: the payload is not JSON (nested too deeply)"
    assert send("open-task", "", "1").startswith("signal not sent: ")
    assert send("no-such-task", "go", "1").startswith("signal not sent: ")
    assert send("done-task", "go", "1").startswith("signal not sent: ")
    for key in ("open-task", "done-task"):
        doc = client.collection.find_one({"_id": key})
        assert doc is not None and not doc.get("signals"), doc
    ok = send("open-task", "go", '{"n": 1}')
    assert ok == "signal 'go' sent to open-task: kept for the task's next wait for it"
    doc = client.collection.find_one({"_id": "open-task"})
    assert doc is not None and [(g["name"], g["payload"]) for g in doc["signals"]] == [
        ("go", {"n": 1})
    ]


def test_login_csrf_is_refused(server: Server) -> None:
    status, headers, page = server.request("GET", "/login")
    nonce = set_cookies(headers)["mtask_login"]
    match = re.search(rb'name="csrf" value="([^"]+)"', page)
    assert match
    csrf = match.group(1).decode()
    other_nonce = set_cookies(server.request("GET", "/login")[1])["mtask_login"]

    def post(fields: dict[str, str], **headers: str) -> tuple[int, dict[str, str]]:
        body = urllib.parse.urlencode(fields).encode()
        status, got, _ = server.request(
            "POST", "/login", body, Content_Type="application/x-www-form-urlencoded", **headers
        )
        return status, got

    good = {"token": TOKEN, "csrf": csrf}
    assert post(good, Origin="http://evil.example", Cookie=f"mtask_login={nonce}")[0] == 403
    assert post(good, Cookie=f"mtask_login={nonce}")[0] == 403  # no Origin, no Referer
    assert post({"token": TOKEN}, Origin=server.origin, Cookie=f"mtask_login={nonce}")[0] == 403
    assert post(good, Origin=server.origin)[0] == 403  # no pre-session cookie
    assert post(good, Origin=server.origin, Cookie=f"mtask_login={other_nonce}")[0] == 403
    status, headers = post(good, Origin=server.origin, Cookie=f"mtask_login={nonce}")
    assert status == 303 and "mtask_session=" in headers["set-cookie"]


def send_huge(
    server: Server, path: str, size: int, headers: str, chunked: bool, send: bool = True
) -> str:
    """Send ``size`` bytes of body (or as much as the server takes before it closes; none if not
    ``send``); what the server answered, or "closed" when the answer was lost to the reset of a
    connection closed with our bytes unread."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\n{headers}{framing}\r\n\r\n".encode()
    )
    piece = b"[" * (1 << 20)
    sent = 0
    with contextlib.suppress(OSError):
        while send and sent < size:
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            sent += len(piece)
    with contextlib.suppress(OSError):
        answer = ""
        while chunk := sock.recv(65536):
            answer += chunk.decode(errors="replace")
        sock.close()
        return answer
    sock.close()
    return "closed"


def test_big_bodies_are_refused_unread(server: Server) -> None:
    server.request("GET", "/healthz")
    before = server.rss_kb()
    size = 50 * 1024 * 1024
    # unauthenticated, declared and undeclared length: 401 before a byte of the body is read
    assert " 401 " in send_huge(server, "/tasks", size, "", chunked=False, send=False)
    for chunked in (False, True):
        answer = send_huge(server, "/tasks", size, "", chunked=chunked)
        assert " 401 " in answer or answer == "closed"
    # authenticated: the declared length is over the limit, so 413 naming it, unread
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    answer = send_huge(server, "/tasks", size, auth, chunked=False)
    assert " 413 " in answer or answer == "closed"
    # authenticated, chunked: counted while it streams, refused past the limit
    answer = send_huge(server, "/tasks", size, auth, chunked=True)
    assert " 413 " in answer or answer == "closed"
    grown = server.rss_kb() - before
    assert grown < 8 * 1024, f"serve's RSS grew by {grown} kB"
    answer = send_huge(server, "/tasks", 3 * 1024 * 1024, auth, chunked=False, send=False)
    assert "413" in answer.split("\r\n")[0] and "the limit is 2097152" in answer


def nested(depth: int) -> dict[str, object]:
    value: dict[str, object] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_deep_nesting_is_422_and_writes_nothing(server: Server, client: TaskClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}", "Content_Type": "application/json"}
    for depth, expected in [
        (200, b"nested deeper than 80"),
        (70, b"nested more than 64 levels"),
        (5000, b"nested deeper than 80"),
    ]:
        params = '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)
        body = f'{{"name": "n", "key": "deep{depth}", "params": {params}}}'.encode()
        status, _, answer = server.request("POST", "/tasks", body, **auth)
        assert status == 422 and expected in answer, (depth, status, answer[:300])
        assert client.get(f"deep{depth}") is None
    batch = {"tasks": [{"name": "n", "key": "deepb", "params": nested(66)}]}
    status, _, answer = server.request("POST", "/tasks:batch", json.dumps(batch).encode(), **auth)
    assert status == 422 and b"64" in answer and client.get("deepb") is None
    with pytest.raises(InvalidTask, match="nested more than 64 levels"):
        client.publish("n", "deepc", nested(200))
    with pytest.raises(InvalidTask, match="nested more than 64 levels"):
        client.publish_many([{"name": "n", "key": "deepd", "params": {"x": [nested(70)]}}])
    assert client.get("deepc") is None and client.get("deepd") is None
    client.publish("n", "ok64", nested(64))  # the limit itself is fine, and MongoDB takes it


KEYS = [
    "x",
    "x/flow",
    "x/cancel",
    "x/retry",
    "flow",
    "a%2Fb",
    "a/b",
    "t:cancel",
    "t:retry:x",
    "sp ace",
    "q?s#h",
]


def test_every_key_is_readable_and_actionable(server: Server, client: TaskClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for key in KEYS:
        client.publish("n", key)
    for key in KEYS:
        for quoted in {urllib.parse.quote(key, safe=""), urllib.parse.quote(key, safe="/:")}:
            status, _, body = server.request("GET", f"/tasks/{quoted}", **auth)
            assert status == 200 and json.loads(body)["key"] == key, (key, quoted, body)
        status, _, body = server.request(
            "POST", f"/tasks/{urllib.parse.quote(key, safe='')}:cancel", **auth
        )
        assert status == 200 and json.loads(body)["key"] == key, (key, body)
        assert json.loads(body)["status"] == "cancelled"
        status, _, body = server.request(
            "POST", f"/tasks/{urllib.parse.quote(key, safe='/')}:retry", **auth
        )
        assert status == 200 and json.loads(body)["status"] == "pending", (key, body)
    status, _, body = server.request("GET", "/tasks/x?view=flow", **auth)
    assert json.loads(body)["key"] == "x"
    status, _, body = server.request("GET", "/tasks/x%2Fflow?view=flow", **auth)
    assert json.loads(body)["key"] == "x/flow"
    assert server.request("POST", "/tasks/x/cancel", **auth)[0] in (
        404,
        405,
    )  # the old route is gone


@pytest.mark.parametrize(
    "header",
    [
        f"Bearer  {TOKEN}",
        f"Bearer  {TOKEN} ",
        f"Bearer {TOKEN} x",
        f"Bearer\t{TOKEN}",
        f"Bearer {TOKEN}x",
        "Bearer",
        TOKEN,
        f"Basic {TOKEN}",
    ],
)
def test_malformed_bearer_headers_are_refused(server: Server, header: str) -> None:
    assert server.request("GET", "/stats", Authorization=header)[0] == 401
    assert server.request("GET", "/stats", Authorization=f"Bearer {TOKEN}")[0] == 200


def hostile(size: int) -> dict[str, bytes]:
    """Bodies of exactly ``size`` bytes crafted against the guard's checks."""
    half = size // 2
    return {
        'unclosed run of \\"': b'"' + b'\\"' * (half - 1) + b" ",
        'closed run of \\"': b'"' + b'\\"' * (half - 1) + b'"',
        "backslashes": b'"' + b"\\\\" * (half - 1) + b'"',
        "deep": b"[" * size,
        'quotes and brackets "[': b'"[' * half,
        "invalid UTF-8": b"\xff" * size,
    }


def hostile_forms(size: int) -> dict[str, bytes]:
    """Urlencoded bodies of about ``size`` bytes crafted against the CSRF field's search."""
    return {
        "ampersands": b"&" * size,
        "an escaped csrf": b"csrf=" + b"%41" * ((size - 5) // 3),
        "many empty csrf fields": b"csrf=&" * (size // 6),
    }


def client_error(status: int) -> bool:
    return 400 <= status < 500


@pytest.fixture
def full_server(mongo_uri: str, db_name: str) -> Iterator[Server]:
    """``mtask serve`` with its default body limit (8 MiB)."""
    with mtask_serve(mongo_uri, db_name) as s:
        yield s


LIMIT = 8 * 1024 * 1024
LOGIN = 16 * 1024
SECONDS = 30
"""The stated bound for any one crafted request (the socket's timeout): generous, since other
work shares the machine; the guard's own cost is measured in docs/web.md."""


def test_crafted_bodies_are_answered_with_4xx(full_server: Server, client: TaskClient) -> None:
    server = full_server
    for label, body in hostile(LOGIN).items():  # unauthenticated: the sign-in form's limit
        for kind in ["application/json", "application/x-www-form-urlencoded", ""]:
            typed = {"Content_Type": kind} if kind else {}
            status, _, answer = server.request(
                "POST",
                "/login",
                body,
                Origin=server.origin,
                **typed,
            )
            assert client_error(status), (label, kind, status, answer[:200])
    for label, body in hostile(LIMIT).items():  # authenticated, at the body limit
        status, _, answer = server.request(
            "POST",
            "/tasks",
            body,
            Authorization=f"Bearer {TOKEN}",
            Content_Type="application/json",
        )
        assert client_error(status), (label, status, answer[:200])
        if label == "deep":
            assert b"nested deeper than 80" in answer
    session, _ = sign_in(server)
    for label, body in hostile_forms(LIMIT).items():  # a session's form without its CSRF token
        for path in ("/ui/act", "/ui/signal"):
            status, _, answer = server.request(
                "POST",
                path,
                body,
                Cookie=f"mtask_session={session}",
                Origin=server.origin,
                Content_Type="application/x-www-form-urlencoded",
            )
            assert status == 403, (label, path, status, answer[:200])
    assert client.list() == []


def test_healthz_answers_under_16_crafted_requests(full_server: Server) -> None:
    server = full_server
    bodies = list(hostile(LIMIT).items())
    requests: list[tuple[str, bytes, dict[str, str]]] = []
    for n in range(16):
        if n % 4 == 3:  # unauthenticated sign-in forms
            label, body = bodies[n % len(bodies)]
            requests.append((label, hostile(LOGIN)[label], {"Content_Type": "application/json"}))
            continue
        label, body = bodies[n % len(bodies)]
        auth = {"Authorization": f"Bearer {TOKEN}", "Content_Type": "application/json"}
        requests.append((label, body, auth))
    answers: dict[int, int] = {}

    def attack(n: int) -> None:
        _, body, headers = requests[n]
        path = "/tasks" if "Authorization" in headers else "/login"
        headers = {**headers, "Origin": server.origin}
        answers[n] = server.request("POST", path, body, **headers)[0]

    threads = [threading.Thread(target=attack, args=(n,), daemon=True) for n in range(16)]
    for thread in threads:
        thread.start()
    polls = 0
    while any(thread.is_alive() for thread in threads) or polls < 3:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:  # a timeout here fails the test: /healthz must keep answering
            conn.request("GET", "/healthz")
            assert conn.getresponse().status == 200
        finally:
            conn.close()
        polls += 1
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=SECONDS)
    assert len(answers) == 16 and all(map(client_error, answers.values())), answers
