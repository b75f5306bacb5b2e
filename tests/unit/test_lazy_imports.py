"""What each entry point imports: ``import mtask`` loads nothing, the command line's
parser (``mtask --help``) loads no model, driver or worker, no client command loads the
worker's code, ``mtask get`` no step engine, and ``mtask-worker`` no other command, no process
pool (unless a handler is isolated) and no OpenTelemetry. Import checks in a fresh interpreter,
not timings (bench WST measures those)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mtask

ROOT = Path(mtask.__file__).parent
HEAVY = ("pymongo", "bson", "pydantic", "rich", "mtask.client", "mtask.models", "mtask.worker")


def loaded(code: str) -> list[str]:
    """The modules a fresh interpreter holds after ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT.parent
    ).stdout
    names: list[str] = json.loads(out.splitlines()[-1])
    return names


def under(names: list[str], *packages: str) -> list[str]:
    return [n for n in names if any(n == p or n.startswith(f"{p}.") for p in packages)]


def test_import_mtask_loads_only_its_version() -> None:
    assert under(loaded("import mtask"), "mtask") == ["mtask", "mtask._version"]


def test_the_public_names_resolve_to_their_definitions() -> None:
    names = loaded(
        "import mtask\n"
        "from mtask.registry import Registry\n"
        "assert mtask.Registry is Registry and 'Registry' in dir(mtask)\n"
        "from mtask import *\n"
        "assert TaskClient.__module__ == 'mtask.client' and Worker.__module__ == 'mtask.worker'\n"
        "try:\n    mtask.Nothing\nexcept AttributeError as exc:\n    assert 'Nothing' in str(exc)\n"
        "else:\n    raise AssertionError('mtask.Nothing resolved')"
    )
    assert "mtask.worker" in names  # `import *` took every name, the worker's too


def test_the_parser_loads_no_model_driver_or_worker() -> None:
    code = "from mtask.cli import build_parser\nparser = build_parser()\nparser.format_help()"
    assert under(loaded(code), *HEAVY) == []


def function_imports(path: Path) -> set[str]:
    """The mtask modules a command module imports inside its functions (when a command runs)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("mtask"):
                    found.add(str(inner.module))
                elif isinstance(inner, ast.Import):
                    found.update(a.name for a in inner.names if a.name.startswith("mtask"))
    return found


def test_no_client_command_loads_the_worker() -> None:
    """Every mtask module a client command may import, at the top or in a handler: none
    loads ``mtask.worker`` (``mtask worker run`` and ``mtask demo`` do, and only they)."""
    commands = sorted(
        p for p in (ROOT / "cli").glob("*.py") if p.stem not in ("worker", "local", "__main__")
    )
    modules = {"mtask.cli", "mtask.client"}
    for path in commands:
        modules.add(f"mtask.cli.{path.stem}")
        modules |= function_imports(path)
    code = "\n".join(f"import {m}" for m in sorted(modules))
    assert under(loaded(code), "mtask.worker") == []
    assert len(modules) > 10  # the handlers' own imports were found


def test_mtask_get_loads_no_step_engine_worker_pool_or_tracing() -> None:
    """``mtask get`` (its start-up): the step engine's ``rules`` and the children's
    counters only (what a reader of stored steps needs), no worker, no process pool, no
    OpenTelemetry (not loaded by the application, so no tracer provider can be set)."""
    names = loaded(
        "from mtask.cli import build_parser\nbuild_parser('get').parse_args(['get', 'k'])\n"
        + "\n".join(
            f"import {m}"
            for page in ("tasks.py", "render.py", "from_file.py")
            for m in sorted(function_imports(ROOT / "cli" / page))
        )
    )
    cli = [
        "mtask.cli",
        "mtask.cli.bulk",
        "mtask.cli.common",
        "mtask.cli.render",
        "mtask.cli.tasks",
    ]
    assert under(names, "mtask.cli") == cli  # main builds the parser of get's module alone
    assert under(names, "mtask.steps") == [
        "mtask.steps",
        "mtask.steps.children",
        "mtask.steps.rules",
    ]
    assert under(names, "mtask.worker", "multiprocessing", "opentelemetry") == []
    assert "mtask.client" in names and "mtask.cli.tasks" in names


def test_a_plain_worker_loads_no_other_command_pool_or_tracing() -> None:
    """``mtask-worker`` (``mtask.cli:worker_main``) and a worker without process isolation
    (its start-up): no other command module, no process pool (``multiprocessing``,
    ``ctypes``, the child's side: the assembly imports it for an isolated handler), no
    OpenTelemetry."""
    modules = sorted(function_imports(ROOT / "cli" / "worker.py"))
    names = loaded(
        "from mtask.cli import worker_main\nfrom mtask.cli import worker\n"
        + "\n".join(f"import {m}" for m in modules)
    )
    assert "mtask.worker.assembly" in names and "mtask.registry" in names
    assert under(names, "mtask.cli") == ["mtask.cli", "mtask.cli.common", "mtask.cli.worker"]
    pool = "mtask.worker.running.pool"
    assert under(names, pool) == [pool, f"{pool}.errors"]
    assert under(names, "multiprocessing", "ctypes", "opentelemetry") == []


SERVER_SIDE = ("fastapi", "starlette", "uvicorn", "jinja2", "httpx", "mtask.web")
"""``mtask serve``'s modules: no worker and no command that reads tasks loads them."""


def test_a_worker_and_the_reading_commands_load_no_server_side_or_rich() -> None:
    """A worker's start (its registry loaded, the worker built, its log handler made on a
    pipe) loads no server-side module, no rich, no ``mtask.cli.render``, no client (its
    handlers' publisher is made on their first publish) and no pydantic; ``mtask get``,
    ``list`` and ``stats`` (their modules and every module their handlers import) no
    server-side module. Structural: bench WST measures the time."""
    worker = loaded(
        "from mtask.cli import worker_main\nfrom mtask.cli import worker\n"
        "args = worker.build_parser().parse_args(['bench.peer_app:registry', '--uri', "
        "'mongodb://127.0.0.1:1/'])\n"
        "worker._log_handler()\nworker.build_worker(args)"
    )
    assert "mtask.worker.assembly" in worker and "bench.peer_app" in worker
    assert under(worker, *SERVER_SIDE, "rich", "mtask.cli.render", "mtask.client") == []
    # no pydantic: the store, the worker and the registry read the task's words and bounds from
    # mtask.vocabulary; a model is imported by the first handler or trigger declaring options,
    # schedule, budget, or child a run publishes (bench WST measures what that saves)
    assert (
        under(worker, "pydantic", "pydantic_core", "mtask.models", "mtask.schedules.definition")
        == []
    )
    # nor a handler's module that names the statuses (``mtask``'s public names)
    names = loaded("from mtask import RunState, TaskStatus, Registry")
    assert under(names, "pydantic", "mtask.models") == []
    for line in (["get", "k"], ["list"], ["stats"]):
        names = loaded(
            f"from mtask.cli import build_parser\nbuild_parser({line[0]!r}).parse_args({line!r})\n"
            + "\n".join(
                f"import {m}"
                for page in ("tasks.py", "render.py", "from_file.py")
                for m in sorted(function_imports(ROOT / "cli" / page))
            )
        )
        assert "mtask.client" in names
        assert under(names, *SERVER_SIDE) == [], line


def built_models(code: str) -> list[str]:
    """The pydantic models a fresh interpreter has built (their validators made) after
    ``code``: a model is built on its first use (``defer_build``), not at its import."""
    probe = (
        f"{code}\nimport json, pydantic\n"
        "def below(c):\n    for s in c.__subclasses__():\n        yield s\n"
        "        yield from below(s)\n"
        "print(json.dumps(sorted(f'{c.__module__}.{c.__qualname__}' "
        "for c in below(pydantic.BaseModel) if c.__pydantic_complete__)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT.parent
    ).stdout
    names: list[str] = json.loads(out.splitlines()[-1])
    return names


def test_a_worker_start_builds_no_model() -> None:
    """A worker's start (its registry loaded, handlers without declared options, the worker
    built) builds no pydantic model before its first claim (building the first cost a worker
    tens of ms); ``mtask get`` builds the one it reads, ``Task``, when it reads it."""
    worker = (
        "from mtask.cli import worker\n"
        "args = worker.build_parser().parse_args(['bench.peer_app:registry', '--uri', "
        "'mongodb://127.0.0.1:1/'])\nworker._log_handler()\nworker.build_worker(args)"
    )
    assert built_models(worker) == []
    assert built_models("from mtask.cli import build_parser\nimport mtask.client") == []
    assert "mtask.models.Task" in built_models(
        "from mtask.models import Task\nTask.model_validate({'_id': 'k', 'name': 'n'})"
    )


def test_spans_follow_a_tracer_provider_set_after_mtask_loaded() -> None:
    """``mtask.tracing`` imports no OpenTelemetry of its own, and still sees a provider the
    application sets later, or one ``OTEL_PYTHON_TRACER_PROVIDER`` names."""
    code = (
        "import sys\nfrom mtask import tracing\n"
        "assert not tracing._configured() and 'opentelemetry' not in sys.modules\n"
        "from opentelemetry import trace\nfrom opentelemetry.sdk.trace import TracerProvider\n"
        "assert not tracing._configured()\n"
        "trace.set_tracer_provider(TracerProvider())\nassert tracing._configured()\n"
        "with tracing.span('mtask.claim', name='x'):\n"
        "    assert trace.get_current_span().is_recording()"
    )
    assert "opentelemetry.sdk.trace" in loaded(code)
    named = "from mtask import tracing\nassert tracing._configured()"
    env = {**os.environ, "OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"}
    subprocess.run([sys.executable, "-c", named], check=True, env=env, cwd=ROOT.parent)


def test_each_command_is_placed_in_the_module_that_registers_it() -> None:
    """``MODULE_COMMANDS`` (``main`` builds the parser of a command's module alone) names every
    command of every module, and no other."""
    from mtask.cli import MODULE_COMMANDS, command_modules

    sub = argparse.ArgumentParser().add_subparsers()
    placed: dict[str, tuple[str, ...]] = {}
    for register, _ in command_modules():
        before = set(sub.choices)
        register(sub)
        module = register.__module__.rpartition(".")[2]
        placed[module] = tuple(n for n in sub.choices if n not in before)
    assert placed.pop("cli") == ("completion",)  # built in: every module's parser
    assert placed == MODULE_COMMANDS


def test_a_command_parses_alone_as_among_all(capsys: pytest.CaptureFixture[str]) -> None:
    """The parser of one command's module reads a command line and shows its help as the
    parser of every command does."""
    from mtask.cli import MODULE_COMMANDS, build_parser

    full = build_parser()
    for command in [c for names in MODULE_COMMANDS.values() for c in names]:
        helps = []
        for parser in (full, build_parser(command)):
            with pytest.raises(SystemExit):
                parser.parse_args([command, "--help"])
            helps.append(capsys.readouterr().out)
        assert helps[0] == helps[1] and helps[0].startswith("usage: mtask ")
    line = ["list", "--status", "failed", "--limit", "3"]
    assert vars(build_parser("list").parse_args(line)) == vars(full.parse_args(line))


def test_choices_read_on_first_use_are_still_checked_and_shown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from mtask.cli import build_parser
    from mtask.vocabulary import ON_CONFLICT_CHOICES, TaskStatus

    parser = build_parser()
    assert parser.parse_args(["list", "--status", "failed"]).status == "failed"
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["list", "--status", "done"])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert "invalid choice: 'done'" in said and all(s.value in said for s in TaskStatus)
    with pytest.raises(SystemExit):
        parser.parse_args(["publish", "--help"])
    assert "{" + ",".join(ON_CONFLICT_CHOICES) + "}" in capsys.readouterr().out
