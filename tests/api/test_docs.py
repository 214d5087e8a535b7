"""/docs and /redoc (megatrain/api/docs.py) load nothing from another host, and the OpenAPI document
they render is whole: every $ref names a schema it has (ReDoc renders nothing otherwise)."""

from __future__ import annotations

import json
import re

import pytest
from api_handle import Api

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


def test_docs_pages_load_their_assets_from_this_server(api: Api) -> None:
    for route, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        page = api.client.get(route)
        assert page.status_code == 200
        urls = re.findall(r"""(?:src|href)=["']([^"']+)""", page.text)
        assert urls and not [u for u in urls if u.startswith(("http:", "https:", "//"))], urls
        [script] = [u for u in urls if u.endswith(asset)]
        assert api.client.get(script).status_code == 200
    assert api.client.get("/docs/oauth2-redirect").status_code == 200


def test_every_openapi_reference_resolves(api: Api) -> None:
    document = api.client.get("/openapi.json").json()
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(document)))
    assert "DatasetCreate" in refs and "JobSpec" in refs
    assert refs <= set(document["components"]["schemas"]), refs - set(document["components"]["schemas"])
