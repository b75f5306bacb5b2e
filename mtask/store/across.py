"""Queries by status across names, read from ``name_status_newest`` name by name.

No index starts with the status (one would cost every task five index key writes: its insert,
then a delete and an insert at each status change), so a list, search, bulk action, count or
sweep by status without a name first reads the names present (``counts.names``, a
``DISTINCT_SCAN``) and names them:

- **the string names**, at most ``MERGE_AT_MOST`` to a find: the server merges their ranges in
  order (a ``SORT_MERGE``); it explodes at most 200 index ranges, above which it would sort
  every task that matches;
- **every other name** (none, ``""``, a number, a document, an array: only documents written
  by hand have one) by ``NOT_A_NAME``, whose index bounds hold no string but ``""``; such a name
  may be any BSON value, which a ``$in`` could not always hold (a document with a ``$`` key).

A sorted page is one find per part, sent together, merged here in MongoDB's order
(``order_key``) and cut to the page's size.
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import bson
from bson.decimal128 import Decimal128
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.regex import Regex
from bson.timestamp import Timestamp
from pymongo import DESCENDING

from mtask.driver import Call, Doc, Op, gather
from mtask.store import counts

MERGE_AT_MOST = 200
"""String names a sorted find names at most (MongoDB merges at most 200 index ranges)."""
NOT_A_NAME: Doc = {"$not": {"$gt": ""}}
"""Missing, null, ``""`` or not a string: ``$gt ""`` is every other string."""


def string_names(names: Iterable[Any]) -> list[str]:
    return sorted({n for n in names if isinstance(n, str) and n})


def name_parts(names: Iterable[Any]) -> list[Doc]:
    """Predicates on ``name`` that together match every document, each read in index order:
    the string ``names`` present, at most ``MERGE_AT_MOST`` a part, then every other name."""
    strings = string_names(names)
    parts: list[Doc] = [
        {"$in": strings[i : i + MERGE_AT_MOST]} for i in range(0, len(strings), MERGE_AT_MOST)
    ]
    return [*parts, NOT_A_NAME]


def every_name(names: Iterable[Any]) -> Doc:
    """A filter clause matching every document, name by name (for a query that is not
    sorted: a bulk action, a count)."""
    return {"$or": [{"name": part} for part in name_parts(names)]}


def find_page(
    filt: Doc, sort: Sequence[tuple[str, int]], limit: int, by_name: bool
) -> Op[list[Doc]]:
    """A page of ``filt`` in ``sort``'s order: one find, or (``by_name``: a status without a
    name) the names present, then ``find_sorted``."""
    if by_name:
        return (yield from find_sorted(filt, sort, limit, (yield counts.names())))
    docs: list[Doc] = yield Call("find", (filt,), {"sort": list(sort), "limit": limit})
    return docs


def find_sorted(
    filt: Doc, sort: Sequence[tuple[str, int]], limit: int, names: Iterable[Any]
) -> Op[list[Doc]]:
    """The first ``limit`` documents matching ``filt`` in ``sort``'s order, across names: one
    find per part of ``name_parts`` (sent together), merged."""
    calls = [
        Call("find", ({"$and": [filt, {"name": part}]},), {"sort": list(sort), "limit": limit})
        for part in name_parts(names)
    ]
    pages: list[list[Doc]] = yield gather(*calls)
    merged = [doc for page in pages for doc in page]
    merged.sort(key=functools.cmp_to_key(functools.partial(_compare, sort)))
    return merged[:limit]


def _compare(sort: Sequence[tuple[str, int]], a: Mapping[str, Any], b: Mapping[str, Any]) -> int:
    for field, direction in sort:
        ka, kb = order_key(a.get(field)), order_key(b.get(field))
        if ka != kb:
            before = ka < kb
            return (-1 if before else 1) * (-1 if direction == DESCENDING else 1)
    return 0


_RANKS: tuple[tuple[type | tuple[type, ...], int], ...] = (
    (MinKey, 0),
    (type(None), 1),
    (bool, 8),  # before numbers: a bool is an int in Python
    ((int, float, Decimal128), 2),
    (str, 3),
    (dict, 4),
    (list, 5),
    ((bytes, bson.Binary), 6),
    (ObjectId, 7),
    (dt.datetime, 9),
    (Timestamp, 10),
    (Regex, 11),
    (MaxKey, 12),
)


def order_key(value: Any) -> tuple[Any, ...]:
    """``value``'s place in MongoDB's sort order: its type's rank (null and missing first,
    then numbers, strings, documents, arrays, binary, ids, booleans, dates, timestamps), then
    its value (documents and arrays by their encoding, a fair stand-in for values mtask never
    writes there)."""
    for types, rank in _RANKS:
        if isinstance(value, types):
            return (rank, *_within(rank, value))
    return (13, repr(value))


def _within(rank: int, value: Any) -> tuple[Any, ...]:
    if rank in (0, 1, 12):
        return ()
    if rank == 2:
        return (float(value.to_decimal()) if isinstance(value, Decimal128) else float(value),)
    if rank in (4, 5):
        return (bson.encode({"v": value}),)
    if rank == 6:
        return (bytes(value),)
    if rank == 9:
        naive = value.tzinfo is None
        return (value.replace(tzinfo=dt.UTC) if naive else value,)
    if rank == 10:
        return (value.time, value.inc)
    if rank == 11:
        return (value.pattern, value.flags)
    return (value,)
