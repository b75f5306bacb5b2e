"""The dashboard in a browser (Playwright's, on the ``browser`` fixture): a page signed in per
look (colour scheme and size), and a page's look checked and kept as a screenshot."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
SIZES = {"desktop": DESKTOP, "phone": PHONE}
EVERY_LOOK = (("dark", "desktop"), ("dark", "phone"), ("light", "desktop"), ("light", "phone"))
"""Each colour scheme at each size, for ``looks``."""
BACKGROUND = {"dark": "rgb(11, 17, 32", "light": "rgb(248, 250, 252"}
"""The page's background in each colour scheme (the start of its computed ``rgb(…)``)."""
COPIES = Path("/tmp/shots")
"""Where a person looks at the screenshots."""


def sign_in(page: Any, url: str, token: str) -> None:
    page.goto(url + "/")
    page.fill("#token", token)
    page.click("form.login button[type=submit]")
    page.wait_for_selector("#counts")


@contextlib.contextmanager
def signed_in(
    browser: Any, url: str, token: str, scheme: str, size: str, *, js: bool = False
) -> Iterator[Any]:
    """A page of its own in ``scheme`` at ``size``, without JavaScript unless ``js``, signed
    in, its waits 30 s at most; closed after."""
    context = browser.new_context(viewport=SIZES[size], color_scheme=scheme, java_script_enabled=js)
    try:
        page = context.new_page()
        page.set_default_timeout(30_000)
        sign_in(page, url, token)
        yield page
    finally:
        context.close()


def looks(
    browser: Any, url: str, token: str, *which: tuple[str, str]
) -> Iterator[tuple[str, str, dict[str, int], Any]]:
    """For each ``(scheme, size)`` of ``which``, a page ``signed_in`` as
    ``(scheme, size, viewport, page)``."""
    for scheme, size in which:
        with signed_in(browser, url, token, scheme, size) as page:
            yield scheme, size, SIZES[size], page


def kept(page: Any, out: Path, name: str, scheme: str, size: str, viewport: dict[str, int]) -> None:
    """The page has the scheme's background and no horizontal scroll; its full-page screenshot
    is kept in ``out`` (``name-size-scheme.png``) and copied to ``COPIES``."""
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background.startswith(BACKGROUND[scheme]), (scheme, background)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= viewport["width"], (size, width)
    shot = out / f"{name}-{size}-{scheme}.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 5_000
    COPIES.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, COPIES / shot.name)
