"""A real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright) against a live API.

Chromium gets a fresh profile and every flag that keeps it off the network it cannot reach. The
tests are skipped, with the reason, where Playwright or Chromium is missing; CI installs both.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from web_helpers import CHROMIUM, CHROMIUM_ARGS, TRACE


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


CALL_FAILED = pytest.StashKey[bool]()


def describe_pages(context: Any) -> str:
    """What each open page shows: its address, the banner and the start of its main text (a failed
    wait says only that it timed out; this says what the page showed instead)."""
    out = []
    for page in context.pages:
        try:
            banner = page.evaluate("document.getElementById('banner')?.innerText || ''")
            main = page.evaluate("document.querySelector('main')?.innerText || ''")
            out.append(f"page {page.url}\n  banner: {banner!r}\n  main: {main[:1500]!r}")
            out.extend(f"  {line}" for line in TRACE.get(page, [])[-30:])
        except Exception as exc:  # a closed or crashed page
            out.append(f"page {page.url}: {exc}")
    return "\n".join(out)


@pytest.fixture
def browser_context(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A Playwright browser context on Chromium with a fresh user-data-dir, downloads allowed."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    profile = tmp_path / "chromium-profile"
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile),
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_ARGS,
            accept_downloads=True,
            viewport={"width": 1280, "height": 900},
        )
        # Generous: CI runs these beside the soak, whose two nodes keep both cores busy (a chart took
        # 21 s to draw there, 2 s on an idle machine).
        context.set_default_timeout(60_000)
        try:
            yield context
            if request.node.stash.get(CALL_FAILED, False):
                print(describe_pages(context))
        finally:
            for page in context.pages:
                TRACE.pop(page, None)
            context.close()


@pytest.fixture
def page_errors() -> list[str]:
    """Uncaught exceptions and console errors of the pages a test opened (should stay empty)."""
    return []
