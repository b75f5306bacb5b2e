"""A stored traceback as a person reads it (pure; display only: the task keeps it whole).

A handler's failure is stored as Python formats it, and most of its frames are mtask's own:
``invoke``, ``run_outcomes``, and inside ``ctx.step`` the journal's plumbing (11 of 12 frames
for a failing step). ``fold`` keeps the user's frames as they are and folds each run of
mtask's frames into one part, as pytest and Celery hide their own: the task page shows the
folded runs behind ``<details>``, ``mtask get --traceback`` as one line each. ``origin`` is the
innermost frame that is not mtask's: where the error came from in the user's code.

A frame is mtask's when its file is a module of the installed ``mtask`` package, found by its
path below a ``mtask/`` directory (a worker on another host has its own prefix:
``/usr/lib/python3/site-packages/mtask/steps.py`` and ``/src/mtask/steps.py`` are both
``steps.py`` of mtask), a file in one of its sub-packages (another version's module), a
module that became a sub-package (another version's ``steps.py``, now ``steps/``), or
anything in an installed ``site-packages/mtask/``. A user's file in a directory named
``mtask`` is not folded unless it has the path of one of mtask's modules.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import mtask

FRAME = re.compile(r'^(?P<indent>\s*)File "(?P<file>.+)", line (?P<line>\d+), in (?P<fn>.+)$')


@functools.cache
def mtask_modules() -> frozenset[str]:
    """The paths of the installed package's modules, below its directory (``steps.py``,
    ``worker/running/invoke.py``, …)."""
    root = Path(mtask.__file__).parent
    return frozenset(p.relative_to(root).as_posix() for p in root.rglob("*.py"))


@functools.cache
def mtask_packages() -> frozenset[str]:
    """The package's sub-packages (``worker``, ``store``, …): a module another version of
    mtask had there (``worker/run_outcomes.py``) is mtask's too."""
    return frozenset(m.split("/")[0] for m in mtask_modules() if "/" in m)


FORMER_MODULES = frozenset(
    f"{name}.py"
    for name in (
        "aftercommit",
        "backoff",
        "batches",
        "connection",
        "control",
        "encryption",
        "events",
        "limits",
        "output",
        "parallel",
        "preflight",
        "preflight_sandbox",
        "read_tokens",
        "roles",
        "signal_fate",
        "slots",
        "snooze",
        "sockets",
        "spawn",
        "states",
        "step_policy",
        "streams",
        "tracebacks",
        "waiters",
        "wording",
    )
)
"""Top-level modules of earlier versions that now live in packages: a traceback stored by a
worker of such a version names them, and they are mtask's frames still."""


def is_mtask_file(path: str) -> bool:
    seen = path.replace("\\", "/")
    marker = seen.rfind("/mtask/")
    if marker < 0:
        return False
    if seen[:marker].endswith(("site-packages", "dist-packages")):
        return True
    inside = seen[marker + len("/mtask/") :]
    top = inside.split("/")[0]
    return (
        inside in mtask_modules()
        or inside in FORMER_MODULES
        or top.removesuffix(".py") in mtask_packages()
    )


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    text: tuple[str, ...]
    """The frame as printed: its ``File …`` line and the source lines under it."""
    mtask: bool

    @property
    def base(self) -> str:
        """The file's name without its directory."""
        return self.file.replace("\\", "/").rsplit("/", 1)[-1]

    @property
    def where(self) -> str:
        """``app.py:32 in sometimes``."""
        return f"{self.base}:{self.line} in {self.function}"

    @property
    def short(self) -> str:
        """``steps._run_async`` for mtask's frames: the module and the function."""
        return f"{self.base.removesuffix('.py')}.{self.function}"


@dataclass(frozen=True)
class Part:
    """Lines of text (a header, the exception), one frame of the user's, or a run of mtask's
    own frames folded together."""

    kind: str  # "text", "frame" or "folded"
    lines: tuple[str, ...] = ()
    frames: tuple[Frame, ...] = ()

    @property
    def summary(self) -> str:
        """A folded run in one line: ``8 mtask frames: registry.step → … → steps._run_async``."""
        names = [f.short for f in self.frames]
        shown = names if len(names) <= 3 else [names[0], "…", names[-1]]
        noun = "frame" if len(names) == 1 else "frames"
        return f"{len(names)} mtask {noun}: {' → '.join(shown)}"


@dataclass(frozen=True)
class Folded:
    parts: tuple[Part, ...]
    exception: str
    """The error's last line (``RuntimeError: upstream 503``)."""
    origin: Frame | None = None
    """The innermost frame that is not mtask's, if the traceback has frames."""
    folded: int = 0
    """How many of mtask's frames are folded."""


def _frames(lines: list[str]) -> list[Part]:
    parts: list[Part] = []
    i = 0
    while i < len(lines):
        found = FRAME.match(lines[i])
        if found is None:
            parts.append(Part("text", (lines[i],)))
            i += 1
            continue
        indent = len(found["indent"])
        body = [lines[i]]
        i += 1
        while i < len(lines) and _under(lines[i], indent):
            body.append(lines[i])
            i += 1
        frame = Frame(
            found["file"],
            int(found["line"]),
            found["fn"],
            tuple(body),
            is_mtask_file(found["file"]),
        )
        parts.append(Part("frame", frames=(frame,)))
    return parts


def _under(line: str, indent: int) -> bool:
    """Whether ``line`` belongs to the frame above it (a source line, a caret line)."""
    stripped = line.lstrip()
    return bool(stripped) and len(line) - len(stripped) > indent and not FRAME.match(line)


def _fold(parts: list[Part]) -> list[Part]:
    out: list[Part] = []
    for part in parts:
        mine = part.kind == "frame" and part.frames[0].mtask
        if mine and out and out[-1].kind == "folded":
            out[-1] = Part("folded", frames=(*out[-1].frames, *part.frames))
        elif mine:
            out.append(Part("folded", frames=part.frames))
        else:
            out.append(part)
    return out


def fold(text: str | None) -> Folded:
    """``text`` (a stored error: a traceback, or one line) with mtask's frames folded."""
    lines = (text or "").rstrip().splitlines()
    parts = _fold(_frames(lines))
    frames = tuple(f for p in parts for f in p.frames)
    users = [f for f in frames if not f.mtask]
    exception = next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
    return Folded(tuple(parts), exception, users[-1] if users else None, len(frames) - len(users))


def folded_text(text: str | None) -> str:
    """The traceback as text with each run of mtask's frames on one line, for a terminal."""
    out: list[str] = []
    for part in fold(text).parts:
        if part.kind == "folded":
            indent = re.match(r"\s*", part.frames[0].text[0])
            out.append(f"{indent[0] if indent else '  '}[{part.summary}]")
        else:
            out.extend(part.lines or [line for f in part.frames for line in f.text])
    return "\n".join(out)
