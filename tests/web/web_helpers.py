"""Constants and helpers of the browser tests (a module of its own: test modules of several folders
importing `conftest` would get whichever conftest was imported first)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO_ROOT / "test-artifacts"
CHROMIUM = os.environ.get("MEGATRAIN_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


# Per page: its HTTP errors and failed requests, printed when a browser test fails (conftest).
TRACE: dict[Any, list[str]] = {}


def open_page(context: Any, errors: list[str]) -> Any:
    page = context.new_page()
    trace = TRACE.setdefault(page, [])
    page.on("response", lambda r: r.status >= 400 and trace.append(f"{r.status} {r.request.method} {r.url}"))
    page.on("requestfailed", lambda r: trace.append(f"failed {r.method} {r.url}: {r.failure}"))
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))

    def console(msg: Any) -> None:
        # HTTP errors the tests provoke on purpose (401, 404, 422) are logged by Chromium itself.
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            errors.append(f"console: {msg.text}")

    page.on("console", console)
    return page


def signed_in_page(context: Any, errors: list[str], base_url: str, key: str, route: str) -> Any:
    """A page at `{base_url}/#{route}`, signed in with `key` on the sign-in form it shows first."""
    page = open_page(context, errors)
    page.goto(f"{base_url}/#{route}")
    page.fill("#api-key", key)
    page.click("button[type=submit]")
    # Signed in once the form is gone: a test's next goto must not race the sign-in's own route
    # (the MoE dashboard test once stayed on the jobs list it had asked to leave).
    page.wait_for_selector("#api-key", state="detached")
    return page
