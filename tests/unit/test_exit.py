"""``mtask.cli.exit_unhindered``: a command's process ends without PyMongo's exit hook, which
joins the driver's monitor threads (they sleep 0.5 s at a time), and with every other hook;
nor do the collector's final passes walk what it loaded (``gc.freeze``).
If PyMongo renames its hook, the first test fails: the workaround would have stopped working."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import atexit
import pymongo.synchronous.monitor as monitor
monitor._shutdown_monitors = lambda: print("pymongo's hook ran")  # what the hook calls
monitor._shutdown_executors = lambda: None
atexit.register(print, "another hook ran")
{call}
"""


def hooks_run(call: str) -> list[str]:
    probe = PROBE.format(call=call)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_pymongos_exit_hook_is_left_out_and_the_others_run() -> None:
    assert hooks_run("") == ["another hook ran", "pymongo's hook ran"]  # the probe probes
    called = hooks_run("from mtask.cli import exit_unhindered\nexit_unhindered()")
    assert called == ["another hook ran"]


def test_without_pymongo_loaded_it_does_nothing_else() -> None:
    code = "from mtask.cli import exit_unhindered\nexit_unhindered()\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_what_the_process_loaded_is_left_to_the_interpreters_end() -> None:
    """The collector's final passes at exit skip what was loaded (``gc.freeze``)."""
    code = (
        "import gc\nfrom mtask.cli import exit_unhindered\nexit_unhindered()\n"
        "print(gc.get_freeze_count() > 1000)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
