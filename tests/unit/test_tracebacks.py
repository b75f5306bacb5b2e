"""``mtask.explain.tracebacks``: a stored traceback with mtask's own frames folded, the user's
frames as they are, and where in the user's code the error came from; any text folds without
raising and loses none of the user's lines."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given

from mtask.explain.tracebacks import fold, folded_text, is_mtask_file

# the review's flaky step on main cd15378: 11 of 12 frames are mtask's (an older layout too)
STEP_FAILURE = """Traceback (most recent call last):
  File "/tmp/ux4/repo/mtask/worker/run_outcomes.py", line 240, in _run
    result = await invoke(
             ^^^^^^^^^^^^^
  File "/tmp/ux4/repo/mtask/worker/invoke.py", line 69, in invoke
    return await limited(handler.fn(*args), ctx, soft, hard, "async")
  File "/tmp/ux4/repo/mtask/worker/invoke.py", line 85, in limited
    return await call
  File "/tmp/ux4/app/ux4app.py", line 35, in flaky_step
    return await ctx.step("call_upstream", sometimes)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/tmp/ux4/repo/mtask/registry.py", line 157, in step
    return await self.journal.step(name, fn, *args, transactional=transactional, **kwargs)
  File "/tmp/ux4/repo/mtask/steps.py", line 231, in step
    return await self._run_async(self._one(self._step(name, lambda: fn(*args, **kw))))
  File "/tmp/ux4/repo/mtask/steps.py", line 276, in _run_async
    need = plan.throw(error) if error is not None else plan.send(value)
  File "/tmp/ux4/repo/mtask/steps.py", line 265, in _one
    value = yield from plan
  File "/tmp/ux4/repo/mtask/steps.py", line 423, in _step
    result = yield Invoke(call)
  File "/tmp/ux4/repo/mtask/steps.py", line 286, in _run_async
    value = await value
  File "/tmp/ux4/app/ux4app.py", line 32, in sometimes
    raise RuntimeError("upstream 503")
RuntimeError: upstream 503"""


def test_mtask_frames_fold_and_the_users_stay() -> None:
    folded = fold(STEP_FAILURE)
    assert folded.exception == "RuntimeError: upstream 503"
    assert folded.origin is not None and folded.origin.where == "ux4app.py:32 in sometimes"
    assert folded.folded == 9
    kinds = [p.kind for p in folded.parts]
    assert kinds == ["text", "folded", "frame", "folded", "frame", "text"]
    assert (
        folded.parts[1].summary
        == "3 mtask frames: run_outcomes._run → invoke.invoke → invoke.limited"
    )
    assert folded.parts[3].summary == "6 mtask frames: registry.step → … → steps._run_async"
    text = folded_text(STEP_FAILURE)
    assert text.splitlines() == [
        "Traceback (most recent call last):",
        "  [3 mtask frames: run_outcomes._run → invoke.invoke → invoke.limited]",
        '  File "/tmp/ux4/app/ux4app.py", line 35, in flaky_step',
        '    return await ctx.step("call_upstream", sometimes)',
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        "  [6 mtask frames: registry.step → … → steps._run_async]",
        '  File "/tmp/ux4/app/ux4app.py", line 32, in sometimes',
        '    raise RuntimeError("upstream 503")',
        "RuntimeError: upstream 503",
    ]


def test_which_files_are_mtasks() -> None:
    assert is_mtask_file("/usr/lib/python3/site-packages/mtask/steps.py")
    assert is_mtask_file("/src/mtask/worker/running/invoke.py")
    assert is_mtask_file(r"C:\venv\Lib\site-packages\mtask\anything.py")
    assert is_mtask_file("/old/mtask/worker/run_outcomes.py")  # another version's module
    assert is_mtask_file("/old/mtask/steps.py")  # another version's module, now a package
    for moved in ("spawn.py", "parallel.py", "output.py", "step_policy.py", "control.py"):
        assert is_mtask_file(f"/src/mtask/{moved}")  # a module of an earlier version's top level
    assert not is_mtask_file("/home/ann/mtask/app.py")  # the user's own mtask/ directory
    assert not is_mtask_file("/home/ann/app.py")


def test_chained_errors_and_one_liners() -> None:
    chained = (
        "Traceback (most recent call last):\n"
        '  File "/app/a.py", line 3, in f\n'
        "    x()\n"
        "KeyError: 'k'\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "/site-packages/mtask/steps.py", line 9, in step\n'
        "    f()\n"
        '  File "/app/a.py", line 5, in g\n'
        "    raise ValueError('v')\n"
        "ValueError: v"
    )
    folded = fold(chained)
    assert folded.exception == "ValueError: v" and folded.folded == 1
    assert folded.origin is not None and folded.origin.where == "a.py:5 in g"
    assert "During handling of the above exception" in folded_text(chained)
    assert fold("failed: width must be positive").exception == "failed: width must be positive"
    assert fold(None).parts == () and fold("").exception == ""


LINES = st.lists(
    st.one_of(
        st.text(max_size=20).filter(lambda t: "\n" not in t and "\r" not in t),
        st.builds(
            lambda path, fn: f'  File "{path}", line 3, in {fn}',
            st.sampled_from(["/a/mtask/steps.py", "/b/app.py", "/c/mtask/x.py"]),
            st.sampled_from(["f", "g"]),
        ),
        st.just("    code()"),
    ),
    max_size=12,
)


@given(LINES)
def test_any_text_folds_and_keeps_every_line_outside_mtasks_frames(lines: list[str]) -> None:
    text = "\n".join(lines)
    folded = fold(text)
    shown = folded_text(text).splitlines()
    kept = [
        line
        for part in folded.parts
        if part.kind != "folded"
        for line in (part.lines or [ln for f in part.frames for ln in f.text])
    ]
    assert [ln for ln in shown if not ln.strip().startswith("[")] == [
        ln for ln in kept if not ln.strip().startswith("[")
    ]
    assert folded.folded == sum(len(p.frames) for p in folded.parts if p.kind == "folded")
