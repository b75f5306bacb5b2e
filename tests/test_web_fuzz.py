"""schemathesis against ``mtask serve``'s own OpenAPI spec, over real HTTP, on the real
MongoDB: whatever it sends, the server answers without a 5xx."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from pymongo import MongoClient
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
                response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
                codes[response.status_code] = codes.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.formatted_path} body={case.body!r} -> "
                        f"{response.status_code} {response.text[:300]}"
                    )

            check()
    assert calls > 200
    assert codes.get(401, 0) < calls / 10  # the token was taken: the routes were exercised
    assert sum(n for code, n in codes.items() if code < 300) > calls / 4, codes
    print(f"{calls} requests: {dict(sorted(codes.items()))}")
    assert not failures, "\n".join(failures[:10])
