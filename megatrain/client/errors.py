"""Exceptions the SDK raises; the CLI turns each into one red line and a non-zero exit code."""

from __future__ import annotations

from typing import Any


class MegatrainError(Exception):
    """Base of every error the SDK raises on purpose."""


class SpecFileError(MegatrainError):
    """A spec file that cannot be read or is not a YAML/JSON mapping."""


class ApiError(MegatrainError):
    """The API answered with an error status; `detail` is its body's `detail` (a string or a list).

    422 details are lists of {"field", "message"}; str() names every field so a user sees what to fix.
    """

    def __init__(self, status: int, detail: Any, sent_key: str | None = None):
        self.status = status
        self.detail = detail
        self.sent_key = sent_key
        """On a 401: which key the client sent and where it came from (`SentKey.describe`)."""
        super().__init__(self._describe())

    @property
    def field_errors(self) -> list[dict[str, str]]:
        """The [{"field", "message"}] entries of a validation error; empty for other errors."""
        if not isinstance(self.detail, list):
            return []
        out = []
        for item in self.detail:
            if isinstance(item, dict):
                # FastAPI's own request validation uses `loc`/`msg`; ours uses `field`/`message`.
                loc = item.get("field") or ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                out.append({"field": loc or "spec", "message": str(item.get("message", item.get("msg", "")))})
            else:
                out.append({"field": "spec", "message": str(item)})
        return out

    @property
    def fields(self) -> list[str]:
        return [e["field"] for e in self.field_errors]

    def _describe(self) -> str:
        if self.status == 422 and isinstance(self.detail, list):
            parts = "; ".join(f"{e['field']}: {e['message']}" for e in self.field_errors)
            return f"invalid request (HTTP 422): {parts}"
        if self.status == 401:
            sent = f" ({self.sent_key})" if self.sent_key else ""
            return f"not authenticated (HTTP 401): {self.detail or 'missing or invalid API key'}{sent}"
        return f"HTTP {self.status}: {self.detail}"


class ApiUnreachable(ApiError):
    """No HTTP answer at all (connection refused, DNS failure, timeout)."""

    def __init__(self, url: str, reason: str):
        self.url = url
        self.reason = reason
        super().__init__(0, f"cannot reach the megatrain API at {url} ({reason})")

    def _describe(self) -> str:
        return str(self.detail)
