"""Engine fixtures: a tiny deterministic corpus that trains in about a second."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import write_corpus


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus.jsonl")
