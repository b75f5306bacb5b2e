"""What an idle host of the shared stream asks the server a minute, by its parts' cadences: the
bound docs/performance.md states ("At rest"). Each cadence's calls are counted through the
store seam by its own test (``test_presence``: the heartbeat and the paused names;
``test_relay_looks``: the lease); this one adds them up, so that a part made chattier shows
here against the documented bound."""

from __future__ import annotations

from mtask.clock import KEEP_BEST
from mtask.connection.clients import WORKER_CLIENT_OPTIONS
from mtask.worker.assembly import SHARED_QUIET_EVERY
from mtask.worker.claiming import SHARED_LIMITS_REFRESH
from mtask.worker.config import WorkerConfig
from mtask.worker.finding.shared.mailbox import AWAIT_MS
from mtask.worker.finding.shared.subscription import LATE_AFTER, LOOK_EVERY
from mtask.worker.maintenance import SHARED_SCHEDULES_POLL

PER_MINUTE = 19.0
"""An idle host's commands a minute, at most (docs/performance.md, "At rest"): two thirds of
them its looks at the relay's lease, every ``LOOK_EVERY`` (a subscriber finds a relay lost with
its standby within ``LATE_AFTER`` + ``LOOK_EVERY``: 7 s)."""


def test_an_idle_host_asks_the_server_at_most_nineteen_commands_a_minute() -> None:
    beat = WorkerConfig.heartbeat_interval * SHARED_QUIET_EVERY
    monitoring = WORKER_CLIENT_OPTIONS["heartbeatFrequencyMS"] / 1000
    a_minute = {
        "heartbeat": 60 / beat,
        "paused names (read at a written beat)": 60 / beat,
        "the relay's lease (no frame within LATE_AFTER)": 60 / LOOK_EVERY,
        "limits": 60 / SHARED_LIMITS_REFRESH,
        "schedules": 60 / SHARED_SCHEDULES_POLL,
        "the inbox's tailing getMore": 60 / (AWAIT_MS / 1000),
        "the driver's monitoring (two clients, two hellos a check)": 4 * 60 / monitoring,
        "the clock's calibration (three hellos)": 3 * 60 / KEEP_BEST,
    }
    assert sum(a_minute.values()) <= PER_MINUTE, a_minute
    assert beat <= 60  # a dead idle worker leaves the list in 68 s
    assert LATE_AFTER + LOOK_EVERY <= 7  # a relay lost with its standby is left within 7 s
