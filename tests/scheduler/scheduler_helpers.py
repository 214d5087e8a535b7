"""Helpers shared by the scheduler tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import threading
from typing import Any

from megatrain.db.models import Job


class RecordingExecutor:
    """Records submits (thread-safe); can be told to fail, and what to answer about runners."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.fail_with: Exception | None = None
        self.verdicts: dict[str, bool | None] = {}
        """runner_alive's answer per job id (None, "no evidence", for the others)."""
        self.refreshes = 0
        self._lock = threading.Lock()

    def submit(self, job_id: str) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        with self._lock:
            self.submitted.append(job_id)

    def refresh_nodes(self) -> None:
        self.refreshes += 1

    def runner_alive(self, job: Job) -> bool | None:
        return self.verdicts.get(job.id)

    def runner_failure(self, job: Job) -> dict[str, Any] | None:
        return None

    def worker_alive(self, host: str | None, pid: int | None) -> bool | None:
        return None

    def runner_metrics(self) -> None:
        return None
