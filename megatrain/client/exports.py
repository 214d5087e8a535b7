"""The SDK's export calls (mixed into `Client`): export a checkpoint to Hugging Face format on the
workers, follow it, and download the ready folder (config.json + safetensors + the tokenizer files;
a LoRA job's adapter form: adapter_config.json + adapter_model.safetensors + the tokenizer files)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatrain.client.models import Export
from megatrain.client.polling import TaskFailed, poll_until_done

if TYPE_CHECKING:
    import httpx


class ExportFailed(TaskFailed):
    """The workers could not export the checkpoint; `export.error` says why."""

    def __init__(self, export: Export):
        super().__init__(export, "export")
        self.export = export


class ExportsMixin:
    if TYPE_CHECKING:  # provided by Client

        def _json(self, method: str, path: str, **kwargs: Any) -> Any: ...
        def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response: ...
        def _download_folder(self, path: str, dest: Path, marker: str = ...) -> Path: ...

    def export(
        self,
        job_id: str,
        step: int | None = None,
        dtype: str = "bf16",
        wait: bool = False,
        timeout_s: float | None = None,
        poll_interval_s: float = 1.0,
        form: str = "model",
    ) -> Export:
        """Export the checkpoint at `step` (the latest when None) to Hugging Face format in `dtype`
        (bf16 or fp32): `form` model, the whole model (a LoRA job's with its adapters merged in), or
        adapter, a LoRA job's adapters as PEFT's folder (ApiError 422 naming `form` for a job that
        trained every weight). Returns at once with the export (pending, or the earlier one for the
        same step, form and dtype), or with `wait=True` once it is ready (ExportFailed if it failed)."""
        body = {"step": step, "format": "hf", "form": form, "dtype": dtype}
        exp = Export.from_dict(self._json("POST", f"/v1/jobs/{job_id}/exports", json=body))
        return self.wait_export(job_id, exp.id, timeout_s, poll_interval_s) if wait else exp

    def exports(self, job_id: str) -> list[Export]:
        """The job's exports, oldest first."""
        return [Export.from_dict(r) for r in self._json("GET", f"/v1/jobs/{job_id}/exports")]

    def get_export(self, job_id: str, export_id: str) -> Export:
        return Export.from_dict(self._json("GET", f"/v1/jobs/{job_id}/exports/{export_id}"))

    def wait_export(
        self, job_id: str, export_id: str, timeout_s: float | None = None, poll_interval_s: float = 1.0
    ) -> Export:
        """Poll until the export is ready (returned) or failed (ExportFailed); TimeoutError past timeout_s."""
        return poll_until_done(
            lambda: self.get_export(job_id, export_id),
            ExportFailed,
            what=f"export {export_id}",
            timeout_s=timeout_s,
            poll_interval_s=poll_interval_s,
        )

    def download_export(self, job_id: str, export_id: str, dest: str | Path | None = None) -> Path:
        """Fetch a ready export into the folder `dest` (default `{job_id}-iter_{step:07d}-{dtype}`,
        `…-adapter` for an adapter); returns it. `AutoModelForCausalLM.from_pretrained(dest)` loads a
        model, `peft.PeftModel.from_pretrained(base, dest)` an adapter. An existing `dest` is
        replaced only if it is empty or an earlier folder of the same form (holds its config file)."""
        exp = self.get_export(job_id, export_id)
        if dest is None:
            suffix = "-adapter" if exp.form == "adapter" else ""
            dest = f"{job_id}-iter_{exp.step:07d}-{exp.dtype}{suffix}"
        path = f"/v1/jobs/{job_id}/exports/{export_id}/download"
        return self._download_folder(path, Path(dest), marker=exp.marker)
