"""Checkpoint exports through the API: validation, the 404 that lists existing steps, one export per
(step, form, dtype) until it fails, states as the worker leaves them, and the download of a ready one;
a LoRA job's adapter form, refused for a job that trained every weight."""

from __future__ import annotations

import io
import tarfile

import pytest
from api_handle import Api
from fixtures.live import add_checkpoint
from sqlalchemy import update
from sqlalchemy.exc import IntegrityError

from megatrain.db.models import CheckpointExport
from megatrain.db.session import session_scope
from megatrain.storage import open_store


def _exports(api: Api, job_id: str) -> str:
    return f"/v1/jobs/{job_id}/exports"


def _set(api: Api, export_id: str, **values: object) -> None:
    with session_scope(api.db_url) as s:
        s.execute(update(CheckpointExport).where(CheckpointExport.id == export_id).values(**values))


def test_validation_and_missing_steps(api: Api) -> None:
    job_id = api.submit()["id"]
    url = _exports(api, job_id)
    resp = api.client.post(url, json={}, headers=api.headers)
    assert resp.status_code == 404 and "no checkpoints yet" in resp.json()["detail"]
    for step in (5, 10):
        add_checkpoint(api.settings, job_id, step)
    resp = api.client.post(url, json={"step": 7}, headers=api.headers)
    assert resp.status_code == 404 and resp.json()["detail"].endswith("its checkpoints: 5, 10")
    for body, field in (
        ({"dtype": "fp16"}, "dtype"),
        ({"format": "onnx"}, "format"),
        ({"form": "merged"}, "form"),
        ({"step": -1}, "step"),
        ({"stpe": 5}, "stpe"),
    ):
        resp = api.client.post(url, json=body, headers=api.headers)
        assert resp.status_code == 422, resp.text
        assert [e["field"] for e in resp.json()["detail"]] == [field]
    # Another tenant's job does not exist for them; a checkpoint whose files are gone is no checkpoint.
    assert api.client.post(url, json={}, headers=api.other_headers).status_code == 404
    open_store(api.settings.resolved_storage_url).delete_prefix(f"jobs/{job_id}/checkpoints/iter_0000005")
    resp = api.client.post(url, json={"step": 5}, headers=api.headers)
    assert resp.status_code == 404 and "incomplete or was deleted" in resp.json()["detail"]


def test_states_reuse_and_download(api: Api) -> None:
    job_id = api.submit()["id"]
    url = _exports(api, job_id)
    for step in (5, 10):
        add_checkpoint(api.settings, job_id, step)
    first = api.client.post(url, headers=api.headers)  # no body: the latest step in bf16
    assert first.status_code == 202, first.text
    exp = first.json()
    assert (exp["step"], exp["dtype"], exp["format"], exp["form"], exp["status"]) == (
        10, "bf16", "hf", "model", "pending"
    )  # fmt: skip
    again = api.client.post(url, json={"step": 10, "dtype": "bf16"}, headers=api.headers)
    assert again.status_code == 200 and again.json()["id"] == exp["id"]
    fp32 = api.client.post(url, json={"step": 5, "dtype": "fp32"}, headers=api.headers).json()
    assert fp32["id"] != exp["id"] and fp32["status"] == "pending"
    listed = api.client.get(url, headers=api.headers).json()
    assert [e["id"] for e in listed] == [exp["id"], fp32["id"]]
    assert api.client.get(f"{url}/{exp['id']}", headers=api.headers).json() == exp
    assert api.client.get(f"{url}/exp-nope", headers=api.headers).status_code == 404
    assert api.client.get(f"{url}/{exp['id']}", headers=api.other_headers).status_code == 404

    resp = api.client.get(f"{url}/{exp['id']}/download", headers=api.headers)
    assert resp.status_code == 409 and "pending" in resp.json()["detail"]

    # What the worker leaves behind: the folder in the storage layout, the row ready.
    folder = f"jobs/{job_id}/exports/hf/iter_0000010-bf16"
    files = {"model.safetensors": b"x" * 1000, "config.json": b'{"model_type": "llama"}'}
    store = open_store(api.settings.resolved_storage_url)
    for name, data in files.items():
        store.put_bytes(f"{folder}/{name}", data)
    _set(api, exp["id"], status="ready", uri=f"{store.url}/{folder}", size_bytes=1023)
    resp = api.client.get(f"{url}/{exp['id']}/download", headers=api.headers)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-tar"
    assert f'filename="{job_id}-iter_0000010-bf16.tar"' in resp.headers["content-disposition"]
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}
    assert got == {f"iter_0000010-bf16/{k}": v for k, v in files.items()}
    resp = api.client.get(f"{url}/{exp['id']}/download?format=urls", headers=api.headers)
    assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "format"

    # A failed export is tried again by a new one; its reason stays on the old one.
    _set(api, fp32["id"], status="failed", error="KeyError: 'layers.0.attn.qkv.weight'")
    resp = api.client.get(f"{url}/{fp32['id']}/download", headers=api.headers)
    assert resp.status_code == 409 and "KeyError" in resp.json()["detail"]
    retry = api.client.post(url, json={"step": 5, "dtype": "fp32"}, headers=api.headers)
    assert retry.status_code == 202 and retry.json()["id"] != fp32["id"]
    # Files gone from storage: the download says so rather than streaming nothing.
    store.delete_prefix(folder)
    assert api.client.get(f"{url}/{exp['id']}/download", headers=api.headers).status_code == 404


def test_one_live_export_per_step_and_dtype_in_the_database(api: Api) -> None:
    """Two requests racing past the service's lookup still share one export: the second insert of a
    live (not failed) export of the same step, form and dtype is refused by the database itself."""
    job_id = api.submit()["id"]
    add_checkpoint(api.settings, job_id, 5)
    first = api.client.post(_exports(api, job_id), json={"step": 5}, headers=api.headers).json()
    with pytest.raises(IntegrityError), session_scope(api.db_url) as s:
        s.add(CheckpointExport(job_id=job_id, step=5, format="hf", dtype="bf16", status="pending"))
    _set(api, first["id"], status="failed")
    with session_scope(api.db_url) as s:  # a failed one does not count
        s.add(CheckpointExport(job_id=job_id, step=5, format="hf", dtype="bf16", status="pending"))
    with session_scope(api.db_url) as s:  # nor does another form of the same step and dtype
        s.add(
            CheckpointExport(
                job_id=job_id, step=5, format="hf", form="adapter", dtype="bf16", status="pending"
            )
        )


def test_adapter_exports_of_a_lora_job_only(api: Api) -> None:
    """A job that trained every weight has no adapters: 422 naming `form`, whatever its checkpoints.
    A LoRA job's adapter is an export of its own beside the (merged) model, in a folder of its own,
    complete once adapter_config.json is there."""
    full = api.submit()["id"]
    for steps in ((), (5,)):
        for step in steps:
            add_checkpoint(api.settings, full, step)
        resp = api.client.post(_exports(api, full), json={"form": "adapter"}, headers=api.headers)
        assert resp.status_code == 422, resp.text
        [error] = resp.json()["detail"]
        assert error["field"] == "form" and "training.method is 'full'" in error["message"], error
    assert api.client.get(_exports(api, full), headers=api.headers).json() == []

    job_id = api.submit(api.spec("lora", training={"method": "lora", "lora": {"rank": 4}}))["id"]
    url = _exports(api, job_id)
    add_checkpoint(api.settings, job_id, 5)
    adapter = api.client.post(url, json={"form": "adapter"}, headers=api.headers)
    assert adapter.status_code == 202, adapter.text
    assert (adapter.json()["form"], adapter.json()["step"]) == ("adapter", 5)
    model = api.client.post(url, json={}, headers=api.headers)
    assert model.status_code == 202 and model.json()["form"] == "model"
    again = api.client.post(url, json={"form": "adapter", "dtype": "bf16"}, headers=api.headers)
    assert again.status_code == 200 and again.json()["id"] == adapter.json()["id"]

    folder = f"jobs/{job_id}/exports/hf/iter_0000005-bf16-adapter"
    store = open_store(api.settings.resolved_storage_url)
    store.put_bytes(f"{folder}/adapter_model.safetensors", b"x" * 10)
    _set(api, adapter.json()["id"], status="ready", uri=f"{store.url}/{folder}", size_bytes=10)
    download = f"{url}/{adapter.json()['id']}/download"
    resp = api.client.get(download, headers=api.headers)
    assert resp.status_code == 404, resp.text  # no adapter_config.json yet: not complete
    store.put_bytes(f"{folder}/adapter_config.json", b'{"peft_type": "LORA"}')
    resp = api.client.get(download, headers=api.headers)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        names = sorted(m.name for m in tar if m.isfile())
    prefix = "iter_0000005-bf16-adapter/"
    assert names == [prefix + "adapter_config.json", prefix + "adapter_model.safetensors"]
