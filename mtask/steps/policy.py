"""A durable step's own policy: its retries with a backoff, and its time limit, spent
in place by the run that calls it, without the task's retry budget.

``await ctx.step("fetch", fetch, url, policy=StepPolicy(retries=3, backoff=0.5, timeout=10))``
calls ``fetch`` up to four times in this run, waiting 0.5 s, 1 s, 2 s between the tries (each
backoff doubles up to ``max_backoff``); a try that runs past ``timeout`` seconds fails with
``StepTimeout``. Every try is noted in the step's ``tries``; the step's record is written once,
after its last try (``done``, or ``failed`` with the last error, which then takes the task's
retry policy as any step's failure does). The run holds its slot while it waits: a long wait
belongs in ``ctx.sleep``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtask.errors import InvalidTask, MtaskError

MAX_RETRIES = 100
MAX_BACKOFF = 300.0
"""The longest wait between two tries, in seconds: past it, a wait belongs in ``ctx.sleep``."""


class StepTimeout(MtaskError):
    """A step's try ran past its policy's ``timeout``."""

    default_message = "the step took longer than its timeout"


@dataclass(frozen=True)
class StepPolicy:
    """``retries`` more tries after a failure (0: none), the first ``backoff`` seconds after
    it, each next one ``factor`` times longer, at most ``max_backoff``; ``timeout``: the most
    seconds one try may take (``None``: no limit)."""

    retries: int = 0
    backoff: float = 1.0
    factor: float = 2.0
    max_backoff: float = 60.0
    timeout: float | None = None

    def __post_init__(self) -> None:
        """``InvalidTask`` naming the field that is out of range."""
        retries = self.retries
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
            raise InvalidTask(f"must be a whole number from 0 to {MAX_RETRIES}", field="retries")
        for label, value in (("backoff", self.backoff), ("max_backoff", self.max_backoff)):
            if not _number(value) or not 0 <= value <= MAX_BACKOFF:
                raise InvalidTask(f"must be from 0 to {MAX_BACKOFF:g} seconds", field=label)
        if not _number(self.factor) or not 1 <= self.factor <= 100:
            raise InvalidTask("must be from 1 to 100", field="factor")
        if self.timeout is not None and (not _number(self.timeout) or not self.timeout > 0):
            raise InvalidTask("must be a positive number of seconds", field="timeout")

    def delay(self, failed: int) -> float:
        """How long to wait after the ``failed``-th failed try."""
        return float(min(self.max_backoff, self.backoff * self.factor ** (failed - 1)))


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


NO_POLICY = StepPolicy()
"""One try, no time limit: a step without a policy."""
