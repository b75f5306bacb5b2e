"""The relay's mode: one named state, held by ``relay.Relay``, and its transitions.

::

                 stream open, its own worker alone
      STARTING ─────────────────────────────────────▶ ALONE
          │                                           │  ▲
          │ stream open, other subscribers   another  │  │ its own worker alone
          │ (or none)                     subscriber  ▼  │ again
          └─────────────────────────────────────────▶ HANDING

      any ──── its lease lost (or it was stopped) ───▶ STOPPED

- ``STARTING``: the relay holds the lease; its stream has not opened yet. It passes nothing on
  and hands nothing out: a subscriber that says hello waits for ``OPEN`` or ``OWN``.
- ``ALONE``: its own worker (in its process) is its only subscriber: one worker, a small
  deployment's common case. The relay passes that worker its task events (``wire.OWN``, then
  the events), and the worker finds its own work as with an own stream: so it does not pay for
  the wire. The host queue is idle (it holds nothing and scans nothing), and the stream leaves
  that worker's claims and successes out, as an own stream does.
- ``HANDING``: the host queue holds every subscriber's tasks and the dispatcher hands each due
  one to one subscriber (``wire.OPEN`` to each). The stream shows every subscriber's claims and
  successes.
- ``STOPPED``: it lost its lease (another holds it), or its worker stops: its subscribers are
  let go, and its worker, no longer its to follow, follows the relay that holds the lease.

Every transition does its work in one place (``Relay._enter``). Into ``ALONE``: the dispatcher
forgets what it handed out, the host queue idles, and the worker is told ``OWN`` (it scans).
Into ``HANDING``: the host queue activates (a scan at once) and every subscriber is told
``OPEN``. A reopened stream enters its mode again (every reopen rescans: the worker's, or the
host queue's). The stream's filter follows the mode from its next event (``Position.switch``:
resumed after the last event, no rescan).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from mtask.worker.finding.shared.channels import LocalChannel, SubscriberChannel


class RelayMode(enum.Enum):
    STARTING = "starting"
    ALONE = "alone"
    HANDING = "handing"
    STOPPED = "stopped"


def mode_for(subscribers: Mapping[SubscriberChannel, str], owner: str) -> RelayMode:
    """The mode of an open relay whose worker is ``owner``, with these subscribers (their
    channels and worker ids)."""
    if len(subscribers) == 1:
        [(channel, worker_id)] = subscribers.items()
        if isinstance(channel, LocalChannel) and worker_id == owner:
            return RelayMode.ALONE
    return RelayMode.HANDING
