"""/v1/models: a Hugging Face folder (written here by transformers itself) registered under a name,
refused with a 422 on `url` when unreadable, unsupported or without weights; 409 for a taken name;
tenancy on every endpoint; and `model.init_from: hf:NAME` resolved at submission to the stored URL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from api_handle import Api
from fastapi.testclient import TestClient

from megatrain.api.app import create_app
from megatrain.api.auth import create_api_key
from megatrain.api.models.schemas import ModelCreate
from megatrain.api.models.service import register_shared
from megatrain.db.session import session_scope
from megatrain.settings import get_settings, reset_settings_cache
from megatrain.storage import open_store
from megatrain.worker.nodes import ensure_local_pool

transformers = pytest.importorskip("transformers")

LLAMA = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def hf_folder(path: Path, weights: bool = True, **overrides: Any) -> Path:
    """A transformers model folder: config.json, and its safetensors unless `weights` is False."""
    config = transformers.LlamaConfig(**(LLAMA | overrides))
    if weights:
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def register(api: Api, name: str, url: str, headers: dict[str, str] | None = None) -> Any:
    return api.client.post("/v1/models", json={"name": name, "url": url}, headers=headers or api.headers)


def _error(resp: Any) -> tuple[str, str]:
    assert resp.status_code == 422, resp.text
    [detail] = resp.json()["detail"]
    return detail["field"], detail["message"]


def test_register_records_the_config_summary(api: Api) -> None:
    folder = hf_folder(api.data_root / "llama")
    resp = register(api, "tiny-llama", str(folder))  # a bare path is the file:// folder
    assert resp.status_code == 201, resp.text
    m = resp.json()
    assert m["url"] == folder.as_uri() and m["shared"] is False and m["model_type"] == "llama"
    assert (m["arch"], m["num_layers"], m["hidden_size"], m["vocab_size"], m["seq_length"]) == (
        "llama", 2, 64, 300, 64,
    )  # fmt: skip
    assert m["fields"]["num_query_groups"] == 2 and m["fields"]["ffn_hidden_size"] == 128
    assert api.client.get("/v1/models/tiny-llama", headers=api.headers).json() == m
    assert register(api, "tiny-llama", folder.as_uri()).status_code == 409


@pytest.mark.parametrize("case", ["outside", "no-config", "unsupported", "no-weights", "relative"])
def test_unusable_folders_are_url_errors(api: Api, tmp_path: Path, case: str) -> None:
    folder = api.data_root / "m"
    if case == "outside":
        folder = hf_folder(tmp_path / "elsewhere")
    elif case == "no-config":
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"")
    elif case == "unsupported":
        hf_folder(folder, hidden_act="gelu")
    elif case == "no-weights":
        hf_folder(folder, weights=False)
    url = "relative/folder" if case == "relative" else folder.as_uri()
    field, message = _error(register(api, "m", url))
    expected = {"outside": "outside the data", "no-config": "config.json does not exist",
                "unsupported": "hidden_act", "no-weights": "no weights",
                "relative": "file:///"}[case]  # fmt: skip
    assert field == "url" and expected in message, message
    assert api.client.get("/v1/models", headers=api.headers).json()["items"] == []


def test_tenancy_and_delete(api: Api, tmp_path: Path) -> None:
    folder = hf_folder(api.data_root / "llama")
    assert register(api, "mine", folder.as_uri()).status_code == 201
    # Another tenant sees nothing of it, may register the same name, and cannot delete ours.
    assert api.client.get("/v1/models/mine", headers=api.other_headers).status_code == 404
    assert api.client.delete("/v1/models/mine", headers=api.other_headers).status_code == 404
    assert register(api, "mine", folder.as_uri(), api.other_headers).status_code == 201
    # The operator may share a folder outside the tenants' data; by its name, every tenant uses it.
    outside = hf_folder(tmp_path / "operator" / "llama")
    with session_scope(api.db_url) as s:
        register_shared(s, api.settings, ModelCreate(name="common", url=outside.as_uri()))
    spec = api.spec("shared", model=None)
    spec["model"] = {"init_from": "hf:common"}
    job = api.submit(spec)
    assert job["spec"]["model"]["init_from"] == f"hf:{outside.as_uri()}"
    spec["model"] = {"init_from": f"hf:{outside.as_uri()}"}  # named directly, the rule applies
    assert "outside the data" in _error(api.client.post("/v1/jobs", json=spec, headers=api.headers))[1]
    items = api.client.get("/v1/models", headers=api.headers).json()["items"]
    names = [(m["name"], m["shared"]) for m in items]
    assert names == [("common", True), ("mine", False)]
    assert api.client.delete("/v1/models/common", headers=api.headers).status_code == 403
    assert api.client.delete("/v1/models/mine", headers=api.headers).status_code == 204
    assert api.client.get("/v1/models/mine", headers=api.headers).status_code == 404
    assert api.client.get("/v1/models/mine", headers=api.other_headers).status_code == 200


def test_submission_resolves_hf_name_to_the_registered_url(api: Api) -> None:
    folder = hf_folder(api.data_root / "llama", weights=False, max_position_embeddings=48)
    (folder / "model.safetensors").write_bytes(b"")  # only checked for, never read by the API
    assert register(api, "tiny-llama", folder.as_uri()).status_code == 201
    spec = api.spec("from-name", model=None)
    spec["model"] = {"init_from": "hf:tiny-llama"}
    job = api.submit(spec)
    stored = api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()["spec"]["model"]
    # The model fields come from transformers' own config.json, and the URL replaces the name.
    cfg = transformers.AutoConfig.from_pretrained(folder)
    assert stored["init_from"] == f"hf:{folder.as_uri()}"
    assert (stored["num_layers"], stored["hidden_size"], stored["num_query_groups"]) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads,
    )  # fmt: skip
    assert (stored["ffn_hidden_size"], stored["vocab_size"], stored["seq_length"]) == (
        cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings,
    )  # fmt: skip
    # A job already submitted keeps its URL once the name is gone; a new one is refused.
    assert api.client.delete("/v1/models/tiny-llama", headers=api.headers).status_code == 204
    assert api.client.get(f"/v1/jobs/{job['id']}", headers=api.headers).json()["spec"]["model"] == stored
    field, message = _error(api.client.post("/v1/jobs", json=spec, headers=api.headers))
    assert field == "model.init_from" and "no registered model" in message
    # Another tenant's name is not resolvable either.
    assert register(api, "theirs", folder.as_uri(), api.other_headers).status_code == 201
    spec["model"] = {"init_from": "hf:theirs"}
    assert _error(api.client.post("/v1/jobs", json=spec, headers=api.headers))[0] == "model.init_from"


@pytest.fixture
def s3_api(db_url: str, s3_bucket_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Api]:
    # db_url first: its MEGATRAIN_HOME fixture clears MEGATRAIN_* (the S3 endpoint included).
    monkeypatch.setenv("MEGATRAIN_STORAGE_URL", f"{s3_bucket_url}/prefix")
    monkeypatch.setenv("MEGATRAIN_ALLOWED_DATA_ROOTS", s3_bucket_url + "/shared")
    reset_settings_cache()
    settings = get_settings()
    with session_scope(db_url) as s:
        ensure_local_pool(s, settings)
        key, other = create_api_key(s, "acme"), create_api_key(s, "globex")
    with TestClient(create_app(settings)) as client:
        yield Api(client, settings, db_url, key, other, tmp_path)


def test_a_folder_on_s3(s3_api: Api, s3_bucket_url: str, tmp_path: Path) -> None:
    local = hf_folder(tmp_path / "llama")
    bucket = open_store(s3_bucket_url)
    for f in local.iterdir():
        bucket.put_file(f"shared/llama/{f.name}", f)
        if f.name == "config.json":
            bucket.put_file(f"shared/config-only/{f.name}", f)
    resp = register(s3_api, "on-s3", f"{s3_bucket_url}/shared/llama")
    assert resp.status_code == 201 and resp.json()["url"] == f"{s3_bucket_url}/shared/llama", resp.text
    assert "no weights" in _error(register(s3_api, "bare", f"{s3_bucket_url}/shared/config-only"))[1]
    assert "outside the data" in _error(register(s3_api, "x", f"{s3_bucket_url}/elsewhere/llama"))[1]
    bucket.put_bytes("shared/c.jsonl", b'{"text": "x"}\n')  # submission checks that it exists
    spec = s3_api.spec("on-s3", model=None, data={"train": [{"path": f"{s3_bucket_url}/shared/c.jsonl"}]})
    spec["model"] = {"init_from": "hf:on-s3", "seq_length": 32}
    job = s3_api.submit(spec)
    assert job["spec"]["model"]["init_from"] == f"hf:{s3_bucket_url}/shared/llama"
    assert job["spec"]["model"]["hidden_size"] == 64
