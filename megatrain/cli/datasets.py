"""Dataset commands: `megatrain datasets upload|list|show|delete` only call the SDK; the operator's
`megatrain datasets share` registers a shared dataset in the database directly."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _fail, _out, _server_errors, _user_errors, app
from megatrain.client import ApiError, Client, Dataset
from megatrain.settings import get_settings

datasets_app = typer.Typer(
    help="Datasets: upload JSONL corpora, preprocessed on the workers for jobs to name."
)
app.add_typer(datasets_app, name="datasets")

F = TypeVar("F", bound=Callable[..., Any])
STATE_STYLE = {"pending": "yellow", "processing": "blue", "ready": "green", "failed": "red"}


def _dataset_errors(fn: F) -> F:
    """A refused dataset request (422) as one line per named field, not as a job spec's error."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ApiError as exc:
            if exc.status != 422 or not exc.field_errors:
                raise
            raise _fail("; ".join(f"{e['field']}: {e['message']}" for e in exc.field_errors)) from None

    return wrapper  # type: ignore[return-value]


def _state(ds: Dataset) -> str:
    return f"[{STATE_STYLE.get(ds.state, 'white')}]{ds.state}[/]"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)  # pragma: no cover


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _tokenizer(ds: Dataset) -> str:
    t = ds.tokenizer
    return t.get("type", "?") + (
        f":{t['name']}" if t.get("name") else f":{t['path']}" if t.get("path") else ""
    )


@datasets_app.command("upload")
@_user_errors
@_dataset_errors
def upload(
    source: Annotated[str, typer.Argument(help="A local JSONL file, or a storage URL (file:///…, s3://…).")],
    name: Annotated[str, typer.Option("--name", "-n", help="The dataset's name (what a JobSpec names).")],
    tokenizer: Annotated[
        str, typer.Option(help="byte, hf:URL/tokenizer.json, tiktoken:NAME or sentencepiece:URL.model")
    ] = "byte",
    json_key: Annotated[str, typer.Option(help="The JSONL field holding each document's text.")] = "text",
    append_eod: Annotated[
        bool, typer.Option(help="End each document with the end-of-document token.")
    ] = True,
    wait: Annotated[bool, typer.Option("--wait", "-w", help="Wait until the workers made it ready.")] = False,
    timeout: Annotated[float | None, typer.Option(min=0, help="With --wait: give up after SECONDS.")] = None,
    record_format: Annotated[
        str, typer.Option(help="text, or (uploads) OpenAI's chat, prompt_completion or preference records.")
    ] = "text",
) -> None:
    """Upload a JSONL corpus (or register one in storage) for the workers to preprocess."""
    with Client() as client:
        if source.startswith(("file://", "s3://")):
            if record_format != "text":
                raise typer.BadParameter(
                    "records are checked as they upload: send a local file", param_hint="--record-format"
                )
            ds = client.register_dataset(source, name, tokenizer, json_key, append_eod)
        else:
            ds = client.upload_dataset(
                Path(source), name, tokenizer, json_key, append_eod, record_format=record_format
            )
        _out().print(
            f"dataset [bold]{escape(ds.name)}[/bold] {_state(ds)} ({_size(ds.input_bytes)} uploaded)"
        )
        if wait:
            console = _out()
            with console.status(f"{ds.name}: {ds.state}") as status:

                def show(now: Dataset) -> None:
                    status.update(f"{escape(now.name)}: {_state(now)} {escape(now.state_reason)}")

                ds = client.wait_dataset(ds.name, timeout, on_update=show)
            console.print(
                f"dataset [bold]{escape(ds.name)}[/bold] {_state(ds)}: {_count(ds.documents)} documents, "
                f"{_count(ds.tokens)} tokens"
            )


@datasets_app.command("list")
@_user_errors
def list_datasets() -> None:
    """Your datasets and the shared ones."""
    with Client() as client:
        rows = client.list_datasets()
    table = Table("NAME", "STATE", "DOCUMENTS", "TOKENS", "SIZE", "TOKENIZER", "SHARED", box=None)
    for ds in rows:
        size = ds.output_bytes if ds.output_bytes is not None else ds.input_bytes
        table.add_row(
            escape(ds.name), _state(ds), _count(ds.documents), _count(ds.tokens), _size(size),
            escape(_tokenizer(ds)), "yes" if ds.shared else "",
        )  # fmt: skip
    if rows:
        _out().print(table)
    else:
        _out().print("no datasets yet: `megatrain datasets upload FILE.jsonl --name NAME`")


@datasets_app.command("show")
@_user_errors
def show(name: Annotated[str, typer.Argument(help="The dataset's name.")]) -> None:
    """A dataset's state, statistics and location."""
    with Client() as client:
        ds = client.get_dataset(name)
    table = Table(show_header=False, box=None)
    for key, value in (
        ("name", escape(ds.name)),
        ("state", _state(ds) + (f" ({escape(ds.state_reason)})" if ds.state_reason else "")),
        ("documents", _count(ds.documents)),
        ("tokens", _count(ds.tokens)),
        ("tokenizer", escape(_tokenizer(ds)) + (f" (vocab {ds.vocab_size:,})" if ds.vocab_size else "")),
        ("json key", escape(ds.json_key)),
        ("input", _size(ds.input_bytes)),
        ("output", _size(ds.output_bytes)),
        ("path", escape(ds.path)),
        ("source", escape(ds.source_url)),
        ("shared", "yes" if ds.shared else "no"),
        ("created", ds.created_at or "-"),
    ):
        table.add_row(f"[bold]{key}[/bold]", value)
    _out().print(table)


@datasets_app.command("delete")
@_user_errors
def delete(name: Annotated[str, typer.Argument(help="The dataset's name.")]) -> None:
    """Delete one of your datasets and its files."""
    with Client() as client:
        client.delete_dataset(name)
    _out().print(f"deleted dataset [bold]{escape(name)}[/bold]")


# -- operator command (talks to the database directly, like `megatrain keys create`) -------------


@datasets_app.command("share")
@_server_errors
def share(
    source: Annotated[str, typer.Argument(help="A JSONL file in storage (file:///… or s3://…).")],
    name: Annotated[str, typer.Option("--name", "-n", help="The shared dataset's name.")],
    tokenizer: Annotated[str, typer.Option(help="byte, hf:URL, tiktoken:NAME or sentencepiece:URL")] = "byte",
    json_key: Annotated[str, typer.Option(help="The JSONL field holding each document's text.")] = "text",
    append_eod: Annotated[
        bool, typer.Option(help="End each document with the end-of-document token.")
    ] = True,
) -> None:
    """Operator: register a dataset every tenant sees (read-only); the workers preprocess it."""
    from fastapi import HTTPException
    from pydantic import ValidationError

    from megatrain.api.datasets.schemas import DatasetCreate
    from megatrain.api.datasets.service import register_shared
    from megatrain.api.errors import FieldError
    from megatrain.db.audit import as_operator
    from megatrain.db.session import get_sessionmaker, upgrade_database

    settings = get_settings()
    try:
        body = DatasetCreate(
            name=name, source_url=source, tokenizer=tokenizer, json_key=json_key, append_eod=append_eod
        )
    except ValidationError as exc:
        raise _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
    upgrade_database(settings.resolved_database_url)
    with get_sessionmaker(settings.resolved_database_url)() as session:
        as_operator(session)  # its changes go in the audit log as the operator's
        try:
            ds = register_shared(session, settings, body)
        except FieldError as exc:
            raise _fail(str(exc)) from None
        except HTTPException as exc:
            raise _fail(str(exc.detail)) from None
    _out().print(
        f"shared dataset [bold]{escape(ds.name)}[/bold] registered: {ds.state} (at {escape(ds.prefix_url)})"
    )
