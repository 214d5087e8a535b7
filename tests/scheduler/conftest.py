"""Settings for the scheduling-loop tests; nodes and jobs come from `add_node` / `add_job`
(tests/fixtures/cluster.py), the executor from scheduler_helpers.RecordingExecutor."""

from __future__ import annotations

import pytest

from megatrain.settings import Settings, get_settings, reset_settings_cache


@pytest.fixture
def settings(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("MEGATRAIN_HEARTBEAT_TIMEOUT_S", "5")
    reset_settings_cache()
    return get_settings()
