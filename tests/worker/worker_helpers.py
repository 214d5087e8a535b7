"""Helpers shared by the worker tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatrain.worker.procs import pid_alive


def job_spec(train_iters: int = 20, checkpoint_interval: int = 5, max_runtime_s: int = 120) -> dict[str, Any]:
    return {
        "name": "fake",
        "data": {"train": [{"path": "file:///dev/null"}]},
        "training": {
            "train_iters": train_iters,
            "log_interval": 1,
            "checkpoint_interval": checkpoint_interval,
            "global_batch_size": 4,
            "micro_batch_size": 1,
            "warmup_iters": 0,
        },
        "resources": {"max_runtime_s": max_runtime_s},
    }


def wait_for(pred: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def environ_of(pid: int) -> dict[str, str]:
    """Process `pid`'s environment as /proc shows it."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def alive(pid: int) -> bool:
    return pid_alive(pid)


def add_row(settings: Any, model: type, **values: Any) -> str:
    """Insert a row of `model` (e.g. a pending CheckpointExport or CheckpointSample); its id."""
    from megatrain.db.session import session_scope

    with session_scope(settings.resolved_database_url) as s:
        row = model(**values)
        s.add(row)
        s.flush()
        return str(row.id)


def get_row(settings: Any, model: type, ident: str) -> Any:
    """The row of `model` with id `ident`, detached from its session."""
    from megatrain.db.session import session_scope

    with session_scope(settings.resolved_database_url) as s:
        row = s.get(model, ident)
        s.expunge(row)
        return row
