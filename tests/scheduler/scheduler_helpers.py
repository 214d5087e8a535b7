"""Helpers shared by the scheduler tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import threading


class RecordingExecutor:
    """Records submits (thread-safe); can be told to fail."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.fail_with: Exception | None = None
        self._lock = threading.Lock()

    def submit(self, job_id: str) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        with self._lock:
            self.submitted.append(job_id)
