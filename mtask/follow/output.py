"""A run's live output, as its handler makes it: progress, log lines and output chunks.

``ctx.progress(0.42, "step 3 of 7")``, ``ctx.log.info("resized", width=640)`` and
``ctx.emit(chunk)`` put what the handler says into the run's ``RunOutput``: a buffer, safe to
call from any thread, that does no I/O. The worker's writer (``mtask.worker.running.output_writer``)
takes what it holds a few times a second and writes it under the run's fence; readers follow it
with ``mtask.follow.streams``. docs/output.md has the whole story.

Coalescing and caps are decided here:

- progress keeps only the newest value until the writer takes it, so 10,000 calls a second
  cost at most one write per flush interval, and the last value always lands (the run's final
  flush precedes its outcome);
- log lines are capped per run (``OutputLimits.max_log_lines``): past the cap one marker line
  says so and later lines are counted in ``logs_dropped``, not kept, so memory stays flat;
- chunks are never dropped below ``max_chunk_bytes_per_run``; the first chunk past it and
  every later one are counted in ``chunks_dropped``, not kept (what a reader gets is always a
  prefix of what was emitted), and one marker log line says so. One chunk is at most
  ``max_chunk_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import bson

from mtask.vocabulary import MAX_PROGRESS_LABEL

LEVELS = ("debug", "info", "warning", "error")
MAX_MESSAGE_CHARS = 8192


@dataclass(frozen=True)
class OutputLimits:
    """The caps of one run's output."""

    max_log_lines: int = 1000
    max_chunk_bytes: int = 1024 * 1024
    max_chunk_bytes_per_run: int = 64 * 1024 * 1024
    max_fields_bytes: int = 16 * 1024


DEFAULT_LIMITS = OutputLimits()


@dataclass
class Batch:
    """What the writer takes from a run at once: the newest progress (if it changed), the
    counts (if they changed) and the entries, oldest first."""

    progress: dict[str, Any] | None
    counts: dict[str, int] | None
    entries: list[dict[str, Any]]

    def __bool__(self) -> bool:
        return self.progress is not None or self.counts is not None or bool(self.entries)


def _progress(fraction: float | None, label: str | None) -> dict[str, Any]:
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float):
            raise TypeError(f"progress fraction must be a number, not {type(fraction).__name__}")
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"progress fraction must be between 0 and 1, not {fraction!r}")
        fraction = float(fraction)
    if label is not None:
        if not isinstance(label, str):
            raise TypeError(f"progress label must be a string, not {type(label).__name__}")
        label = label[:MAX_PROGRESS_LABEL]
    return {"fraction": fraction, "label": label}


class RunOutput:
    """One run's output until the writer takes it. Thread-safe; no I/O. ``wake`` is called
    (from whatever thread the handler is on) when the buffer goes from empty to not empty."""

    def __init__(
        self,
        limits: OutputLimits = DEFAULT_LIMITS,
        wake: Callable[[RunOutput], None] = lambda _: None,
        now: Callable[[], Any] | None = None,
    ) -> None:
        self.limits = limits
        self._wake = wake
        self._now = now
        self._lock = threading.Lock()
        self._progress: dict[str, Any] | None = None
        self._entries: list[dict[str, Any]] = []
        self._counts = {"logs": 0, "chunks": 0, "logs_dropped": 0, "chunks_dropped": 0}
        self._lines = 0
        """The handler's lines kept (``logs`` counts the markers too)."""
        self._counts_changed = False
        self._chunk_bytes = 0
        self._pending = False
        self.used = False
        """Something was said: the run's end flushes it and seals its output."""
        self.reported_progress = False
        self.closed = False
        """The run ended or lost its task: later calls are dropped."""
        self.log = RunLog(self)

    # -- what a handler calls ------------------------------------------------------------------

    def progress(self, fraction: float | None = None, label: str | None = None) -> None:
        value = _progress(fraction, label)
        self._put(lambda: setattr(self, "_progress", value), progress=True)

    def line(self, level: str, message: Any, fields: Mapping[str, Any]) -> None:
        if level not in LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LEVELS)}, not {level!r}")
        entry: dict[str, Any] = {"kind": "log", "level": level, "message": str(message)}
        entry["message"] = entry["message"][:MAX_MESSAGE_CHARS]
        if fields:
            clean, size = _snapshot("f", dict(fields), "log fields")
            if size > self.limits.max_fields_bytes:
                raise ValueError(
                    f"log fields are over {self.limits.max_fields_bytes} bytes as BSON"
                )
            entry["fields"] = clean

        def put() -> None:
            cap = self.limits.max_log_lines
            if self._lines < cap:  # the handler's lines: the chunks' marker is not one
                self._lines += 1
                self._add(entry, "logs")
                return
            if self._counts["logs_dropped"] == 0:
                marker = {
                    "kind": "log",
                    "level": "warning",
                    "message": f"log truncated: the cap is {cap} lines per run; later lines "
                    "are dropped (logs_dropped counts them)",
                    "fields": {"truncated": True},
                }
                self._add(marker, "logs")
            self._drop("logs_dropped")

        self._put(put)

    def emit(self, data: Any) -> None:
        data, size = _snapshot("data", data, "a chunk")
        if size > self.limits.max_chunk_bytes:
            raise ValueError(f"a chunk is at most {self.limits.max_chunk_bytes} bytes as BSON")

        def put() -> None:
            cut = self._counts["chunks_dropped"] > 0  # once cut, the stream stays a prefix
            if not cut and self._chunk_bytes + size <= self.limits.max_chunk_bytes_per_run:
                self._chunk_bytes += size
                self._add({"kind": "chunk", "data": data}, "chunks")
                return
            if self._counts["chunks_dropped"] == 0:
                cap = self.limits.max_chunk_bytes_per_run
                marker = {
                    "kind": "log",
                    "level": "warning",
                    "message": f"output truncated: the cap is {cap} bytes of chunks per run; "
                    "later chunks are dropped (chunks_dropped counts them)",
                    "fields": {"truncated": True},
                }
                self._add(marker, "logs")
            self._drop("chunks_dropped")

        self._put(put)

    # -- what the writer calls -----------------------------------------------------------------

    def take(self, max_entries: int = 500) -> Batch:
        """Everything buffered (at most ``max_entries`` entries; call again for the rest)."""
        with self._lock:
            entries = self._entries[:max_entries]
            del self._entries[:max_entries]
            counts = dict(self._counts) if self._counts_changed else None
            batch = Batch(self._progress, counts, entries)
            self._progress, self._counts_changed = None, False
            self._pending = bool(self._entries)
            return batch

    def merge(self, batch: Batch) -> None:
        """Add what a child process's own ``RunOutput`` took (its caps already applied)."""

        def put() -> None:
            if batch.progress is not None:
                self._progress = batch.progress
            if batch.counts is not None:
                self._counts, self._counts_changed = dict(batch.counts), True
            for entry in batch.entries:
                if self._now is not None and "at" not in entry:
                    entry["at"] = self._now()  # the child has no server clock: when it arrived
                self._entries.append(entry)

        if batch:
            self._put(put, progress=batch.progress is not None)

    def pending(self) -> bool:
        with self._lock:
            return self._pending

    def discard(self) -> None:
        """Forget what is buffered (a transactional body that runs again says it again)."""
        with self._lock:
            self._entries.clear()
            self._progress = None
            self._counts = dict.fromkeys(self._counts, 0)
            self._chunk_bytes, self._lines, self._counts_changed, self._pending = 0, 0, False, False

    def close(self) -> None:
        with self._lock:
            self.closed = True

    # -- inside ----------------------------------------------------------------------------------

    def _put(self, change: Callable[[], None], *, progress: bool = False) -> None:
        with self._lock:
            if self.closed:
                return
            change()
            self.used = True
            self.reported_progress = self.reported_progress or progress
            wake, self._pending = not self._pending, True
        if wake:
            self._wake(self)

    def _add(self, entry: dict[str, Any], count: str) -> None:
        if self._now is not None:
            entry["at"] = self._now()
        held = _HELD.get()
        if held is not None:  # said inside a durable step: kept until its record is written
            held.append((entry, count))
            return
        self._keep(entry, count)

    def _keep(self, entry: dict[str, Any], count: str) -> None:
        self._entries.append(entry)
        self._counts[count] += 1
        self._counts_changed = True

    def release(self, held: list[Any]) -> None:
        """What a durable step's function said (``holding``), now that the step's record is
        written: a step replayed from its record says nothing again, and one called again
        after a crash says what its new call said."""

        def put() -> None:
            for entry, count in held:
                self._keep(entry, count)

        if held:
            self._put(put)

    def _drop(self, count: str) -> None:
        self._counts[count] += 1
        self._counts_changed = True


_HELD: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "mtask_output_held", default=None
)


@contextlib.contextmanager
def holding(held: list[Any] | None) -> Iterator[None]:
    """What the code in this block says (log lines, chunks) goes into ``held`` instead of the
    run's buffer (``RunOutput.release`` adds it later); ``None``: nothing is held. The block's
    own context (its thread, its task) only: a durable step's function (``mtask.steps``)."""
    if held is None:
        yield
        return
    token = _HELD.set(held)
    try:
        yield
    finally:
        _HELD.reset(token)


@contextlib.contextmanager
def live() -> Iterator[None]:
    """What the code in this block says goes to the run's buffer at once, even inside a durable
    step's function (where it is otherwise held until the step's record is written): chunks a
    reader follows as they come, such as a model's streamed tokens. A step called again after
    a crash says them again (its earlier call's are not taken back)."""
    token = _HELD.set(None)
    try:
        yield
    finally:
        _HELD.reset(token)


_SNAPSHOT: bson.CodecOptions[dict[str, Any]] = bson.CodecOptions(tz_aware=True)


def _snapshot(name: str, value: Any, what: str) -> tuple[Any, int]:
    """``value`` as it is now, and its size as the BSON document ``{name: value}``: encoded
    (which checks it is storable) and decoded back, so what is written later is what the
    handler passed, even if it then changes it (a buffer it reuses, a field it sets to
    something BSON cannot store)."""
    try:
        encoded = bson.encode({name: value})
    except Exception as exc:  # noqa: BLE001 - what BSON refuses, said plainly
        raise TypeError(f"{what} must be storable as BSON: {exc}") from None
    return bson.decode(encoded, _SNAPSHOT)[name], len(encoded)


class RunLog:
    """``ctx.log``: structured log lines kept with the run (``ctx.log.info("resized",
    width=640)``), and ``capture()`` to keep a standard ``logging`` logger's records too."""

    def __init__(self, output: RunOutput) -> None:
        self._output = output

    def debug(self, message: Any, **fields: Any) -> None:
        self._output.line("debug", message, fields)

    def info(self, message: Any, **fields: Any) -> None:
        self._output.line("info", message, fields)

    def warning(self, message: Any, **fields: Any) -> None:
        self._output.line("warning", message, fields)

    def error(self, message: Any, **fields: Any) -> None:
        self._output.line("error", message, fields)

    @contextlib.contextmanager
    def capture(
        self, logger: str | logging.Logger = "", level: int = logging.INFO
    ) -> Iterator[None]:
        """Keep the records of ``logger`` (the root logger by default) at ``level`` and above
        with the run, while the block runs, from this thread and asyncio task only: other runs
        logging at the same time are not captured."""
        target = logging.getLogger(logger) if isinstance(logger, str) else logger
        handler = RunLogHandler(self._output, level)
        target.addHandler(handler)
        try:
            yield
        finally:
            target.removeHandler(handler)


def _task_now() -> Any:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


_LEVEL_NAMES = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warning",
    logging.ERROR: "error",
}


class RunLogHandler(logging.Handler):
    """A ``logging.Handler`` that keeps records with one run: only those emitted on the thread
    (and asyncio task) that made it."""

    def __init__(self, output: RunOutput, level: int = logging.INFO) -> None:
        super().__init__(level)
        self._output = output
        self._thread = threading.get_ident()
        self._task = _task_now()

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            record.thread == self._thread and _task_now() is self._task and super().filter(record)
        )

    def emit(self, record: logging.LogRecord) -> None:
        level = _LEVEL_NAMES.get(record.levelno, "error" if record.levelno > 40 else "debug")
        fields: dict[str, Any] = {"logger": record.name}
        if record.exc_info:
            fields["exc"] = logging.Formatter().formatException(record.exc_info)[-4000:]
        try:
            self._output.line(level, record.getMessage(), fields)
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)


@dataclass
class RecordedOutput:
    """What ``mtask.testing.run_handler`` gives back of a run's output (no MongoDB)."""

    progress: dict[str, Any] | None = None
    logs: list[dict[str, Any]] = field(default_factory=list)
    chunks: list[Any] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, output: RunOutput) -> RecordedOutput:
        recorded = cls()
        while True:
            batch = output.take()
            if batch.progress is not None:
                recorded.progress = batch.progress
            if batch.counts is not None:
                recorded.counts = batch.counts
            for entry in batch.entries:
                if entry["kind"] == "chunk":
                    recorded.chunks.append(entry["data"])
                else:
                    recorded.logs.append(entry)
            if not batch.entries:
                return recorded
