"""Sharded checkpoints (torch.distributed.checkpoint): every rank writes and reads only its own shards,
any layout resumes from any other, saves can run in the background, and a manifest written last marks
a checkpoint complete. See folder.py for the layout in storage, shards.py for how a rank's state maps
to global tensors, dcp.py for the files, training.py for a run's state and sharded.py for one-process
readers (exports, generation, downloads)."""

from megatrain.engine.checkpoint.dcp import CheckpointMismatch, CorruptCheckpoint
from megatrain.engine.checkpoint.folder import (
    FORMAT,
    LATEST,
    MANIFEST_FILE,
    SPEC_FILE,
    STATE_FILE,
    WEIGHT_FILES,
    SavedCheckpoint,
    UnsupportedCheckpoint,
    apply_retention,
    check_files,
    complete_steps,
    find_latest,
    iter_dir,
    retained,
    to_url,
)
from megatrain.engine.checkpoint.sharded import (
    CheckpointReader,
    Folder,
    load_checkpoint,
    load_state,
    model_entries,
    open_folder,
    read_weights,
    resolve_init_from,
    save_model,
    save_state,
)

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST_FILE",
    "SPEC_FILE",
    "STATE_FILE",
    "CheckpointMismatch",
    "CheckpointReader",
    "CorruptCheckpoint",
    "Folder",
    "SavedCheckpoint",
    "UnsupportedCheckpoint",
    "WEIGHT_FILES",
    "apply_retention",
    "check_files",
    "complete_steps",
    "find_latest",
    "iter_dir",
    "load_checkpoint",
    "load_state",
    "model_entries",
    "open_folder",
    "read_weights",
    "resolve_init_from",
    "retained",
    "save_model",
    "save_state",
    "to_url",
]
