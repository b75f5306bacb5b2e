"""Server-sent events as a client reads them, line by line (``text/event-stream``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator


def server_sent(lines: Iterable[str]) -> Iterator[dict[str, str] | str]:
    """Each event of the stream's ``lines`` as its fields (``event``, ``id``, ``data``), once
    the blank line ends it; each comment line (``: open``, ``: keep-alive``) as itself."""
    block: dict[str, str] = {}
    for line in lines:
        if line == "":
            if block:
                yield block
            block = {}
        elif line.startswith(":"):
            yield line
        else:
            field, _, value = line.partition(":")
            block[field] = value.removeprefix(" ")
