"""Which files of an engine checkpoint folder a weights-only copy holds. Torch-free, so the API and
the SDK can filter a download by it without importing the engine."""

from __future__ import annotations

WEIGHT_FILES = ("model_", "metadata.json", "trainer_state.json", "spec.json", "manifest.json")
"""Name prefixes of what a weights-only copy of a checkpoint holds (a download without the
optimizer state, whose files are state_*.bin)."""


def is_weight_file(name: str) -> bool:
    """Whether a file (its path relative to the checkpoint folder) belongs in a weights-only copy."""
    return name.startswith(WEIGHT_FILES)
