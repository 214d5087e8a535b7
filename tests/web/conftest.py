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
from web_helpers import CHROMIUM, CHROMIUM_ARGS


@pytest.fixture
def browser_context(tmp_path: Path) -> Iterator[Any]:
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
        context.set_default_timeout(20_000)
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page_errors() -> list[str]:
    """Uncaught exceptions and console errors of the pages a test opened (should stay empty)."""
    return []
