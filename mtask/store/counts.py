"""Counts per name and status (``stats``) at a cost that does not grow with the tasks kept.

An exact count walks every index key it counts (a ``COUNT_SCAN``: about half a microsecond a
key here), so exact counts of everything cost what the collection holds — half a second at a
million tasks. Counters kept beside the tasks cannot be exact either: a counter moved in the
same atomic write as its task needs a transaction on every claim and outcome, and MongoDB's TTL
monitor deletes expired tasks without telling anyone. And a sample (``$sample``) is neither
cheap nor fair here: a thousand random documents took 100 ms at a million tasks, and
WiredTiger's random cursor favours some pages (docs/scale.md, "Counts").

So ``stats`` counts the **open** tasks exactly (pending, running: they are the queue, and they
cost what the backlog costs, not what retention keeps) and the **finished** ones exactly up to
a bound (``exact_up_to``, 1,000 by default, per name and status) and as "more than that" above
it — a lower bound, never a guess, like "1,000+" on a page of search results:

1. the names present (a ``DISTINCT_SCAN``);
2. then, sent together (``driver.gather``): the open tasks of every name, from one covered scan
   of ``name_status_newest`` grouped by name and status (no document is read), and one
   ``count`` command per name and finished status (and for documents without a status), with
   ``limit: exact_up_to + 1`` (a ``COUNT_SCAN`` that stops there; one of a status absent
   examines one key). No index has the status first (it would cost every task five key
   writes), so the statuses present are not read apart.

The finished counts cost at most ``exact_up_to + 1`` keys per name and status, whatever the
collection holds. ``exact=True`` counts everything exactly (linear; for a script that needs the
number). Every call is answered from an index; none reads a document or scans the collection.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mtask.driver import Call, Op, gather
from mtask.vocabulary import OPEN_STATUSES, TaskStatus

STATUSES = [s.value for s in TaskStatus]
INCOMPLETE = "incomplete"
"""How ``stats`` counts documents without a status (published by hand, not completed yet)."""
STATS_INDEX = "name_status_newest"
"""Counts are scans of this index's (name, status) prefix."""
EXACT_UP_TO = 1_000
"""Finished tasks per name and status counted exactly up to this many; above, "more than"."""


class Counts(dict[str, dict[str, int]]):
    """``{name: {status: count}}``. A pair in ``at_least`` holds ``exact_up_to + 1``: there are
    more than ``exact_up_to`` such tasks (a lower bound); every other count is exact. Compares
    equal to a plain dict."""

    def __init__(
        self,
        counts: Mapping[str, dict[str, int]] | None = None,
        at_least: Iterable[tuple[str, str]] = (),
        exact_up_to: int | None = None,
    ) -> None:
        super().__init__(counts or {})
        self.at_least = frozenset(at_least)
        self.exact_up_to = exact_up_to

    def is_lower_bound(self, name: str, status: str) -> bool:
        return (name, status) in self.at_least

    def show(self, name: str, status: str) -> str:
        """The count as a person reads it: ``1,234``, or ``1,000+`` for a lower bound."""
        if self.is_lower_bound(name, status):
            return f"{self.exact_up_to:,}+"
        return f"{self.get(name, {}).get(status, 0):,}"


def names() -> Call:
    return Call("distinct", ("name",))  # a DISTINCT_SCAN (distinct takes no hint before 7.1)


def count(name: Any, status: str | None, limit: int | None = None) -> Call:
    """The ``count`` command (a ``COUNT_SCAN``; with ``limit``, one that stops there). Not
    ``count_documents``: that is an aggregation, and with a limit it fetches documents."""
    kwargs: dict[str, Any] = {"hint": STATS_INDEX}
    if limit is not None:
        kwargs["limit"] = limit
    # $eq: a name written by hand may be a document, whose $ keys would read as operators
    return Call("count", ({"name": {"$eq": name}, "status": status},), kwargs)


def open_counts(all_names: Sequence[Any], statuses: Sequence[str]) -> Call:
    """The open tasks of every name per status: one covered scan of the index's open keys."""
    return Call(
        "aggregate",
        (
            [
                {"$match": {**_named(all_names), "status": {"$in": list(statuses)}}},
                {"$group": {"_id": {"name": "$name", "status": "$status"}, "n": {"$sum": 1}}},
            ],
        ),
        {"hint": STATS_INDEX},
    )


def _named(all_names: Sequence[Any]) -> dict[str, Any]:
    """A filter on ``all_names``: one ``$in``, and an ``$eq`` for each name that is a document
    (one written by hand; a ``$`` key of it cannot go in a ``$in``)."""
    plain = [n for n in all_names if not isinstance(n, dict)]
    documents = [n for n in all_names if isinstance(n, dict)]
    if not documents:
        return {"name": {"$in": plain}}
    return {"$or": [{"name": {"$in": plain}}, *({"name": {"$eq": d}} for d in documents)]}


def stats(
    statuses: Sequence[str] | None = None,
    *,
    exact: bool = False,
    exact_up_to: int = EXACT_UP_TO,
) -> Op[Counts]:
    """Counts per name and status (only ``statuses``, if given: e.g. ``statemachine.OPEN``
    for the queue depth). See the module's docstring for what is exact and what it costs."""
    wanted = [*STATUSES, INCOMPLETE] if statuses is None else list(statuses)
    all_names = sorted((yield names()), key=str)
    open_wanted = [s for s in OPEN_STATUSES if s in wanted]
    finished = [s for s in STATUSES if s not in OPEN_STATUSES and s in wanted]
    pairs = [(name, status) for name in all_names for status in finished]
    limit = None if exact else exact_up_to + 1
    calls = [count(name, status, limit) for name, status in pairs]
    if INCOMPLETE in wanted:  # publishers' documents, not completed yet
        pairs += [(name, INCOMPLETE) for name in all_names]
        calls += [count(name, None) for name in all_names]
    if open_wanted and all_names:
        calls.append(open_counts(all_names, open_wanted))
    results: list[Any] = (yield gather(*calls)) if calls else []
    found: dict[tuple[str, str], int] = {}
    at_least: list[tuple[str, str]] = []
    for (name, status), n in zip(pairs, results, strict=False):
        found[(str(name), status)] = n
        if status != INCOMPLETE and n > exact_up_to and not exact:
            at_least.append((str(name), status))
    if open_wanted and all_names:
        for row in results[-1]:
            found[(str(row["_id"].get("name")), str(row["_id"].get("status")))] = int(row["n"])
    out: dict[str, dict[str, int]] = {}
    for (name, status), n in sorted(found.items()):
        if n:
            out.setdefault(name, {})[status] = n
    return Counts(out, at_least, exact_up_to)
