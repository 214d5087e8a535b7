"""The API's own documentation pages, /docs (Swagger UI) and /redoc (ReDoc), from assets we serve.

FastAPI's defaults load both from a CDN and Google Fonts, so the pages were blank on a machine
without internet access. The assets are vendored under web/vendor/ (served with the dashboard).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse

SWAGGER_JS = "/vendor/swagger-ui/swagger-ui-bundle.js"
SWAGGER_CSS = "/vendor/swagger-ui/swagger-ui.css"
REDOC_JS = "/vendor/redoc/redoc.standalone.js"
# The dashboard's own icon (web/index.html), inline: no request for it at all.
FAVICON = (
    "data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 16 16'%3E%3Cpath "
    "d='M1 14 L5 6 L9 10 L15 2' stroke='%234f6bed' stroke-width='2.5' fill='none'/%3E%3C/svg%3E"
)
OAUTH2_REDIRECT = "/docs/oauth2-redirect"


def install_docs(app: FastAPI) -> None:
    """Add /docs, its OAuth2 redirect and /redoc to `app`, created with docs_url=redoc_url=None."""
    openapi_url = app.openapi_url or "/openapi.json"
    title = app.title

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{title} · API docs",
            swagger_js_url=SWAGGER_JS,
            swagger_css_url=SWAGGER_CSS,
            swagger_favicon_url=FAVICON,
            oauth2_redirect_url=OAUTH2_REDIRECT,
        )

    @app.get(OAUTH2_REDIRECT, include_in_schema=False)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{title} · Reference",
            redoc_js_url=REDOC_JS,
            redoc_favicon_url=FAVICON,
            with_google_fonts=False,
        )
