"""Registered-model commands: `megatrain models register|list|show|delete` only call the SDK; the
operator's `megatrain models share` registers a shared model in the database directly."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from megatrain.cli.common import _fail, _out, _server_errors, _user_errors, app
from megatrain.cli.datasets import _dataset_errors
from megatrain.client import Client, RegisteredModel
from megatrain.settings import get_settings

models_app = typer.Typer(
    help="Models: Hugging Face folders registered under a name, for `model.init_from: hf:NAME`."
)
app.add_typer(models_app, name="models")


def _summary(m: RegisteredModel) -> str:
    layers = f"{m.num_layers} layer" + ("s" if m.num_layers != 1 else "")
    text = f"{m.model_type}, {layers}, hidden {m.hidden_size}, vocab {m.vocab_size:,}"
    if m.kind == "adapter" and m.adapter:
        text = f"a LoRA adapter (rank {m.adapter['rank']}, {', '.join(m.adapter['targets'])}) over {text}"
    return text


def _type(m: RegisteredModel) -> str:
    return m.model_type + ("+lora" if m.kind == "adapter" else "")  # an adapter over a model of that type


@models_app.command("register")
@_user_errors
@_dataset_errors
def register(
    url: Annotated[str, typer.Argument(help="The model folder: file:///…, s3://… or /abs/path.")],
    name: Annotated[str, typer.Option("--name", "-n", help="What a JobSpec names: hf:NAME.")],
    base: Annotated[
        str | None,
        typer.Option("--base", help="A PEFT LoRA adapter folder: the registered model it was trained on."),
    ] = None,
) -> None:
    """Register a Hugging Face model folder (config.json + safetensors), or a PEFT LoRA adapter
    folder over a registered model (--base), under a name."""
    with Client() as client:
        m = client.register_model(name, url, base)
    ref = escape(f"hf:{m.name}")
    _out().print(f"model [bold]{escape(m.name)}[/bold] registered: {_summary(m)} (init_from: {ref})")


@models_app.command("list")
@_user_errors
def list_models() -> None:
    """Your registered models and the shared ones."""
    with Client() as client:
        rows = client.models()
    if not rows:
        _out().print("no models yet: `megatrain models register URL --name NAME`")
        return
    table = Table("NAME", "TYPE", "LAYERS", "HIDDEN", "HEADS", "VOCAB", "SEQ", "SHARED", box=None)
    table.columns[0].overflow = "fold"
    for m in rows:
        heads = m.fields.get("num_attention_heads", "-")
        table.add_row(
            escape(m.name), escape(_type(m)), str(m.num_layers), str(m.hidden_size), str(heads),
            f"{m.vocab_size:,}", str(m.seq_length), "yes" if m.shared else "",
        )  # fmt: skip
    _out().print(table)


@models_app.command("show")
@_user_errors
def show(name: Annotated[str, typer.Argument(help="The model's name.")]) -> None:
    """A registered model's folder and the model fields its config.json gives a job."""
    with Client() as client:
        m = client.get_model(name)
    table = Table(show_header=False, box=None)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # a long URL wraps rather than losing its end
    rows = [("name", escape(m.name)), ("url", escape(m.url)), ("model type", escape(m.model_type))]
    rows += [(f"model.{k}", escape(str(v))) for k, v in m.fields.items() if v is not None]
    rows += [("shared", "yes" if m.shared else "no"), ("created", m.created_at or "-")]
    for key, value in rows:
        table.add_row(f"[bold]{key}[/bold]", value)
    _out().print(table)


@models_app.command("delete")
@_user_errors
def delete(name: Annotated[str, typer.Argument(help="The model's name.")]) -> None:
    """Forget one of your models (the folder stays; submitted jobs keep the URL they resolved)."""
    with Client() as client:
        client.delete_model(name)
    _out().print(f"deleted model [bold]{escape(name)}[/bold]")


@models_app.command("share")
@_server_errors
def share(
    url: Annotated[str, typer.Argument(help="The model folder: file:///…, s3://… or /abs/path.")],
    name: Annotated[str, typer.Option("--name", "-n", help="The shared model's name.")],
) -> None:
    """Operator: register a model every tenant sees (read-only); talks to the database directly."""
    from fastapi import HTTPException
    from pydantic import ValidationError

    from megatrain.api.errors import FieldError
    from megatrain.api.models.schemas import ModelCreate
    from megatrain.api.models.service import register_shared
    from megatrain.db.audit import as_operator
    from megatrain.db.session import get_sessionmaker, upgrade_database

    settings = get_settings()
    try:
        body = ModelCreate(name=name, url=url)
    except ValidationError as exc:
        raise _fail("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
    upgrade_database(settings.resolved_database_url)
    with get_sessionmaker(settings.resolved_database_url)() as session:
        as_operator(session)  # its changes go in the audit log as the operator's
        try:
            m = register_shared(session, settings, body)
        except FieldError as exc:
            raise _fail(str(exc)) from None
        except HTTPException as exc:
            raise _fail(str(exc.detail)) from None
    _out().print(f"shared model [bold]{escape(m.name)}[/bold] registered at {escape(m.url)}")
