"""The guard's body checks against references: the streaming depth scan agrees with Python's own
JSON parser on generated JSON however the body is cut into pieces, and on crafted bodies (the
run of ``\\"`` that made the old regex quadratic among them); the CSRF form field agrees with
``parse_qs``. No timings: the scan's cost is stated and measured in docs/web.md."""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from mtask.web.guard import PIECE, DepthScan, form_field, is_json, json_depth

TEXT = st.text(alphabet=st.sampled_from('"\\[]{}ab,:\n\x00é'), max_size=12)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=40,
)


def depth_of(value: Any) -> int:
    """The reference: nesting of a parsed value."""
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


def scan_in_pieces(body: bytes, cuts: list[int]) -> int:
    scan = DepthScan()
    at = 0
    for cut in sorted(c % (len(body) + 1) for c in cuts):
        scan.feed(body[at:cut])
        at = cut
    scan.feed(body[at:])
    return scan.deepest


@settings(max_examples=400, deadline=None)
@given(value=JSON, cuts=st.lists(st.integers(min_value=0), max_size=8), indent=st.booleans())
def test_depth_agrees_with_the_parser_however_the_body_is_cut(
    value: Any, cuts: list[int], indent: bool
) -> None:
    body = json.dumps(value, indent=1 if indent else None, ensure_ascii=False).encode()
    expected = depth_of(json.loads(body))
    assert json_depth(body) == expected
    assert scan_in_pieces(body, cuts) == expected
    for limit in (0, 1, 3):
        assert (json_depth(body, stop_above=limit) > limit) == (expected > limit)


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200), cuts=st.lists(st.integers(min_value=0), max_size=8))
def test_any_bytes_scan_the_same_in_pieces(body: bytes, cuts: list[int]) -> None:
    """Invalid bodies too: where the pieces are cut never changes the answer."""
    assert scan_in_pieces(body, cuts) == json_depth(body)


def nested(depth: int, inner: str = "1") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


def test_crafted_bodies() -> None:
    run = 4 * PIECE  # several pieces, so every carry across a boundary is exercised
    cases: list[tuple[bytes, int]] = [
        (b'"' + b'\\"' * run, 0),  # the quadratic case of the old regex (an unclosed string)
        (b'\\"' * run, 0),
        (b'["' + b'\\"' * run + b'"]', 1),
        (b'["' + b"\\\\" * run + b'", [[1]]]', 3),  # escaped backslashes end before the quote
        (b'["' + b"\\" * (2 * PIECE - 1) + b'"", [1]]', 2),  # an odd run across a piece edge
        (b'["' + b"[" * run + b'"]', 1),  # brackets inside a string count for nothing
        (b'"' + b"]" * run + b'" ' + nested(5), 5),
        (b"[" + b"[]," * run + b"[]]", 2),
        (b"[" + b'"",' * run + b'""]', 1),
        (nested(80), 80),
        (nested(81), 81),
        (b'{"a": ' * 100 + b"{}" + b"}" * 100, 101),
        (b"]" * run + nested(3), 0),  # a parser stops at the first "]": so may the scan
        (b"\xff\xfe" * run + nested(2), 2),  # invalid UTF-8 is just bytes
        (b"", 0),
    ]
    for body, expected in cases:
        assert json_depth(body) == expected, body[:40]
    assert json_depth(b"[" * run, stop_above=80) > 80
    assert json_depth(b"[" * run) == run


def test_deep_bodies_stop_the_scan_early() -> None:
    scan = DepthScan(stop_above=80)
    scan.feed(b"[" * 100)
    assert scan.done and scan.deepest > 80
    scan.feed(b"]" * 1000)  # nothing after it is looked at
    assert scan.deepest == 100
    closed = DepthScan()
    closed.feed(b"]]][")  # more closed than opened at the end of a piece
    assert closed.done
    closed.feed(b"[" * 100)
    assert closed.deepest == 0


FIELD = st.text(alphabet=st.sampled_from("abc=&%+ 2é;"), max_size=10)


@settings(max_examples=300, deadline=None)
@given(fields=st.lists(st.tuples(st.sampled_from(["csrf", "token", "x"]), FIELD), max_size=5))
def test_the_csrf_field_is_what_parse_qs_reads(fields: list[tuple[str, str]]) -> None:
    body = urllib.parse.urlencode(fields).encode()
    values = urllib.parse.parse_qs(body.decode()).get("csrf")
    assert form_field(body, "csrf") == (values[0] if values else None)


def test_the_csrf_field_on_crafted_forms() -> None:
    assert form_field(b"csrf=&csrf=z", "csrf") == "z"
    assert form_field(b"xcsrf=1&csrfx=2", "csrf") is None
    assert form_field(b"&" * (1 << 20), "csrf") is None
    assert form_field(b"csrf=" + b"%41" * (1 << 20), "csrf") == ""  # too long to be a token
    assert form_field(b"a=%41&csrf=ab%2B+c", "csrf") == "ab+ c"


def test_json_is_what_fastapi_parses_as_json() -> None:
    for kind in ["", "application/json", "application/problem+json"]:
        assert is_json(kind)
    for kind in ["application/x-www-form-urlencoded", "text/plain", "multipart/form-data"]:
        assert not is_json(kind)


def test_a_deep_keys_field_of_the_dashboard_is_no_keys() -> None:
    from mtask.web.dashboard import _keys

    assert _keys("[" * 200_000) == [] and _keys('["a", 1, "b"]') == ["a", "b"]
