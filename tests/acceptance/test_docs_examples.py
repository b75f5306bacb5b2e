"""Every code block of the README, CONTRIBUTING.md and docs/ that claims to run is run, and the
rest is checked as far as it can be. A block's info string says which it is
(CONTRIBUTING.md, "Examples in the docs"):

- ``python``: a program that runs as written, against the test mongod (a fresh ``mtask``
  database; it brings its own worker when it needs one): the README's by ``test_readme.py``,
  the others here, or by the test ``RUN_ELSEWHERE`` names;
- ``python fragment``, ``js fragment``, ``go fragment``: part of a program (names defined
  elsewhere): Python is compiled, JavaScript checked by ``node --check``; ``js mongosh``: a
  mongosh script (no mongosh here), checked as JavaScript;
- ``js``: run by the test ``RUN_ELSEWHERE`` names (with Node.js and a real worker);
- ``sh``: commands for a terminal: bash reads them, and every ``mtask`` and ``mtask-worker``
  command in them is parsed by mtask's own parser, so a stale command or option fails. The
  README's Quickstart is run for real, with a real ``mtask-worker``;
- ``json`` and ``yaml`` are parsed; ``text``, ``mermaid`` and a block without an info string
  are pictures and tables, not code.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import node
from pymongo import MongoClient

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
CHECKED = {
    "python",
    "python fragment",
    "js",
    "js fragment",
    "js mongosh",
    "go fragment",
    "sh",
    "json",
    "yaml",
    "text",
    "mermaid",
    "",
}
RUN_ELSEWHERE = {
    ("docs/publishing.md", "Node.js (official `mongodb` driver)"): (
        "tests/acceptance/interop/test_publishing_doc.py"
    ),
    ("docs/publishing.md", "Python without mtask (raw pymongo)"): (
        "tests/acceptance/interop/test_publishing_doc.py"
    ),
    ("docs/steps.md", "Signals from any language"): "tests/acceptance/test_steps_node.py",
    ("docs/flow-control.md", "Debounce: one run after a quiet period"): (
        "tests/integration/test_debounce_worker.py"
    ),
}
"""Blocks another test runs as written, by (page, the heading above them): each names the page
and the heading, and its test reads the block from there."""
QUICKSTART = "## Quickstart"


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    info: str
    code: str
    heading: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            before = text[: match.start()]
            headings = re.findall(r"^#+ (.+)$", before, flags=re.M)
            found.append(
                Block(
                    page=str(page.relative_to(ROOT)),
                    line=before.count("\n") + 1,
                    info=match[1].strip(),
                    code=match[2],
                    heading=headings[-1] if headings else "",
                )
            )
    return found


BLOCKS = blocks()


def of(*infos: str, readme: bool = True) -> list[Block]:
    return [b for b in BLOCKS if b.info in infos and (readme or b.page != "README.md")]


def test_every_block_says_how_it_is_checked() -> None:
    """An info string this test does not know would be a block nobody checks; a ``js`` or
    ``python`` block of a page no test runs would be a claim nothing keeps true."""
    unknown = [f"{b.where} ```{b.info}" for b in BLOCKS if b.info not in CHECKED]
    assert not unknown, unknown
    for block in of("js"):
        assert (block.page, block.heading) in RUN_ELSEWHERE, f"{block.where}: no test runs it"
    for (page, heading), test in RUN_ELSEWHERE.items():
        assert any(b.page == page and b.heading == heading for b in BLOCKS), (page, heading)
        source = (ROOT / test).read_text()
        assert Path(page).name in source and heading.split(" (")[0] in source, (test, heading)
    readme_python = of("python")
    assert len([b for b in readme_python if b.page == "README.md"]) == len(
        re.findall(r"```python\n", (ROOT / "README.md").read_text())
    )  # test_readme.py runs exactly these


@pytest.fixture
def fresh_mtask_database(
    mongo_uri: str, mongo: MongoClient[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """The examples use the default database, ``mtask``, on the test mongod."""
    monkeypatch.setenv("MTASK_MONGODB_URI", mongo_uri)
    mongo.drop_database("mtask")
    yield
    mongo.drop_database("mtask")


RUN_HERE = [b for b in of("python", readme=False) if (b.page, b.heading) not in RUN_ELSEWHERE]


@pytest.mark.usefixtures("fresh_mtask_database")
@pytest.mark.parametrize("block", RUN_HERE, ids=[b.where for b in RUN_HERE])
def test_a_python_example_runs_as_written(block: Block) -> None:
    exec(compile(block.code, block.where, "exec"), {"__name__": "__main__"})


FRAGMENTS = of("python fragment")


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.where for b in FRAGMENTS])
def test_a_python_fragment_compiles(block: Block) -> None:
    import ast

    compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


SCRIPTS = of("js", "js fragment", "js mongosh")


@pytest.mark.parametrize("block", SCRIPTS, ids=[b.where for b in SCRIPTS])
def test_a_javascript_block_is_javascript(block: Block, tmp_path: Path) -> None:
    """Checked as an ES module (top-level ``await``), without running it."""
    script = tmp_path / "block.mjs"
    script.write_text(block.code)
    checked = subprocess.run(
        [node(), "--check", str(script)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, f"{block.where}: {checked.stderr}"


@pytest.mark.parametrize("block", of("json"), ids=[b.where for b in of("json")])
def test_a_json_block_parses(block: Block) -> None:
    json.loads(block.code)


@pytest.mark.parametrize("block", of("yaml"), ids=[b.where for b in of("yaml")])
def test_a_yaml_block_parses(block: Block) -> None:
    assert yaml.safe_load(block.code) is not None


SHELL = of("sh")


def commands(code: str) -> Iterator[list[str]]:
    """Every simple command of a shell block, as words (comments, redirections and the
    operators between commands taken out)."""
    for line in code.replace("\\\n", " ").splitlines():
        yield from _commands(line)


def _commands(line: str) -> Iterator[list[str]]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.commenters = "#"
    lexer.whitespace_split = True
    words: list[str] = []
    redirect = False
    for token in lexer:
        if token in ("&&", "||", "|", ";", "&", "(", ")"):
            yield words
            words = []
        elif token in (">", ">>", "<"):
            redirect = True
        elif redirect:
            redirect = False
        else:
            words.append(token)
    yield words


def mtask_argv(words: list[str]) -> tuple[str, list[str]] | None:
    """``(program, arguments)`` of a command that runs ``mtask`` or ``mtask-worker``, after
    any ``VAR=value`` in front; None for any other command."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]
    if words and Path(words[0]).name in ("mtask", "mtask-worker"):
        return Path(words[0]).name, words[1:]
    return None


@pytest.mark.parametrize("block", SHELL, ids=[b.where for b in SHELL])
def test_a_shell_block_reads_and_its_mtask_commands_parse(block: Block) -> None:
    from mtask.cli import build_parser
    from mtask.cli.worker import build_parser as worker_parser

    bash = shutil.which("bash")
    assert bash is not None
    read = subprocess.run([bash, "-n"], input=block.code, capture_output=True, text=True)
    assert read.returncode == 0, f"{block.where}: {read.stderr}"
    for words in commands(block.code):
        found = mtask_argv(words)
        if found is None:
            continue
        program, argv = found
        parser = worker_parser() if program == "mtask-worker" else build_parser()
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"{block.where}: {shlex.join(words)} does not parse") from exc


def test_the_shell_blocks_name_mtask_commands() -> None:
    """The parse above is not vacuous: the pages' shell blocks hold many mtask commands."""
    found = [w for b in SHELL for w in commands(b.code) if mtask_argv(w) is not None]
    assert len(found) >= 15, found


def quickstart() -> tuple[str, str, str]:
    """The Quickstart's three blocks: the install line, app.py, the commands."""
    section = (ROOT / "README.md").read_text().split(QUICKSTART, 1)[1].split("\n## ", 1)[0]
    found = FENCE.findall(section)
    assert [info for info, _ in found] == ["sh", "python", "sh"], found
    return found[0][1], found[1][1], found[2][1]


def test_the_quickstart_installs_as_the_set_up_does() -> None:
    install, app, _ = quickstart()
    assert install.strip() == (
        "python3 -m venv .venv && .venv/bin/pip install -e '.[embedded,server]' "
        "&& . .venv/bin/activate"
    )  # the server extra: the quickstart ends with mtask serve
    assert app.startswith("# app.py\n")
    assert len(app.strip().splitlines()) + 5 <= 16  # about ten lines of code, and five commands


def served_at(where: Path, env: dict[str, str]) -> None:
    """``mtask serve`` as the quickstart's last line runs it (on a free port here: 8080 may be
    taken), says its address, and the dashboard answers there."""
    import httpx2 as httpx

    from mtask.embedded import free_port

    port = free_port()
    serve = subprocess.Popen(
        ["mtask", "serve", "--port", str(port)], cwd=where, env=env,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert serve.stderr is not None
        first = serve.stderr.readline()
        assert f"mtask serve: http://127.0.0.1:{port}/ (no token (loopback only))" in first, first
        for _ in range(600):
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                assert serve.poll() is None, serve.stderr.read()
                time.sleep(0.1)
        assert page.status_code == 200 and "mtask" in page.text
    finally:
        serve.terminate()
        serve.communicate(timeout=30)  # its pipe read to the end and closed


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_mtask_database")
def test_the_quickstart_runs(tmp_path: Path) -> None:
    """app.py written as shown, then the commands, in bash, with a real ``mtask-worker`` in the
    background (stopped with SIGTERM at the end, as ``kill %1`` does)."""
    _, app, session = quickstart()
    (tmp_path / "app.py").write_text(app)
    *lines, serve = session.strip().splitlines()
    assert serve.startswith("mtask serve ") and "open http://127.0.0.1:8080/" in serve, serve
    script = "set -euo pipefail\ntrap 'kill %1 2>/dev/null; wait' EXIT\n" + "\n".join(lines)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "COLUMNS": "100"}
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("created: greet-1 (greet, "), done.stdout
    served_at(tmp_path, env)  # the last line: the dashboard, where it says
    assert done.stdout.count("succeeded") >= 2, done.stdout  # wait's and get's
    assert done.stdout.count('"hello, Ada"') == 2, done.stdout
