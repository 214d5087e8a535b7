"""Registered models: a Hugging Face model folder under a name, for `model.init_from: hf:NAME`.

Registering only checks and records (nothing is copied or preprocessed): the tenant may read the
folder (the data-access rule), its config.json maps onto our model (megatrain.hf_config), and the
weights the engine loads are there. A tenant sees its own models and the shared ones (tenant_id
NULL, registered by the operator); another tenant's model is the same 404 as a missing one.
Submission resolves the name to its URL (api/jobs/hf_init), so deleting a model never affects a job.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from megatrain.api.errors import FieldError
from megatrain.api.jobs.data_access import DataUrlError, data_url_problem, normalise_data_url
from megatrain.api.jobs.hf_init import hf_folder_url, read_hf_config
from megatrain.api.models.schemas import ModelCreate, ModelPublic
from megatrain.api.registry import find_named, get_named, list_named
from megatrain.db.models import RegisteredModel, Tenant, new_id
from megatrain.hf_config import HFConfigError, model_fields_from_hf
from megatrain.peft_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_settings
from megatrain.settings import Settings
from megatrain.spec import SpecError
from megatrain.storage import StorageError, open_store

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
"""What the engine loads (engine/interop/hf.py): one safetensors file, or a sharded set's index."""


def public_model(m: RegisteredModel) -> ModelPublic:
    f = m.fields
    return ModelPublic(
        id=m.id,
        name=m.name,
        shared=m.tenant_id is None,
        url=m.url,
        model_type=m.model_type,
        arch=f["arch"],
        num_layers=f["num_layers"],
        hidden_size=f["hidden_size"],
        vocab_size=f["vocab_size"],
        seq_length=f["seq_length"],
        fields=f,
        kind=m.kind or "model",
        base_url=m.base_url,
        adapter=m.adapter,
        created_at=m.created_at,
    )


def get_model(session: Session, tenant: Tenant, name: str) -> RegisteredModel:
    return get_named(session, RegisteredModel, tenant, name, "model")


def list_models(session: Session, tenant: Tenant) -> list[RegisteredModel]:
    """The tenant's models and the shared ones, by name (own before shared for equal names)."""
    return list_named(session, RegisteredModel, tenant)


def _folder_url(raw: str) -> str:
    """`raw` (file:///…, s3://…, or /abs/path) normalised as the data-access rule compares it."""
    url = hf_folder_url(f"hf:{raw}") or raw
    try:
        return normalise_data_url(url)
    except DataUrlError as exc:
        raise FieldError("url", f"url={raw!r} {exc}") from None


def inspect_folder(settings: Settings, tenant_name: str | None, raw_url: str) -> tuple[str, dict[str, Any]]:
    """(normalised URL, config.json); FieldError on `url` for a folder the tenant may not read
    (`tenant_name` None: the operator, who may name any folder), a config.json that is missing or
    that we cannot build, or no weights the engine can load."""
    url = _folder_url(raw_url)
    try:
        config = read_hf_config(url, settings, tenant_name or "", "url", check_access=tenant_name is not None)
    except SpecError as exc:
        raise FieldError("url", exc.errors[0]["message"]) from None
    try:
        model_fields_from_hf(config)
    except HFConfigError as exc:
        raise FieldError("url", f"the model at {url} is not supported: {exc}") from None
    try:
        store = open_store(url, settings.s3_endpoint_url)
        has_weights = any(store.exists(name) for name in WEIGHT_FILES)
    except StorageError as exc:
        raise FieldError("url", f"cannot read {url}: {exc}") from None
    if not has_weights:
        raise FieldError("url", f"{url} has no weights: neither {' nor '.join(WEIGHT_FILES)}")
    return url, config


def inspect_adapter(
    session: Session, settings: Settings, tenant: Tenant | None, url: str, base: str | None
) -> tuple[RegisteredModel, dict[str, Any]]:
    """(the registered base, the adapter's training.lora settings) of the PEFT folder at `url`
    (already normalised and readable); FieldError on `url` for a folder that is no LoRA adapter or
    lacks its weights, on `base` for a base that is missing or not a registered whole model."""
    try:
        store = open_store(url, settings.s3_endpoint_url)
        config = json.loads(store.get_bytes(ADAPTER_CONFIG))
        has_weights = store.exists(ADAPTER_WEIGHTS)
    except (StorageError, ValueError) as exc:
        raise FieldError("url", f"cannot read {url}/{ADAPTER_CONFIG}: {exc}") from None
    try:
        adapter = lora_settings(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise FieldError(
            "url", f"{url}/{ADAPTER_CONFIG} is not a PEFT LoRA adapter's config: {exc}"
        ) from None
    if not adapter["targets"]:
        raise FieldError(
            "url", f"{url}: the adapter's target_modules {config.get('target_modules')} name none of ours"
        )
    if not has_weights:
        raise FieldError("url", f"{url} has no {ADAPTER_WEIGHTS}")
    if base is None:
        raise FieldError(
            "base", "the folder is a LoRA adapter: name the registered model it was trained on (base)"
        )
    found = find_named(session, RegisteredModel, tenant, base) if tenant else _shared(session, base)
    if found is None or (found.kind or "model") != "model":
        what = "a LoRA adapter, not a whole model" if found is not None else "not a registered model"
        raise FieldError("base", f"base={base!r} is {what} (see GET /v1/models)")
    return found, adapter


def _shared(session: Session, name: str) -> RegisteredModel | None:
    return session.scalar(
        select(RegisteredModel).where(RegisteredModel.tenant_id.is_(None), RegisteredModel.name == name)
    )


def _is_adapter(settings: Settings, url: str) -> bool:
    try:
        return open_store(url, settings.s3_endpoint_url).exists(ADAPTER_CONFIG)
    except StorageError as exc:
        raise FieldError("url", f"cannot read {url}: {exc}") from None


def _insert(
    session: Session,
    tenant: Tenant | None,
    name: str,
    url: str,
    config: dict[str, Any],
    base: RegisteredModel | None = None,
    adapter: dict[str, Any] | None = None,
) -> RegisteredModel:
    m = RegisteredModel(
        id=new_id("mdl"),
        tenant_id=tenant.id if tenant else None,
        name=name,
        url=url,
        model_type=base.model_type if base else config["model_type"],
        fields=base.fields if base else model_fields_from_hf(config),
        kind="adapter" if base else "model",
        base_url=base.url if base else None,
        adapter=adapter,
    )
    session.add(m)
    try:
        session.commit()
    except IntegrityError:
        # Another request registered the name between our check and this insert.
        session.rollback()
        raise HTTPException(409, f"model {name!r} already exists") from None
    return m


def _check_name_free(session: Session, tenant_id: str | None, name: str) -> None:
    owner = RegisteredModel.tenant_id == tenant_id if tenant_id else RegisteredModel.tenant_id.is_(None)
    if session.scalar(select(RegisteredModel.id).where(owner, RegisteredModel.name == name)) is not None:
        raise HTTPException(409, f"model {name!r} already exists; delete it first or choose another name")


def register_model(
    session: Session, settings: Settings, tenant: Tenant, body: ModelCreate
) -> RegisteredModel:
    """Check the folder and record it under the tenant's name (409 when the name is taken): a whole
    model, or a PEFT LoRA adapter over one of the registered models (`base`)."""
    _check_name_free(session, tenant.id, body.name)
    return _register(session, settings, tenant, body)


def _register(
    session: Session, settings: Settings, tenant: Tenant | None, body: ModelCreate
) -> RegisteredModel:
    """tenant None: the operator's shared model (any folder it reaches; a shared base)."""
    folder = _folder_url(body.url)
    if tenant is not None:
        problem = data_url_problem("url", folder, settings, tenant.name)
        if problem:
            raise FieldError("url", problem)
    if _is_adapter(settings, folder):
        base, adapter = inspect_adapter(session, settings, tenant, folder, body.base)
        return _insert(session, tenant, body.name, folder, {}, base, adapter)
    if body.base is not None:
        raise FieldError("base", "base is for a LoRA adapter folder; this one holds a whole model")
    url, config = inspect_folder(settings, tenant.name if tenant else None, body.url)
    return _insert(session, tenant, body.name, url, config)


def register_shared(session: Session, settings: Settings, body: ModelCreate) -> RegisteredModel:
    """An operator's model every tenant sees (read-only); operators may name any folder they reach."""
    _check_name_free(session, None, body.name)
    return _register(session, settings, None, body)


def delete_model(session: Session, tenant: Tenant, name: str) -> None:
    """Forget the tenant's model (its folder is untouched; submitted jobs keep the URL they resolved)."""
    m = get_model(session, tenant, name)
    if m.tenant_id is None:
        raise HTTPException(403, f"model {name!r} is shared by the operator; tenants cannot delete it")
    session.delete(m)
    session.commit()
