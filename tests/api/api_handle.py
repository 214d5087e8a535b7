"""The `Api` handle the tests/api fixtures yield (imported by name: a module called conftest would
clash with the other test folders' when several are collected together)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from megatrain.settings import Settings

BASE_SPEC: dict[str, Any] = {
    "name": "tiny",
    "model": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "seq_length": 32},
    "data": {"train": [{"path": "PLACEHOLDER"}]},
    "training": {"train_iters": 20, "global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32"},
    "resources": {"devices": 2},
}  # fmt: skip


def write_corpus(path: Path, documents: int = 8) -> Path:
    """A tiny JSONL corpus at `path` (submission checks that data files exist)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(
            json.dumps({"text": f"document {i}: def f(x): return x + {i}"}) + "\n" for i in range(documents)
        )
    )
    return path


@dataclass
class Api:
    client: TestClient
    settings: Settings
    db_url: str
    key: str
    """Tenant 'acme'."""
    other_key: str
    """Tenant 'globex'."""
    data_root: Path
    """An allowed data root (MEGATRAIN_ALLOWED_DATA_ROOTS)."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def other_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.other_key}"}

    def spec(self, name: str = "tiny", **sections: dict[str, Any]) -> dict[str, Any]:
        """A valid spec reading from the allowed root; `sections` update its top-level parts."""
        spec = copy.deepcopy(BASE_SPEC)
        spec["name"] = name
        spec["data"]["train"][0]["path"] = (self.data_root / "corpus.jsonl").as_uri()
        for section, values in sections.items():
            if isinstance(values, dict) and isinstance(spec.get(section), dict):
                spec[section].update(values)
            else:
                spec[section] = values
        return spec

    def submit(self, spec: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        resp = self.client.post("/v1/jobs", json=spec or self.spec(), headers=self.headers, **kwargs)
        assert resp.status_code == 201, resp.text
        return resp.json()


def parse_sse(text: str) -> list[dict[str, Any]]:
    """[{"event", "id", "data"}] per event; comments (keep-alives) and retry lines are skipped."""
    events = []
    for block in text.split("\n\n"):
        fields: dict[str, Any] = {"event": "message", "id": None, "data": None}
        for line in block.splitlines():
            name, _, value = line.partition(": ")
            if name == "data":
                fields["data"] = json.loads(value)
            elif name in ("event", "id"):
                fields[name] = value
        if fields["data"] is not None:
            events.append(fields)
    return events
