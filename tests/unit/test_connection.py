"""The clients' options: our defaults, a worker's, and the URI's word over both."""

from __future__ import annotations

import pytest

from mtask.connection.clients import WORKER_CLIENT_OPTIONS, async_client, sync_client
from mtask.errors import StorageError

URI = "mongodb://127.0.0.1:1/?directConnection=true"


def test_a_workers_clients_check_the_server_every_60_s() -> None:
    sync = sync_client(URI, defaults=WORKER_CLIENT_OPTIONS, connect=False)
    for client in (sync, async_client(URI, defaults=WORKER_CLIENT_OPTIONS, connect=False)):
        assert client.options.heartbeat_frequency == 60
        assert client.options.write_concern.document == {"w": "majority"}
        assert client.codec_options.tz_aware
    sync.close()


def test_other_clients_keep_the_drivers_10_s() -> None:
    client = sync_client(URI, connect=False)
    assert client.options.heartbeat_frequency == 10
    client.close()


def test_the_uri_wins_over_a_workers_default() -> None:
    client = sync_client(
        URI + "&heartbeatFrequencyMS=2000&w=1", defaults=WORKER_CLIENT_OPTIONS, connect=False
    )
    assert client.options.heartbeat_frequency == 2
    assert client.options.write_concern.document == {"w": 1}
    client.close()


def test_a_uri_of_another_scheme_is_refused() -> None:
    with pytest.raises(StorageError, match="must start with mongodb://"):
        sync_client("http://127.0.0.1:1", defaults=WORKER_CLIENT_OPTIONS)
