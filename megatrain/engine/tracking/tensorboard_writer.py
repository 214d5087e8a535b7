"""TensorBoard: event files written in the run folder (OUT/tensorboard/, by PyTorch's SummaryWriter,
whose own thread writes them) and copied next to the checkpoints, `{storage}/jobs/{id}/tensorboard/`,
every flush_interval_s and at the end, where the API offers them for download
(`megatrain tensorboard JOB`). Each attempt writes its own file; TensorBoard reads the folder as one
run, and a resumed attempt's first step hides the earlier attempt's points from there on (purge_step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from megatrain.engine.tracking import RunInfo, sibling_url
from megatrain.spec_tracking import TensorBoardSpec
from megatrain.storage import Store, open_store

FOLDER = "tensorboard"
"""The event files' folder, in the run folder and beside the checkpoints alike."""


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, spec: TensorBoardSpec, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer_class = SummaryWriter
        self.spec = spec
        self.run = run
        self.local = run.out_dir / FOLDER
        self.local.mkdir(parents=True, exist_ok=True)
        self.mirror = _Mirror(self.local, sibling_url(run.checkpoint_url, FOLDER))
        self._writer = None
        self._copied_at = time.monotonic()

    def log(self, step: int, values: dict[str, float], at: float) -> None:
        if self._writer is None:  # opened at the first point: a resumed attempt's purge_step
            self._writer = self._writer_class(
                str(self.local), purge_step=step, flush_secs=int(self.spec.flush_interval_s)
            )
            for part, value in self.run.config.items():
                # Markdown: an indented block keeps the JSON as it is.
                text = "\n".join("    " + line for line in json.dumps(value, indent=2).splitlines())
                self._writer.add_text(f"config/{part}", text, global_step=step, walltime=at)
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step, walltime=at)
        if time.monotonic() - self._copied_at >= self.spec.flush_interval_s:
            self._writer.flush()
            self.mirror.sync()
            self._copied_at = time.monotonic()

    def close(self, ok: bool) -> None:
        if self._writer is not None:
            self._writer.close()
        self.mirror.sync()


class _Mirror:
    """Copies the files of a local folder that grew since the last copy to a storage folder (none
    where that folder is the local one: the engine on its own keeps its checkpoints beside it)."""

    def __init__(self, local: Path, url: str) -> None:
        self.local = local
        store = open_store(url)
        same = getattr(store, "root", None) == local.resolve()
        self.store: Store | None = None if same else store
        self._sizes: dict[str, int] = {}

    def sync(self) -> None:
        if self.store is None:
            return
        for path in sorted(self.local.iterdir()):
            size = path.stat().st_size if path.is_file() else -1
            if size >= 0 and self._sizes.get(path.name) != size:
                self.store.put_file(path.name, path)
                self._sizes[path.name] = size
