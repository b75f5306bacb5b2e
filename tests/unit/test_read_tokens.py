"""Read tokens and request rates, pure: a token verifies under its secret until it expires and
never under another; any change to it is refused; scopes cover what they say; buckets refill
at their rate (an injected clock)."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mtask.errors import InvalidTask
from mtask.security import read_tokens
from mtask.security.read_tokens import BadToken, Scope
from mtask.web.access import ROUTE_ACTIONS, action_of, role_for
from mtask.web.rates import Buckets

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
SECRET = b"0123456789abcdef"

scopes = st.one_of(
    st.builds(Scope, st.just("task"), key=st.text(min_size=1, max_size=40)),
    st.builds(Scope, st.just("tree"), key=st.text(min_size=1, max_size=40)),
    st.builds(
        Scope,
        st.just("group"),
        name=st.text(min_size=1, max_size=20),
        group=st.text(min_size=1, max_size=20),
    ),
)


@given(scopes, st.integers(1, read_tokens.MAX_TTL))
def test_a_token_verifies_until_it_expires_and_only_under_its_secret(
    scope: Scope, ttl: int
) -> None:
    token = read_tokens.sign(SECRET, scope, NOW + dt.timedelta(seconds=ttl))
    assert read_tokens.verify(SECRET, token, NOW) == scope
    with pytest.raises(BadToken, match="expired"):
        read_tokens.verify(SECRET, token, NOW + dt.timedelta(seconds=ttl))
    with pytest.raises(BadToken, match="signature"):
        read_tokens.verify(b"another secret!!", token, NOW)


@given(scopes, st.data())
def test_any_change_to_a_token_is_refused(scope: Scope, data: st.DataObject) -> None:
    token = read_tokens.sign(SECRET, scope, NOW + dt.timedelta(seconds=60))
    at = data.draw(st.integers(5, len(token) - 1))
    char = data.draw(st.sampled_from("AaZz09-_."))
    changed = token[:at] + char + token[at + 1 :]
    if changed != token:
        with pytest.raises(BadToken):
            read_tokens.verify(SECRET, changed, NOW)


def test_scopes_cover_what_they_name() -> None:
    doc = {"_id": "c", "name": "add", "options": {"group": "acme"}, "parent": "p"}
    assert Scope("task", key="c").covers(doc) and not Scope("task", key="p").covers(doc)
    assert Scope("tree", key="p").covers(doc)  # a next step names its parent
    assert Scope("tree", key="d").covers({**doc, "depends_on": ["d"]})
    assert Scope("group", name="add", group="acme").covers(doc)
    assert not Scope("group", name="add", group="zeta").covers(doc)
    assert not Scope("group", name="add", group="acme").covers({"_id": 1, "options": "x"})
    assert not Scope("task", key="c").covers(None)


def test_a_scope_is_asked_for_plainly() -> None:
    for bad in ({"key": "k", "name": "n"}, {"name": "n"}, {"children": True}, {"key": ""}):
        with pytest.raises(InvalidTask):
            read_tokens.scope_of(bad.get("key"), bad.get("name"), None, bad.get("children", False))  # type: ignore[arg-type]
    for ttl in (0, -1, True, "60", read_tokens.MAX_TTL + 1, float("nan")):
        with pytest.raises(InvalidTask):
            read_tokens.check_ttl(ttl)


def test_a_route_the_table_does_not_name_needs_an_admin() -> None:
    assert role_for(action_of("POST", "/something/new")) == "admin"
    assert role_for(action_of("GET", "/something/new")) == "viewer"
    for (method, path), action in ROUTE_ACTIONS.items():
        assert action_of(method, path) == action


def test_buckets_refill_at_their_rate() -> None:
    now = [0.0]
    buckets = Buckets(rate=2.0, burst=3, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(3)] == [0, 0, 0]
    assert buckets.take("a") == pytest.approx(0.5)
    assert buckets.take("b") == 0  # each caller its own
    now[0] += 0.5
    assert buckets.take("a") == 0
    assert buckets.take("a") > 0
    now[0] += 100
    assert [buckets.take("a") for _ in range(3)] == [0, 0, 0]  # never above the burst
    assert buckets.take("a") > 0


def test_the_access_log_never_holds_a_read_token() -> None:
    import logging

    from mtask.web.access import RedactTokens

    record = logging.LogRecord("uvicorn.access", 20, "", 0, '%s - "%s %s HTTP/%s" %d', None, None)
    record.args = (
        "127.0.0.1:5",
        "GET",
        "/tasks/k:stream?kind=chunk&token=mrt1.abc.def",
        "1.1",
        200,
    )
    RedactTokens().filter(record)
    assert "mrt1" not in record.getMessage() and "token=***" in record.getMessage()
