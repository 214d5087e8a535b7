"""The SDK's TensorBoard call (mixed into `Client`): a job's event files into a local folder, for
`tensorboard --logdir` (what `megatrain tensorboard JOB` runs)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

EVENT_FILE_PREFIX = "events.out.tfevents."


class TensorBoardMixin:
    if TYPE_CHECKING:  # provided by Client

        def _download_folder(self, path: str, dest: Path, marker: str = ...) -> Path: ...

    def download_tensorboard(self, job_id: str, dest: str | Path | None = None) -> Path:
        """Fetch the job's TensorBoard event files, as they stand, into the folder `dest` (default
        `{job_id}-tensorboard`); returns it. An existing `dest` is replaced only if it is empty or an
        earlier download (it holds event files). ApiError 404 while the job has none."""
        folder = Path(dest if dest is not None else f"{job_id}-tensorboard")
        # An earlier download is recognised by any event file in it (their names vary per attempt).
        earlier = sorted(folder.glob(f"{EVENT_FILE_PREFIX}*")) if folder.is_dir() else []
        marker = earlier[0].name if earlier else EVENT_FILE_PREFIX
        return self._download_folder(f"/v1/jobs/{job_id}/tensorboard", folder, marker=marker)
