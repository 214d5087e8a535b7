"""OpenAIErrorMiddleware on its own (a bare app with our exception handlers): every error answer under
the prefix in OpenAI's shape and status, whichever layer produced it; other paths untouched."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from megatrain.api.errors import FieldError, install_error_handlers
from megatrain.api.openai.errors import OpenAIErrorMiddleware, openai_error


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(OpenAIErrorMiddleware, prefix="/openai/v1")

    for prefix in ("/openai/v1", "/v1"):

        @app.get(f"{prefix}/field")
        def field() -> None:
            raise FieldError("training_file", "training_file names no file")

        @app.get(f"{prefix}/typed")
        def typed(n: int) -> None: ...

        @app.get(f"{prefix}/busy")
        def busy() -> None:
            raise openai_error(429, "slow down", retry_after="7")

        @app.get(f"{prefix}/plain")
        def plain() -> None:
            raise HTTPException(409, "taken")

        @app.get(f"{prefix}/boom")
        def boom() -> None:
            raise RuntimeError("internal detail that must not leak")

        @app.get(f"{prefix}/fine")
        def fine() -> dict[str, Any]:
            return {"ok": True}

    return TestClient(app, raise_server_exceptions=False)


def _error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


def test_our_errors_become_openais(client: TestClient) -> None:
    err = _error(client.get("/openai/v1/field"), 400)  # a 422 of ours: OpenAI's 400
    assert err == {"message": "training_file names no file", "type": "invalid_request_error",
                   "param": "training_file", "code": "invalid_value"}  # fmt: skip
    assert _error(client.get("/openai/v1/typed?n=x"), 400)["param"] == "n"
    busy = client.get("/openai/v1/busy")
    assert _error(busy, 429) == {"message": "slow down", "type": "requests", "param": None,
                                 "code": "rate_limit_exceeded"}  # fmt: skip
    assert busy.headers["retry-after"] == "7"
    assert _error(client.get("/openai/v1/plain"), 409)["code"] == "conflict"
    boom = _error(client.get("/openai/v1/boom"), 500)
    assert boom["type"] == "server_error" and "internal detail" not in boom["message"]
    assert _error(client.get("/openai/v1/nowhere"), 404)["type"] == "invalid_request_error"
    assert client.get("/openai/v1/fine").json() == {"ok": True}


def test_other_paths_keep_their_shape(client: TestClient) -> None:
    assert client.get("/v1/field").json() == {
        "detail": [{"field": "training_file", "message": "training_file names no file"}]
    }
    assert client.get("/v1/plain").json() == {"detail": "taken"}
    assert client.get("/v1/boom").status_code == 500 and client.get("/v1/boom").json() == {
        "detail": "internal server error"
    }
