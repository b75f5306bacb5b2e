"""The curated mutation check: each core promise, broken by one line in a copy of the
tree, must fail the test that claims it.

For each mutation below this script copies the repository (its tracked files, as they are in the
working tree) into a temporary directory, replaces one exact line of one module (the line must
be there exactly once: a mutation that no longer applies fails the check, so that it is kept up
to date with the code), and runs the named tests of the copy with pytest, the copy first on
``PYTHONPATH`` (worker subprocesses the tests start run the copy too). The check passes when
every mutation is *killed*: a named test fails on an assertion. First, every named test is run
once on an unmutated copy and must pass there, so that a test that fails anyway (a setup error,
a missing tool) can never count as a kill; and a mutated run whose tests end in a setup error,
a timeout or a crash instead of a failed assertion fails the check as inconclusive. A mutation
that survives means a promise whose test passes when the promise breaks. Run it with ``python
tests/mutations/check.py`` (``--only NAME`` for one); ``.ci/run`` runs it after the suite, whose
JUnit report stands for the unmutated run (``--baseline-from``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    promise: str
    path: str
    line: str
    """One whole line of ``path``, stripped of its indentation, found there exactly once."""
    replacement: str
    """What takes its place (the line's indentation is kept)."""
    tests: tuple[str, ...]
    after: str = ""
    """Look for ``line`` only below the first line that contains this (a function's ``def``)."""


MUTATIONS = [
    Mutation(
        "outcome-fence",
        "an outcome is written only while its run is RUNNING",
        "mtask/store/claims.py",
        'return {"_id": key, "runs": {"$elemMatch": {"run_id": run_id, "state": RUNNING}}}',
        'return {"_id": key, "runs": {"$elemMatch": {"run_id": run_id}}}',
        (
            "tests/chaos/test_zombie_writes.py::test_a_zombies_outcome_reaches_mongodb_and_is_refused",
        ),
    ),
    Mutation(
        "step-fence",
        "a step is recorded only while its run owns the task, on a live lease",
        "mtask/store/steps.py",
        "filt = fence(key, run_id)",
        'filt = {"_id": key}',
        (
            "tests/chaos/test_zombie_writes.py::"
            "test_a_zombies_step_record_and_output_reach_mongodb_and_are_refused",
        ),
        after="def record_update(",
    ),
    Mutation(
        "output-fence",
        "a run's output is written only while it owns the task",
        "mtask/store/transactional.py",
        "fenced: Doc = {",
        'fenced: Doc = {"_id": key} or {',
        (
            "tests/chaos/test_zombie_writes.py::"
            "test_a_zombies_step_record_and_output_reach_mongodb_and_are_refused",
        ),
        after="def run_fence(",
    ),
    Mutation(
        "output-once",
        "a batch of output sent again is written once",
        "mtask/store/output.py",
        'filt = run_fence(key, run_id, output_batch={"$not": {"$gte": batch}})',
        "filt = run_fence(key, run_id)",
        (
            "tests/integration/test_output.py::"
            "test_a_batch_sent_again_is_written_once_and_a_stale_lease_writes_nothing",
        ),
    ),
    Mutation(
        "step-replay",
        "a step recorded done is replayed, not called again",
        "mtask/steps/calls.py",
        'if prior is not None and prior.get("state") == "done":',
        "if False:",
        ("tests/integration/test_steps.py::test_steps_run_once_and_replay_across_a_retry",),
        after="    def step(",
    ),
    Mutation(
        "group-lock",
        "one open task of a sequence holds its group's lock",
        "mtask/store/schema.py",
        "unique=True,",
        "unique=False,",
        (
            "tests/integration/test_groups.py::"
            "test_a_sequence_is_held_by_the_claim_of_its_running_task",
        ),
    ),
    Mutation(
        "supersede-race",
        "of publishers racing with a supersede policy, exactly one task stays open",
        "mtask/store/schema.py",
        "unique=True,  # of racing publishers, one holds it",
        "unique=False,  # of racing publishers, one holds it",
        ("tests/integration/test_supersede.py::test_racing_publishers_leave_exactly_one_newest",),
    ),
    Mutation(
        "debounce-race",
        "of publishers racing to debounce one key, one opens its window",
        "mtask/store/schema.py",
        "unique=True,  # of racing publishers of a key, one opens its window",
        "unique=False,  # of racing publishers of a key, one opens its window",
        ("tests/integration/test_debounce_worker.py::test_racing_publishers_open_one_window",),
    ),
    Mutation(
        "group-lock-race",
        "a sequence never overlaps when late publishes, retries and a zombie race it",
        "mtask/store/schema.py",
        "unique=True,",
        "unique=False,",
        (
            "tests/chaos/test_sequence_races.py::"
            "test_late_publishes_retries_a_reopened_task_and_a_zombie_never_overlap",
        ),
    ),
    Mutation(
        "relay-takeover",
        "a relay that dies, freezes or is cut off is taken over by its standby within a second",
        "mtask/store/relays.py",
        '{"$lte": [renewed_at, {"$subtract": ["$$NOW", stale_ms]}]},',
        '{"$lte": [renewed_at, {"$subtract": ["$$NOW", 3_600_000]}]},',
        ("tests/chaos/test_partition.py::test_the_relays_holder_cut_off_frozen_and_killed",),
    ),
    Mutation(
        "dashboard-role-gate",
        "a dashboard form is refused to a role below its action's, nothing changed, audited",
        "mtask/web/dashboard.py",
        "if action not in access.ACTION_ROLES or access.may(principal, action):",
        "if True:",
        (
            "tests/integration/test_web_audit.py::"
            "test_a_viewer_is_refused_every_dashboard_form_and_each_refusal_is_audited",
        ),
    ),
    Mutation(
        "read-token-signature",
        "a read token whose signature does not match is refused (401), and counted as a failure",
        "mtask/security/read_tokens.py",
        "if not hmac.compare_digest(parts[2].encode(), _b64(expected).encode()):",
        "if False:",
        (
            "tests/integration/test_web_audit.py::"
            "test_failed_authentications_are_rate_limited[forged read token]",
        ),
    ),
    Mutation(
        "claim-due",
        "a task is claimed no sooner than its next_claim_at, by the server's clock",
        "mtask/store/claims.py",
        '"next_claim_at": {"$type": "date", "$lte": now},',
        '"next_claim_at": {"$type": "date"},',
        ("tests/integration/test_store.py::test_claim_respects_next_claim_at_and_names",),
        after="def claim_filter(",
    ),
    Mutation(
        "claim-distinct",
        "a task of concurrency above 1 is claimed by distinct workers only",
        "mtask/store/claims.py",
        '{"$not": [{"$anyElementTrue": [mine]}]},',
        "True,",
        ("tests/integration/test_store.py::test_concurrency_needs_distinct_workers",),
    ),
    Mutation(
        "publish-once",
        "publishing a key that exists changes nothing: the first publish's task stays",
        "mtask/store/tasks.py",
        '({"_id": doc["_id"]}, {"$setOnInsert": fields}),',
        '({"_id": doc["_id"]}, {"$set": fields}),',
        ("tests/integration/test_client.py::test_fifty_concurrent_async_publishers",),
    ),
    Mutation(
        "trigger-change-key",
        "a change read again (a takeover, a resume from an older token) keeps its one task",
        "mtask/triggers.py",
        "return _fit(self.name, id_text(doc_id), digest(token))",
        "return _fit(self.name, id_text(doc_id), str(ObjectId()))",
        (
            "tests/integration/test_triggers.py::"
            "test_a_change_replayed_by_the_next_holder_publishes_no_second_task",
        ),
    ),
    Mutation(
        "trigger-insert-if-absent",
        "a change read again leaves its task as it is: one that ran does not run again",
        "mtask/store/tasks.py",
        'requests.append(UpdateOne({"_id": task.key}, {"$setOnInsert": doc}, upsert=True))',
        'requests.append(UpdateOne({"_id": task.key}, {"$set": doc}, upsert=True))',
        (
            "tests/integration/test_triggers.py::"
            "test_a_change_replayed_by_the_next_holder_publishes_no_second_task",
        ),
    ),
    Mutation(
        "parallel-step-fence",
        "a parallel step is recorded only while its run owns the task, on a live lease",
        "mtask/store/steps.py",
        "filt = fence(key, run_id)",
        'filt = {"_id": key}',
        (
            "tests/integration/test_zombie_fences.py::"
            "test_a_zombies_parallel_step_is_refused_and_the_takeovers_is_recorded",
        ),
        after="def record_named_update(",
    ),
    Mutation(
        "step-lease",
        "a run whose lease ran out records nothing, even before another run takes its task",
        "mtask/store/transactional.py",
        '"$expr": lease_alive_expr(run_id),',
        "# (no lease)",
        (
            "tests/integration/test_zombie_fences.py::"
            "test_a_zombies_parallel_step_is_refused_and_the_takeovers_is_recorded",
        ),
        after="def run_fence(",
    ),
    Mutation(
        "data-wait-fence",
        "a data wait is announced only while its run owns the task",
        "mtask/store/datawaits.py",
        '"update_one", (fence(key, run_id), [{"$set": {"waiting": literal(waiting)}}])',
        '"update_one", ({"_id": key}, [{"$set": {"waiting": literal(waiting)}}])',
        (
            "tests/integration/test_zombie_fences.py::"
            "test_a_zombies_data_wait_is_refused_and_a_stale_wake_wakes_nothing",
        ),
    ),
    Mutation(
        "data-wake-fence",
        "a wake wakes only the wait it read, not a later wait of the task",
        "mtask/store/datawaits.py",
        'same = [{"_id": t["_id"], "waiting.index": t["waiting"]["index"]} for t in tasks]',
        'same = [{"_id": t["_id"]} for t in tasks]',
        (
            "tests/integration/test_zombie_fences.py::"
            "test_a_zombies_data_wait_is_refused_and_a_stale_wake_wakes_nothing",
        ),
    ),
    Mutation(
        "cron-tick-key",
        "of schedulers racing for one tick, one publishes its task (the tick is its key)",
        "mtask/schedules/ticks.py",
        'return f"{schedule_id}@{stamp}"',
        'return f"{schedule_id}@{dt.datetime.now(dt.UTC).isoformat()}"',
        ("tests/integration/test_schedules.py::test_concurrent_schedulers_publish_each_tick_once",),
    ),
    Mutation(
        "cron-advance-cas",
        "a scheduler that fires a stale read late never moves its schedule back",
        "mtask/store/schedules.py",
        '"next_tick_at": doc["next_tick_at"],',
        "# (any tick)",
        (
            "tests/integration/test_schedules.py::"
            "test_a_scheduler_that_fires_a_stale_read_late_never_moves_the_schedule_back",
        ),
    ),
    Mutation(
        "keyless-ciphertext",
        "a worker without the key never hands an encrypted task's ciphertext to its handler",
        "mtask/worker/running/sealing.py",
        "if sealed(params):  # a type check and a lookup for a plain task",
        "if False:",
        (
            "tests/integration/test_encryption_keys.py::"
            "test_in_one_process_a_keyless_worker_gives_back_and_a_keyed_one_seals_the_result",
        ),
    ),
    Mutation(
        "sealed-params",
        "a worker with the key hands its handler the plain params",
        "mtask/worker/running/sealing.py",
        "if not sealed(params):",
        "if True:",
        (
            "tests/integration/test_encryption_keys.py::"
            "test_in_one_process_a_keyless_worker_gives_back_and_a_keyed_one_seals_the_result",
        ),
        after="class Sealed(",
    ),
    Mutation(
        "sealed-result",
        "the result of an encrypted task is stored encrypted",
        "mtask/worker/running/sealing.py",
        'if result is None or not sealed(doc.get("params")):',
        "if True:",
        (
            "tests/integration/test_encryption_keys.py::"
            "test_in_one_process_a_keyless_worker_gives_back_and_a_keyed_one_seals_the_result",
        ),
    ),
    Mutation(
        "hostile-id",
        "a task document of any shape, _id included, never stops a worker",
        "mtask/worker/finding/setaside.py",
        "return value if isinstance(value, str) else None",
        "return value",
        ("tests/chaos/test_any_document.py",),
    ),
]


def copy_tree(into: Path) -> None:
    """The repository's tracked files as they are now, and the Node test modules."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        path = Path(raw.decode())
        source = ROOT / path
        if source.is_file():
            (into / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / path)
    modules = ROOT / "tests/acceptance/interop/node_modules"
    if modules.is_dir():
        (into / "tests/acceptance/interop/node_modules").symlink_to(modules)


def locate(mutation: Mutation, lines: list[str]) -> int:
    """The index of the one line of ``lines`` the mutation replaces; ``SystemExit`` when it is
    not there exactly once (the check is out of date with the code)."""
    start = next((i for i, line in enumerate(lines) if mutation.after in line), len(lines))
    found = [i for i, line in enumerate(lines) if i >= start and line.strip() == mutation.line]
    found = found[:1] if mutation.after else found
    if len(found) != 1:
        raise SystemExit(
            f"mutation {mutation.name}: the line {mutation.line!r} is in {mutation.path} "
            f"{len(found)} times, not once; update tests/mutations/check.py"
        )
    return found[0]


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / mutation.path
    lines = path.read_text().splitlines(keepends=True)
    at = locate(mutation, lines)
    line = lines[at]
    indent = line[: len(line) - len(line.lstrip())]
    lines[at] = f"{indent}{mutation.replacement}\n"
    path.write_text("".join(lines))


@dataclass(frozen=True)
class Verdicts:
    """What one pytest run of named tests ended in, read from its JUnit XML report."""

    failed: tuple[str, ...]
    """Tests that failed on an assertion or an exception of the test's own (a kill)."""
    broken: tuple[str, ...]
    """Tests that ended in a setup or teardown error, a timeout or a crash: inconclusive."""
    passed: int
    tail: str


def pytest_run(
    tree: Path, tests: tuple[str, ...], stop_at_first: bool, processes: int = 0
) -> Verdicts:
    report = tree / f"report-{time.monotonic_ns()}.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "tests")])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *(["-x"] if stop_at_first else []),
         "-n", str(processes),
         "-p", "no:cacheprovider", f"--junitxml={report}", *tests],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-3:])
    if done.returncode not in (0, 1) or not report.exists():
        return Verdicts((), (f"pytest exited {done.returncode}",), 0, tail)
    failed, broken, passed = [], [], 0
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failure, error = case.find("failure"), case.find("error")
        if error is not None:
            broken.append(name)
        elif failure is not None:
            message = f"{failure.get('message', '')} {failure.text or ''}"
            # pytest-timeout's own verdict ("Failed: Timeout >120.0s") is the harness giving up,
            # not the test: inconclusive; a TimeoutError the test raised is its failure
            (broken if "Failed: Timeout >" in message else failed).append(name)
        elif case.find("skipped") is None:
            passed += 1
    return Verdicts(tuple(failed), tuple(broken), passed, tail)


def baseline(mutations: list[Mutation], report: Path | None = None) -> None:
    """Every named test passes on an unmutated copy; ``SystemExit`` naming those that do not.
    With ``report`` (the JUnit report of the suite just run on this tree), the tests it holds
    as passed are not run again."""
    tests = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
    if report is not None:
        seen = passed_in(report, tests)
        print(f"unmutated: {len(seen)} named tests passed in the suite's run ({report.name})")
        tests = tuple(t for t in tests if t not in seen)
        if not tests:
            return
    with tempfile.TemporaryDirectory(prefix="mutant-none-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        started = time.monotonic()
        verdicts = pytest_run(tree, tests, stop_at_first=False, processes=3)  # as the suite
    bad = verdicts.failed + verdicts.broken
    if bad or not verdicts.passed:
        raise SystemExit(
            "the named tests must pass on the unmutated tree first; these did not: "
            f"{', '.join(bad) or 'none ran'}\n{verdicts.tail}"
        )
    print(f"unmutated: {verdicts.passed} named tests passed in {time.monotonic() - started:.1f}s")


def passed_in(report: Path, tests: tuple[str, ...]) -> tuple[str, ...]:
    """Which of ``tests`` (a file, a test, or one parameter of it) the JUnit ``report`` of a
    run on this same tree (the suite's, in ``.ci/run``) holds as passed: each of its cases
    passed, none failed, errored or was skipped. A test it holds no case of is not among them."""
    cases: list[tuple[str, str, bool]] = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        path = f"{str(case.get('classname', '')).replace('.', '/')}.py"
        name = str(case.get("name", ""))
        ok = all(case.find(tag) is None for tag in ("failure", "error", "skipped"))
        cases.append((path, name, ok))

    def held(test: str) -> bool:
        path, _, name = test.partition("::")
        mine = [
            ok
            for at, case, ok in cases
            if at == path and (not name or case == name or case.split("[", 1)[0] == name)
        ]
        return bool(mine) and all(mine)

    return tuple(t for t in tests if held(t))


def run(mutation: Mutation) -> tuple[bool, float, str]:
    """Whether the mutation was killed (a named test failed on an assertion), how long its tests
    took, and the end of their output; ``SystemExit`` when the run was inconclusive."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutation.name}-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        apply(mutation, tree)
        started = time.monotonic()
        verdicts = pytest_run(tree, mutation.tests, stop_at_first=True)
        if verdicts.broken and not verdicts.failed:
            raise SystemExit(
                f"mutation {mutation.name}: inconclusive, its tests did not run to an assertion "
                f"({', '.join(verdicts.broken)})\n{verdicts.tail}"
            )
        return bool(verdicts.failed), time.monotonic() - started, verdicts.tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", help="a mutation's name (repeatable)")
    parser.add_argument(
        "--skip-baseline", action="store_true", help="do not run the named tests unmutated first"
    )
    parser.add_argument(
        "--baseline-from",
        type=Path,
        metavar="REPORT",
        help="the JUnit report of the suite run on this tree: its passed named tests are the "
        "unmutated run (the others are run unmutated first)",
    )
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    with shared_mongod():
        return check(chosen, baseline_first=not args.skip_baseline, report=args.baseline_from)


@contextlib.contextmanager
def shared_mongod() -> Iterator[None]:
    """One embedded mongod for every run's tests (``MTASK_TEST_MONGODB_URI``, which the tests'
    ``mongo_uri`` fixture takes; each test has a database of its own), unless one is given:
    each run started its own before, a few seconds a run."""
    if os.environ.get("MTASK_TEST_MONGODB_URI"):
        yield
        return
    from mtask.embedded import EmbeddedMongo

    with tempfile.TemporaryDirectory(prefix="mutants-mongod-") as data:
        server = EmbeddedMongo(Path(data))
        os.environ["MTASK_TEST_MONGODB_URI"] = server.start()
        try:
            yield
        finally:
            del os.environ["MTASK_TEST_MONGODB_URI"]
            server.stop()


JOBS = int(os.environ.get("MTASK_MUTATION_JOBS", "3"))
"""Mutations tried at once, each in a pytest process of its own (their tests mostly wait on
mongod and worker processes, as the suite's three processes do)."""


def check(chosen: list[Mutation], *, baseline_first: bool, report: Path | None = None) -> int:
    """Each mutation's verdict printed as it comes, ``JOBS`` at once; 1 if one survived."""
    if baseline_first:
        baseline(chosen, report)
    survived = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, JOBS)) as pool:
        runs = {pool.submit(run, mutation): mutation for mutation in chosen}
        for done in concurrent.futures.as_completed(runs):
            mutation = runs[done]
            killed, seconds, tail = done.result()  # an inconclusive run's SystemExit goes on
            verdict = "killed" if killed else "SURVIVED"
            print(f"{verdict:8} {mutation.name:14} {seconds:5.1f}s  {mutation.promise}", flush=True)
            if not killed:
                survived.append(mutation.name)
                print(f"         {tail}", flush=True)
    if survived:
        print(f"{len(survived)} mutation(s) survived: {', '.join(survived)}")
        return 1
    print(f"all {len(chosen)} mutations were killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
