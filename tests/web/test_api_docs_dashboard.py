"""The footer's "API docs" (/docs, Swagger UI) and "Reference" (/redoc, ReDoc) in a real Chromium
with every request off this machine refused: both render the API's operations from assets the
package serves (megatrain/api/docs.py, web/vendor/), not from a CDN."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
from fixtures.live import LiveApi
from web_helpers import open_page

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.parametrize("db_url", ["sqlite"], indirect=True),
]

REDOCLY_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


def _offline_page(context: Any, errors: list[str], refused: list[str]) -> Any:
    """A page whose requests to anywhere but this machine fail (and are recorded)."""

    def route(r: Any) -> None:
        host = urlsplit(r.request.url).hostname
        if r.request.url.startswith("data:") or host == "127.0.0.1":
            r.continue_()
        else:
            refused.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    return open_page(context, errors)


def test_api_docs_and_reference_render_offline(
    live_api: LiveApi, browser_context: Any, page_errors: list[str]
) -> None:
    refused: list[str] = []
    page = _offline_page(browser_context, page_errors, refused)
    page.goto(f"{live_api.url}/")
    page.click("footer a:text-is('API docs')")
    page.wait_for_url("**/docs")
    # Swagger UI's operation blocks, one per route: /v1/jobs among them.
    page.wait_for_selector(".opblock")
    paths = page.locator(".opblock-summary-path").all_inner_texts()
    assert "/v1/jobs" in [p.replace("\u200b", "") for p in paths], paths[:10]

    page.goto(f"{live_api.url}/")
    page.click("footer a:text-is('Reference')")
    page.wait_for_url("**/redoc")
    # ReDoc's sections per operation (ids "tag/TAG/operation/NAME"), the submission among them.
    page.wait_for_selector("[data-section-id*='operation/']")
    assert page.locator("[data-section-id*='operation/']").count() > 10
    assert "Submit" in page.locator("body").inner_text()
    # The one request off this machine: ReDoc's "API docs by Redocly" logo, built into its bundle,
    # which hides itself when it cannot load.
    assert set(refused) <= {REDOCLY_LOGO}, refused
    assert page_errors == []
