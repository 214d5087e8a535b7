"""`model.init_from: hf:URL` at submission: the model section comes from the folder's config.json.

The tenant must be allowed to read the folder (the data-access rule of data paths, unchanged); its
config.json is read through megatrain.storage; the spec's explicit model fields must agree with it
(each disagreement is a 422 naming its `model.*` field) and the rest are filled from it, so the
stored spec describes exactly the model the engine will load. Torch-free: megatrain.hf_config.

`hf:NAME` (a bare name: no scheme, no slash) names a registered model (/v1/models): it is replaced by
`hf:URL` before anything else, so the stored spec never depends on the registry again.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sqlalchemy.orm import Session

from megatrain.api.jobs.data_access import data_url_problem
from megatrain.api.registry import find_named
from megatrain.db.models import RegisteredModel, Tenant
from megatrain.hf_config import (
    HFConfigError,
    check_spec_against_hf,
    model_fields_from_hf,
    spec_model_with_hf,
)
from megatrain.settings import Settings
from megatrain.spec import NAME_PATTERN, SpecError
from megatrain.storage import StorageError, open_store

FIELD = "model.init_from"
CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 1 << 20
"""A config.json is a few KiB; anything far larger is not one."""


def hf_folder_url(init_from: str) -> str | None:
    """The folder URL of `hf:URL` (a bare absolute path as file://), or None for other kinds."""
    if not init_from.startswith("hf:"):
        return None
    url = init_from.removeprefix("hf:").rstrip("/")
    return "file://" + url if url.startswith("/") else url


def registered_name(init_from: str) -> str | None:
    """NAME of `hf:NAME` when it names a registered model (no scheme, no slash), else None."""
    rest = init_from.removeprefix("hf:") if init_from.startswith("hf:") else ""
    return rest if re.fullmatch(NAME_PATTERN, rest) else None


def find_model(session: Session, tenant: Tenant, name: str) -> RegisteredModel | None:
    """The tenant's own model called `name`, else the shared one, else None."""
    return find_named(session, RegisteredModel, tenant, name)


def resolve_registered_model(data: Any, session: Session, tenant: Tenant) -> tuple[Any, bool]:
    """(the raw submission with `model.init_from: hf:NAME` replaced by the registered `hf:URL`,
    whether that model is operator-shared); SpecError naming model.init_from for a name the tenant
    has no model (own or shared) under. Any other submission comes back as it is."""
    model = data.get("model") if isinstance(data, dict) else None
    data = _resolve_adapter_from(data, session, tenant)
    init_from = model.get("init_from") if isinstance(model, dict) else None
    name = registered_name(init_from) if isinstance(init_from, str) else None
    if name is None:
        return data, False
    found = find_model(session, tenant, name)
    if found is None:
        raise _error(
            f"{FIELD}={init_from!r} names no registered model (see GET /v1/models); "
            "a folder is hf:file:///abs/path or hf:s3://bucket/key"
        )
    if (found.kind or "model") == "adapter":
        return _from_adapter(data, found), found.tenant_id is None
    return {**data, "model": {**data["model"], "init_from": f"hf:{found.url}"}}, found.tenant_id is None


def _from_adapter(data: dict[str, Any], adapter: RegisteredModel) -> dict[str, Any]:
    """`init_from: hf:ADAPTER`: the run starts from the adapter's base with its adapters
    (model.adapter_from), training LoRA (method lora unless qlora is asked) with the adapter's
    settings where training.lora gives none; SpecError naming what contradicts that."""
    model, training = data["model"], data.get("training") or {}
    if not isinstance(training, dict):
        return data  # parse_spec names it
    name = model["init_from"]
    if model.get("adapter_from"):
        raise _error(f"{FIELD}={name!r} is a LoRA adapter: it sets model.adapter_from, so leave that out")
    method = training.get("method", "lora")
    if method not in ("lora", "qlora"):
        raise _error(
            f"{FIELD}={name!r} is a LoRA adapter: training.method must be lora or qlora, not {method!r}",
            "training.method",
        )
    lora = {**(adapter.adapter or {}), **(training.get("lora") or {})}
    model = {**model, "init_from": f"hf:{adapter.base_url}", "adapter_from": f"hf:{adapter.url}"}
    return {**data, "model": model, "training": {**training, "method": method, "lora": lora}}


def _resolve_adapter_from(data: Any, session: Session, tenant: Tenant) -> Any:
    """`model.adapter_from: hf:NAME` of a registered adapter -> its folder's hf:URL."""
    model = data.get("model") if isinstance(data, dict) else None
    adapter_from = model.get("adapter_from") if isinstance(model, dict) else None
    name = registered_name(adapter_from) if isinstance(adapter_from, str) else None
    if name is None:
        return data
    found = find_model(session, tenant, name)
    if found is None or (found.kind or "model") != "adapter":
        what = "a whole model, not an adapter" if found is not None else "no registered adapter"
        raise _error(
            f"model.adapter_from={adapter_from!r} names {what} (see GET /v1/models)", "model.adapter_from"
        )
    return {**data, "model": {**model, "adapter_from": f"hf:{found.url}"}}


def fill_model(session: Session, settings: Settings, tenant: Tenant, data: Any) -> Any:
    """The raw submission with a registered name resolved, then its model filled from the hf:
    folder (fill_model_from_hf). An operator-shared model's folder is the operator's grant to every
    tenant, so the tenant's data-access rule is not applied to it."""
    data, shared = resolve_registered_model(data, session, tenant)
    return fill_model_from_hf(data, settings, tenant.name, check_access=not shared)


def _error(message: str, field: str = FIELD) -> SpecError:
    return SpecError([{"field": field, "message": message}])


def read_hf_config(
    url: str, settings: Settings, tenant_name: str, field: str = FIELD, check_access: bool = True
) -> dict[str, Any]:
    """The folder's config.json, once the tenant may read the folder (unless `check_access` is
    False: an operator's folder); SpecError naming `field`."""
    problem = data_url_problem(field, url, settings, tenant_name) if check_access else None
    if problem:
        raise _error(problem, field)
    try:
        store = open_store(url, settings.s3_endpoint_url)
        if not store.exists(CONFIG_FILE):
            raise _error(f"{url}/{CONFIG_FILE} does not exist (not a Hugging Face model folder)", field)
        if store.stat(CONFIG_FILE).size > MAX_CONFIG_BYTES:
            raise _error(f"{url}/{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes", field)
        config = json.loads(store.get_bytes(CONFIG_FILE))
    except StorageError as exc:
        raise _error(f"cannot read {url}/{CONFIG_FILE}: {exc}", field) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _error(f"{url}/{CONFIG_FILE} is not valid JSON: {exc}", field) from None
    if not isinstance(config, dict):
        raise _error(f"{url}/{CONFIG_FILE} is not a JSON object", field)
    return config


def fill_model_from_hf(data: Any, settings: Settings, tenant_name: str, check_access: bool = True) -> Any:
    """The raw submission with its model section completed from an hf: init_from's config.json;
    any other body is returned as it is (parse_spec judges it). Raises SpecError naming every
    `model.*` field that disagrees with the config, or `model.init_from` when the config cannot be
    read or describes a model we cannot build."""
    model = data.get("model") if isinstance(data, dict) else None
    init_from = model.get("init_from") if isinstance(model, dict) else None
    url = hf_folder_url(init_from) if isinstance(init_from, str) else None
    if url is None:
        return data
    config = read_hf_config(url, settings, tenant_name, check_access=check_access)
    try:
        # No seq_length here: check_spec_against_hf names a spec's too long one as model.seq_length.
        fields = model_fields_from_hf(config)
    except HFConfigError as exc:
        raise _error(f"the model at {url} is not supported: {exc}") from None
    errors = check_spec_against_hf(model, fields)
    if errors:
        raise SpecError(errors)
    return {**data, "model": spec_model_with_hf(model, fields)}
