"""A real headless Chromium (Debian's `chromium`, installed by `make install`) driven by Playwright, for the page
tests: the page as a user gets it, with its JavaScript, its streamed previews and its errors."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

# Records what the page shows while a request runs: progress values and preview images come and go quickly.
WATCH = """() => {
  window.seen = {progress: [], previews: 0};
  new MutationObserver(() => {
    for (const bar of document.querySelectorAll('.card progress')) window.seen.progress.push([bar.value, bar.max]);
    window.seen.previews = Math.max(window.seen.previews, document.querySelectorAll('.card img.preview[src]').length);
  }).observe(document.getElementById('results'), {subtree: true, childList: true, attributes: true,
                                                   characterData: true});
}"""


@contextlib.contextmanager
def browser_page(width: int = 1200, height: int = 900) -> Iterator:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is missing: `make install` installs it"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def result_size(page) -> tuple[int, int]:
    """(width, height) of the first finished image on the page, waiting for it."""
    page.wait_for_selector(".card img.result", timeout=120_000)
    return tuple(page.eval_on_selector(".card img.result", "img => [img.naturalWidth, img.naturalHeight]"))


def fits_a_phone(page) -> bool:
    return page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
