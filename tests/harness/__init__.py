"""The one test harness: workers in the test's event loop or as processes, replica sets,
faults (signals, proxies), waits on events and on MongoDB's state, hand-written documents, the
CLI in-process, and what a test needs from the machine. One module per concern; import from
``harness``."""

from .cli import run_cli
from .commands import Commands
from .documents import T0, hand_written, in_groups, pad_to_the_limit
from .events import Events, clear_of_a_window_end, poll, until_finished, wait_for
from .examples import on_a_server
from .inloop import drained, running_worker, until_recorded
from .machine import need_proc, node, required
from .overlap import peak
from .pages import BACKGROUND, DESKTOP, EVERY_LOOK, PHONE, kept, looks, sign_in, signed_in
from .processes import (
    CHAOS,
    MTASK_ROOT,
    STOP_WITHIN,
    TESTS,
    Cluster,
    dead,
    gone,
    parent_of,
    process_state,
    spawn_worker,
    stop_process,
    tree_env,
    worker_process,
)
from .proxies import Proxies
from .replicaset import ReplicaSet, replica_set_with_workers
from .sse import server_sent
from .stall import stall_report
from .streams import change_streams, count_streams, kill_change_streams

__all__ = [
    "BACKGROUND",
    "CHAOS",
    "DESKTOP",
    "EVERY_LOOK",
    "MTASK_ROOT",
    "PHONE",
    "STOP_WITHIN",
    "T0",
    "TESTS",
    "Cluster",
    "Commands",
    "Events",
    "Proxies",
    "ReplicaSet",
    "change_streams",
    "clear_of_a_window_end",
    "count_streams",
    "dead",
    "drained",
    "gone",
    "hand_written",
    "in_groups",
    "kept",
    "kill_change_streams",
    "looks",
    "need_proc",
    "node",
    "on_a_server",
    "pad_to_the_limit",
    "parent_of",
    "peak",
    "poll",
    "process_state",
    "replica_set_with_workers",
    "required",
    "run_cli",
    "running_worker",
    "server_sent",
    "sign_in",
    "signed_in",
    "spawn_worker",
    "stall_report",
    "stop_process",
    "tree_env",
    "until_finished",
    "until_recorded",
    "wait_for",
    "worker_process",
]
