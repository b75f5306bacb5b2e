"""The ``mtask`` command line run in-process, its output captured."""

from __future__ import annotations

import contextlib
import io

from rich.console import Console

from mtask.cli import common, main


def run_cli(*argv: str, width: int = 80) -> tuple[int, str, str]:
    """``mtask …`` in-process with its consoles ``width`` columns wide: the exit status, what it
    printed (``--json`` included: it writes to ``sys.stdout``) and its stderr."""
    out, err = io.StringIO(), io.StringIO()
    saved = common.out._console, common.err._console
    common.out._console = Console(file=out, width=width, highlight=False)
    common.err._console = Console(file=err, width=width, highlight=False)
    try:
        with contextlib.redirect_stdout(out):
            code = main(list(argv))
    finally:
        common.out._console, common.err._console = saved
    return code, out.getvalue(), err.getvalue()
