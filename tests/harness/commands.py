"""The commands a MongoDB client sends, by name, as a command listener hears them (what a start
asks, counted without timing it)."""

from __future__ import annotations

from pymongo import monitoring


class Commands(monitoring.CommandListener):
    """The commands a client sent, in order: ``find tasks`` (a command on a collection: its
    name), ``hello``."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        name, on = event.command_name, event.command.get(event.command_name)
        self.sent.append(f"{name} {on}" if isinstance(on, str) else name)

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        pass

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass
