"""The export task: turn a job's checkpoint into a Hugging Face model folder in storage.

`export_checkpoint(export_id, settings)` is thin and idempotent like the preprocessing task: it
claims a `pending` export (→ running; any other state means another delivery has it), reads the
checkpoint `{storage}/jobs/{job_id}/checkpoints/iter_{step:07d}` one full tensor at a time and
writes it with the engine's `export_checkpoint_hf` (shard by shard, config.json last) into
`{storage}/{CheckpointExport.folder_key}` (jobs/{job_id}/exports/hf/iter_{step:07d}-{dtype}), with
the job's tokenizer as files transformers loads (interop.hf_tokenizer: tokenizer.json for every kind,
tokenizer_config.json with the fine-tune's chat template, special_tokens_map.json; a tokenizer that
cannot be written so that it encodes as ours fails the export with that reason). A LoRA job's model
is written with its adapters merged in (interop.lora_export); its `adapter` form is PEFT's folder
(adapter_model.safetensors, the same tokenizer files, adapter_config.json last) in `…-adapter`.
It then marks the export `ready` with the folder's URL and size, or `failed` with the reason after
removing what it wrote. A heartbeat keeps `heartbeat_at` fresh so the scheduler can tell a lost
worker from a slow one (scheduler.exports).

CLI: `python -m megatrain.worker.exports --export-id ID` (what the local executor spawns).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from megatrain.db.models import ADAPTER_FORM, FAILED, MODEL_FORM, READY
from megatrain.settings import Settings
from megatrain.storage import StorageError, open_store, split_url
from megatrain.worker.checkpoint_tasks import (
    checkpoint_folder,
    claim_row,
    fail,
    heartbeating,
    task_link,
    task_main,
)

log = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "folder_size", "main"]


def _run_export(source: str, dest: str, dtype: str, endpoint_url: str | None, form: str = MODEL_FORM) -> None:
    """The engine's reader and exporter (imported here: only a worker needs torch). A LoRA job's
    model is exported with its adapters merged in; its adapter form is PEFT's folder."""
    import torch

    from megatrain.engine.checkpoint import CheckpointReader
    from megatrain.engine.interop.hf import export_checkpoint_hf
    from megatrain.engine.interop.lora_export import export_checkpoint_adapter

    spec = CheckpointReader(source).spec  # the spec the job trained with (its tokenizer, its LoRA)
    tokenizer = _tokenizer(spec)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    if form == ADAPTER_FORM:
        export_checkpoint_adapter(
            source,
            dest,
            base_model=_base_model(spec.model.init_from),
            dtype=torch_dtype,
            tokenizer_files=tokenizer.files,
        )
        return
    export_checkpoint_hf(
        source,
        dest,
        dtype=torch_dtype,
        tokenizer_files=tokenizer.files,
        extra_config=tokenizer.special_ids,
    )


def _base_model(init_from: str | None) -> str | None:
    """adapter_config.json's base_model_name_or_path: the Hugging Face folder the job started from (a
    local path where it is one, so that PEFT's AutoPeftModel can load it), else the checkpoint it
    started from, for the record; None for a job that started from random weights."""
    if not init_from:
        return None
    url = init_from.removeprefix("hf:")
    return url.removeprefix("file://") if url.startswith("file://") else url


def _tokenizer(spec: Any) -> Any:
    """The job's tokenizer files and special ids (eos = the end-of-document token the job's documents
    ended with, so transformers' generate() stops where the model learned to), with the chat
    template a fine-tune (or preference job) rendered its chats with."""
    from megatrain.engine.data.chat_templates import load_chat_template
    from megatrain.engine.interop.hf_tokenizer import export_tokenizer

    chats = spec.kind in ("finetune", "dpo")
    template = load_chat_template(spec.data.chat_template).source if chats else None
    return export_tokenizer(
        spec.data.tokenizer, chat_template=template, model_max_length=spec.model.seq_length
    )


ExportFn = Callable[[str, str, str, "str | None", str], None]
"""(checkpoint URL, folder URL, dtype, S3 endpoint, form)."""


def export_checkpoint(export_id: str, settings: Settings, export_fn: ExportFn | None = None) -> str | None:
    """Run a pending export; its final status (ready/failed), or None if it was not pending
    (another delivery ran it), was deleted meanwhile, or was taken over by a newer attempt."""
    link = task_link(settings)
    claimed = claim_row(link, "export", export_id)
    if claimed is None:
        return None
    attempt, exp = claimed
    storage = settings.resolved_storage_url.rstrip("/")
    source, dest = checkpoint_folder(storage, exp.job_id, exp.step), f"{storage}/{exp.folder_key}"
    started = time.monotonic()
    with heartbeating(settings, link, "export", export_id, attempt):
        try:
            _remove(dest, settings)  # what an earlier, lost attempt left behind
            (export_fn or _run_export)(source, dest, exp.dtype, settings.s3_endpoint_url, exp.form)
            size = folder_size(dest, settings)
            if link.finish("export", export_id, attempt, READY, uri=dest, size_bytes=size, error=""):
                log.info(
                    "export %s ready: %s (%d bytes, %.1fs)", export_id, dest, size, time.monotonic() - started
                )
                return READY
            return None  # taken over (judged lost) or deleted: the newer attempt or nobody owns dest
        except Exception as exc:  # every failure is the export's reason, never a lost worker
            log.warning("export %s failed: %s", export_id, exc)
            if not fail(link, "export", export_id, attempt, exc):
                return None  # a newer attempt owns the folder now: leave it alone
            _remove(dest, settings)  # a failed export keeps no objects
            return FAILED


def folder_size(folder_url: str, settings: Settings) -> int:
    parent, name = split_url(folder_url)
    return sum(
        o.size
        for o in open_store(parent, settings.s3_endpoint_url).list(name)
        if o.key.startswith(name + "/")
    )


def _remove(folder_url: str, settings: Settings) -> None:
    parent, name = split_url(folder_url)
    try:
        open_store(parent, settings.s3_endpoint_url).delete_prefix(name)
    except StorageError as exc:
        log.warning("could not delete %s: %s", folder_url, exc)


def main(argv: list[str] | None = None) -> None:
    task_main("megatrain.worker.exports", __doc__, "export-id", export_checkpoint, argv)


if __name__ == "__main__":
    main()
