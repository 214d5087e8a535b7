"""Checkpoint commands: list a job's checkpoints and exports, and export one to Hugging Face format.

`megatrain export JOB[@STEP] --to DEST` asks the API to export (the workers write the folder into the
server's storage, `{storage}/jobs/JOB/exports/hf/iter_STEP-DTYPE/`), waits for it, then downloads
it into DEST: a local folder, or a file:// / s3:// URL, which this command uploads the download to
with the caller's own storage credentials (the server writes exports solely into its own storage
layout; it never writes where a client names). A LoRA job exports its model with the adapters merged
in (the default, `--merged`), or with `--adapter` its adapters alone as PEFT's folder
(`…/iter_STEP-DTYPE-adapter/`). SDK only, like the other job commands.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _fail, _out, _user_errors, app
from megatrain.client import ApiError, Client
from megatrain.storage import StorageError, Store, open_store

ADAPTER_CONFIG = "adapter_config.json"

DTYPES = ("bf16", "fp32")
FLAGS = {"form": "--adapter", "dtype": "--dtype", "step": "JOB@STEP"}
"""The command-line spelling of each export request field, for the API's 422s."""


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):  # noqa: B007 - the last unit reached is the one shown
        value /= 1024
        if value < 1024:
            break
    return f"{value:,.1f} {unit}"


def _when(text: str | None) -> str:
    return (text or "")[:19].replace("T", " ")


def parse_target(target: str) -> tuple[str, int | None]:
    """JOB or JOB@STEP -> (job id, step or None for the latest)."""
    job_id, at, step = target.partition("@")
    if not job_id or (at and not step.isdigit()):
        raise _fail(f"{target!r} is not JOB or JOB@STEP (STEP a non-negative integer)")
    return job_id, int(step) if at else None


@app.command()
@_user_errors
def checkpoints(job_id: Annotated[str, typer.Argument(help="Job id.")]) -> None:
    """List a job's checkpoints (step, size, when saved) and its exports."""
    with Client() as client:
        cps = client.checkpoints(job_id)
        exports = client.exports(job_id)
        empty = "" if cps else client.get_job(job_id).no_checkpoints
    out = _out()
    if not cps:
        out.print(empty)
    else:
        table = Table(box=None, header_style="bold")
        for col in ("STEP", "SIZE", "SAVED"):
            table.add_column(col, justify="right" if col != "SAVED" else "left")
        for cp in cps:
            table.add_row(str(cp.step), _size(cp.size_bytes), _when(cp.created_at))
        out.print(table)
    if exports:
        table = Table(box=None, header_style="bold", title="exports", title_justify="left")
        for col in ("EXPORT", "STEP", "FORM", "DTYPE", "STATUS", "SIZE", "CREATED", "WHERE"):
            table.add_column(col)
        for e in exports:
            status = e.status + (f": {escape(e.error)}" if e.status == "failed" and e.error else "")
            where = escape(e.uri or "")
            table.add_row(
                e.id, str(e.step), e.form, e.dtype, status, _size(e.size_bytes), _when(e.created_at), where
            )
        out.print(table)


def _load_hint(dest: Path) -> str:
    if (dest / ADAPTER_CONFIG).is_file():
        return _adapter_hint(dest)
    lines = [
        "load it with transformers:",
        "  from transformers import AutoModelForCausalLM",
        f"  model = AutoModelForCausalLM.from_pretrained({str(dest)!r})",
    ]
    if (dest / "tokenizer.json").is_file():
        lines += [
            "  from transformers import AutoTokenizer",
            f"  tokenizer = AutoTokenizer.from_pretrained({str(dest)!r})",
        ]
    return "\n".join(lines)


def _adapter_hint(dest: Path) -> str:
    try:
        base = json.loads((dest / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except ValueError:
        base = None
    load = f"from_pretrained({base!r})" if base else "from_pretrained(BASE)  # the model the job started from"
    return "\n".join(
        [
            "load it with peft, on its base model:",
            "  from peft import PeftModel",
            "  from transformers import AutoModelForCausalLM",
            f"  base = AutoModelForCausalLM.{load}",
            f"  model = PeftModel.from_pretrained(base, {str(dest)!r})",
        ]
    )


@app.command("export")
@_user_errors
def export_command(
    target: Annotated[
        str, typer.Argument(metavar="JOB[@STEP]", help="Job id, and the step (default: latest).")
    ],
    to: Annotated[
        str, typer.Option("--to", help="Local folder, file:// or s3:// URL to put the exported model in.")
    ],
    dtype: Annotated[str, typer.Option(help="Weights dtype: bf16 or fp32.")] = "bf16",
    adapter: Annotated[
        bool,
        typer.Option(
            "--adapter",
            help="A LoRA job's adapters alone, as PEFT's folder (adapter_config.json + "
            "adapter_model.safetensors), for peft.PeftModel.from_pretrained on its base model.",
        ),
    ] = False,
    merged: Annotated[
        bool,
        typer.Option(
            "--merged", help="The whole model, a LoRA job's with its adapters merged in (the default)."
        ),
    ] = False,
    timeout: Annotated[float | None, typer.Option(help="Give up waiting after this many seconds.")] = None,
) -> None:
    """Export a checkpoint to Hugging Face format (config.json + safetensors) and download it; a LoRA
    job's with its adapters merged in, or with --adapter its adapters alone (PEFT's folder)."""
    job_id, step = parse_target(target)
    if dtype not in DTYPES:
        raise _fail(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if adapter and merged:
        raise _fail("--adapter and --merged exclude each other: choose one")
    form, marker = ("adapter", ADAPTER_CONFIG) if adapter else ("model", "config.json")
    store = None
    if "://" in to:
        try:
            store = open_store(to)  # an unsupported scheme fails before the export starts
        except StorageError as exc:
            raise _fail(f"--to {to}: {exc}") from None
        if store.list() and not store.exists(marker):
            kind = "an adapter" if adapter else "a model"
            raise _fail(f"--to {to} holds objects that are not {kind} folder: give an empty prefix")
    dest = Path(to)
    out = _out()
    with Client() as client:
        try:
            exp = client.export(job_id, step=step, dtype=dtype, form=form)
        except ApiError as exc:
            if exc.status != 422 or not exc.field_errors:
                raise
            # A refused field, in this command's own spelling: one line, no traceback.
            raise _fail(
                "; ".join(f"{FLAGS.get(e['field'], e['field'])}: {e['message']}" for e in exc.field_errors)
            ) from None
        what = f"{dtype}, adapter" if adapter else dtype
        out.print(
            f"exporting step {exp.step} of job {job_id} ({what}) as export [bold]{exp.id}[/bold]: "
            f"{exp.status}"
        )
        exp = client.wait_export(job_id, exp.id, timeout_s=timeout, poll_interval_s=0.5)
        out.print(
            f"export ready in the server's storage at {escape(exp.uri or '?')} ({_size(exp.size_bytes)})"
        )
        if store is None:
            path = client.download_export(job_id, exp.id, dest)
        else:
            with tempfile.TemporaryDirectory(prefix="megatrain-export-") as tmp:
                _upload(client.download_export(job_id, exp.id, Path(tmp) / "model"), store, marker)
            out.print(f"uploaded to [bold]{escape(to)}[/bold]")
            return
    out.print(f"downloaded to [bold]{escape(str(path))}[/bold]")
    out.print(escape(_load_hint(path)))


def _upload(folder: Path, store: Store, marker: str = "config.json") -> None:
    """A downloaded folder into `store`, replacing an earlier one of its form there; `marker`
    (config.json, an adapter's adapter_config.json) last, as the workers write it: a prefix holding
    it is complete."""
    files = sorted((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.name == marker)
    for stale in {o.key for o in store.list()} - {p.name for p in files}:  # e.g. another shard count
        store.delete_prefix(stale)
    if store.exists(marker):  # incomplete until the new one is written, last
        store.delete_prefix(marker)
    for path in files:
        store.put_file(path.name, path)
