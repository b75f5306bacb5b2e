"""schemathesis against ``mtask serve``'s own (typed) OpenAPI spec, over real HTTP, on the real
MongoDB: whatever it sends, the server answers without a 5xx, and every answer it documents
matches its response schema."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from pymongo import MongoClient
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from webserver import serving

TOKEN = "fuzz-token"
pytestmark = pytest.mark.timeout(900)


def test_no_server_errors(mongo_uri: str, db_name: str, mongo: MongoClient[dict[str, Any]]) -> None:
    failures: list[str] = []
    calls = 0
    codes: dict[int, int] = {}
    with serving(mongo_uri, db_name, token=TOKEN) as base_url:
        schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        # the SSE stream never ends (tested in tests/test_events_http.py)
        streaming = {"/events"}
        operations = [op for op in operations if op.path not in streaming]
        assert len(operations) >= 20
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(
                max_examples=50,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def check(case: Any) -> None:
                nonlocal calls
                calls += 1
                if case.query:
                    case.query.pop("wait", None)  # a long poll may wait minutes (test_events_http)
                response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                try:
                    case.validate_response(
                        response, checks=[not_a_server_error, response_schema_conformance]
                    )
                except Exception as exc:  # noqa: BLE001 - every failed check is collected
                    failures.append(
                        f"{case.method} {case.formatted_path} body={case.body!r} -> "
                        f"{response.status_code} {response.text[:300]}: {str(exc)[:300]}"
                    )

            check()
    assert calls > 200
    assert codes.get(401, 0) < calls / 10  # the token was taken: the routes were exercised
    assert sum(n for code, n in codes.items() if code < 300) > calls / 4, codes
    print(f"{calls} requests: {dict(sorted(codes.items()))}")
    assert not failures, "\n".join(failures[:10])
