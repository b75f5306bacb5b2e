"""A publisher process for the chaos suite: ``publisher.py URI DB FIRST COUNT KEYS``.

Publishes COUNT times from 16 threads, task ``work`` with key ``p{i % KEYS}`` for i in
FIRST..FIRST+COUNT, and prints how many publishes created their task."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from mtask import TaskClient

uri, db, first, count, keys = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
with TaskClient(uri, database=db) as client, ThreadPoolExecutor(16) as pool:
    results = pool.map(
        lambda i: client.publish("work", f"p{i % keys}", {"ms": 10}).created,
        range(first, first + count),
    )
    print(sum(results))
