from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The live-API helpers live beside the SDK tests; one copy serves both folders.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))
from live_stack import LiveApi, start_live_api  # noqa: E402


@pytest.fixture
def live_api(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    """The API on a free port, without a scheduler: submitted jobs stay queued."""
    yield from start_live_api(tmp_path, monkeypatch, with_scheduler=False)


@pytest.fixture
def live_stack(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    """The API plus the scheduler loop and local executor: submitted jobs really run."""
    yield from start_live_api(tmp_path, monkeypatch, with_scheduler=True)
