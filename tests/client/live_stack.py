"""A live control plane for SDK and CLI tests: uvicorn serving create_app() from a thread on a free
port, optionally with the Scheduler loop beside it, on the parametrized test database.

tests/client/conftest.py and tests/cli/conftest.py both expose `live_api` from here. Until the API
and scheduler modules exist, the fixture skips instead of failing.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from megatrain.settings import Settings, get_settings, reset_settings_cache


@dataclass
class LiveApi:
    url: str
    key: str
    settings: Settings
    data_path: Path
    """A tiny JSONL corpus inside the allowed data roots."""

    def spec(self, name: str = "tiny", **training: Any) -> dict[str, Any]:
        """A valid, very small job spec that a CPU trains in seconds."""
        return {
            "name": name,
            "model": {"arch": "llama", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                      "seq_length": 32},
            "data": {"train": [{"path": self.data_path.as_uri()}], "split": "90,10,0"},
            "training": {"train_iters": 10, "global_batch_size": 2, "micro_batch_size": 2,
                         "precision": "fp32", "log_interval": 2, "checkpoint_interval": 5,
                         "eval_interval": 0, "warmup_iters": 0, **training},
            "resources": {"gpus": 1},
        }  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_live_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, with_scheduler: bool, cpu_slots: int = 2
) -> Iterator[LiveApi]:
    pytest.importorskip("megatrain.api.app", reason="the API (megatrain.api.app) has not landed yet")
    if with_scheduler:
        pytest.importorskip("megatrain.scheduler.loop", reason="the scheduler loop has not landed yet")
    from megatrain.cli import EmbeddedStack

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data_path = data_dir / "corpus.jsonl"
    with open(data_path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n"}) + "\n")
    port = _free_port()
    monkeypatch.setenv("MEGATRAIN_API_URL", f"http://127.0.0.1:{port}")
    # The test corpus lies outside $HOME; {storage}/datasets (the demo's corpus) is allowed anyway.
    monkeypatch.setenv("MEGATRAIN_ALLOWED_DATA_ROOTS", data_dir.as_uri())
    monkeypatch.setenv("MEGATRAIN_CPU_SLOTS", str(cpu_slots))
    monkeypatch.setenv("MEGATRAIN_SCHEDULER_INTERVAL_S", "0.2")
    monkeypatch.setenv("MEGATRAIN_HEARTBEAT_INTERVAL_S", "0.5")
    reset_settings_cache()
    settings = get_settings()
    key = EmbeddedStack.prepare(settings)
    stack = EmbeddedStack(settings, "127.0.0.1", port, log_level="warning")
    stack.start_in_background(scheduler=with_scheduler)
    try:
        yield LiveApi(url=stack.url, key=key, settings=settings, data_path=data_path)
    finally:
        stack.stop()


def add_checkpoint(settings: Settings, job_id: str, step: int, payload: bytes = b"weights") -> Path:
    """Write a complete checkpoint folder for a job and its DB row, as the shard runner would."""
    from megatrain.db.models import Checkpoint
    from megatrain.db.session import session_scope
    from megatrain.storage import open_store

    store = open_store(settings.resolved_storage_url)
    prefix = f"jobs/{job_id}/checkpoints/iter_{step:07d}"
    files = {"model.safetensors": payload, "trainer_state.json": json.dumps({"step": step}).encode()}
    for name, data in files.items():
        store.put_bytes(f"{prefix}/{name}", data)
    manifest = {
        "step": step,
        "files": [
            {"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()
        ],
    }
    store.put_bytes(f"{prefix}/manifest.json", json.dumps(manifest).encode())
    store.put_bytes(f"jobs/{job_id}/checkpoints/latest", str(step).encode())
    uri = f"{store.url}/{prefix}"
    with session_scope(settings.resolved_database_url) as session:
        session.add(Checkpoint(job_id=job_id, step=step, uri=uri, size_bytes=sum(map(len, files.values()))))
    return Path(uri.removeprefix("file://"))
