"""TensorBoard: event files written in the run folder (OUT/tensorboard/, by TensorBoard's own
EventFileWriter, whose thread writes them; one event per row) and copied next to the checkpoints,
`{storage}/jobs/{id}/tensorboard/`, every flush_interval_s and at the end, where the API offers
them for download (`megatrain tensorboard JOB`). Each attempt writes its own file; TensorBoard reads
the folder as one run, and a resumed attempt's first step hides the earlier attempt's points from
there on (a SessionLog START at that step: TensorBoard's purge, as PyTorch's purge_step writes it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megatrain.engine.tracking import RunInfo, sibling_url
from megatrain.spec_tracking import TensorBoardSpec
from megatrain.storage import Store, open_store

FOLDER = "tensorboard"
"""The event files' folder, in the run folder and beside the checkpoints alike."""
_QUEUE = 10_000
"""Events held before a write to the file is forced: flushing goes by time (flush_interval_s)."""


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, spec: TensorBoardSpec, run: RunInfo) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._session_log, self._summary, self._text = Event, SessionLog, Summary, text_pb
        self._writer_class = EventFileWriter
        self.spec = spec
        self.run = run
        self.local = run.out_dir / FOLDER
        self.local.mkdir(parents=True, exist_ok=True)
        self.mirror = _Mirror(self.local, sibling_url(run.checkpoint_url, FOLDER))
        self._writer: Any = None
        self._copied_at = time.monotonic()

    def log(self, step: int, values: dict[str, float], at: float) -> None:
        if self._writer is None:  # opened at the first point: a resumed attempt's purge step
            self._writer = self._writer_class(str(self.local), _QUEUE, self.spec.flush_interval_s)
            start = self._session_log(status=self._session_log.START)
            self._writer.add_event(self._event(step=step, wall_time=at, session_log=start))
            for part, value in self.run.config.items():
                # Markdown: an indented block keeps the JSON as it is.
                text = "\n".join("    " + line for line in json.dumps(value, indent=2).splitlines())
                summary = self._text(f"config/{part}", text)
                self._writer.add_event(self._event(step=step, wall_time=at, summary=summary))
        points = [self._summary.Value(tag=name, simple_value=value) for name, value in values.items()]
        self._writer.add_event(self._event(step=step, wall_time=at, summary=self._summary(value=points)))
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
