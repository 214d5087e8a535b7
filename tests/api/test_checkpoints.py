"""Checkpoint listing and downloads: a streamed tar from file:// storage, presigned URLs from S3."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import uuid

import httpx
from api_handle import Api
from fastapi.testclient import TestClient
from sqlalchemy import update

from megatrain.api.app import create_app
from megatrain.db.models import FAILED, Checkpoint, Job
from megatrain.db.session import session_scope
from megatrain.storage import open_store


def write_checkpoint(
    api: Api,
    job_id: str,
    step: int,
    manifest: bool = True,
    store_url: str | None = None,
    endpoint_url: str | None = None,
) -> dict[str, bytes]:
    """An engine-shaped iter folder (a nested shard included) plus its checkpoint row."""
    store = open_store(store_url or api.settings.resolved_storage_url, endpoint_url)
    prefix = f"jobs/{job_id}/checkpoints/iter_{step:07d}"
    files = {
        "model.safetensors": os.urandom(70_000),  # not a multiple of 512: exercises tar padding
        "optimizer.pt": os.urandom(1234),
        "trainer_state.json": json.dumps({"step": step}).encode(),
        "shards/rank_0.pt": b"shard" * 100,
    }
    for name, data in files.items():
        store.put_bytes(f"{prefix}/{name}", data)
    if manifest:
        entries = [
            {"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()
        ]
        files["manifest.json"] = json.dumps({"step": step, "files": entries}).encode()
        store.put_bytes(f"{prefix}/manifest.json", files["manifest.json"])
    size = sum(map(len, files.values()))
    with session_scope(api.db_url) as s:
        s.add(Checkpoint(job_id=job_id, step=step, uri=f"{store.url}/{prefix}", size_bytes=size))
    return files


def test_list_and_tar_download(api: Api) -> None:
    job_id = api.submit()["id"]
    assert api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers).json() == []
    files = write_checkpoint(api, job_id, 10)
    write_checkpoint(api, job_id, 5)
    listed = api.client.get(f"/v1/jobs/{job_id}/checkpoints", headers=api.headers).json()
    assert [c["step"] for c in listed] == [5, 10]
    assert set(listed[0]) == {"step", "uri", "size_bytes", "created_at"}
    assert listed[1]["size_bytes"] == sum(map(len, files.values()))

    resp = api.client.get(f"/v1/jobs/{job_id}/checkpoints/10/download", headers=api.headers)
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/x-tar"
    assert resp.headers["content-disposition"] == f'attachment; filename="{job_id}-iter_0000010.tar"'
    assert int(resp.headers["content-length"]) == len(resp.content)
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {f"iter_0000010/{name}" for name in files}
        for name, data in files.items():
            member = members[f"iter_0000010/{name}"]
            assert member.isfile() and member.size == len(data)
            extracted = tar.extractfile(member)
            assert extracted is not None and extracted.read() == data
    # format=tar is what auto chose; file:// storage has no presigned URLs.
    assert (
        api.client.get(
            f"/v1/jobs/{job_id}/checkpoints/10/download?format=tar", headers=api.headers
        ).status_code
        == 200
    )
    urls = api.client.get(f"/v1/jobs/{job_id}/checkpoints/10/download?format=urls", headers=api.headers)
    assert urls.status_code == 422 and urls.json()["detail"][0]["field"] == "format"


def test_missing_and_incomplete_checkpoints_are_404(api: Api) -> None:
    job_id = api.submit()["id"]
    write_checkpoint(api, job_id, 20, manifest=False)
    for step in (7, 20):
        resp = api.client.get(f"/v1/jobs/{job_id}/checkpoints/{step}/download", headers=api.headers)
        assert resp.status_code == 404 and f"step {step}" in resp.json()["detail"]
    for bad in ("-1", "abc", "1e3", str(10**12)):
        resp = api.client.get(f"/v1/jobs/{job_id}/checkpoints/{bad}/download", headers=api.headers)
        assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "step"


def test_s3_download_presigned_urls_or_tar(api: Api, moto_s3_endpoint: str) -> None:
    import boto3

    bucket = f"mt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_s3_endpoint).create_bucket(Bucket=bucket)
    settings = api.settings.model_copy(
        update={"storage_url": f"s3://{bucket}/prod", "s3_endpoint_url": moto_s3_endpoint}
    )
    with TestClient(create_app(settings)) as client:
        job_id = client.post("/v1/jobs", json=api.spec(), headers=api.headers).json()["id"]
        files = write_checkpoint(
            api, job_id, 3, store_url=settings.resolved_storage_url, endpoint_url=moto_s3_endpoint
        )
        resp = client.get(f"/v1/jobs/{job_id}/checkpoints/3/download", headers=api.headers)
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
        listing = resp.json()
        assert listing["job_id"] == job_id and listing["step"] == 3 and listing["expires_in_s"] > 0
        assert {f["path"]: f["size"] for f in listing["files"]} == {n: len(d) for n, d in files.items()}
        for entry in listing["files"]:  # presigned: fetched without our API key
            assert httpx.get(entry["url"]).content == files[entry["path"]]
        tar_resp = client.get(f"/v1/jobs/{job_id}/checkpoints/3/download?format=tar", headers=api.headers)
        with tarfile.open(fileobj=io.BytesIO(tar_resp.content)) as tar:
            got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
        assert got == {f"iter_0000003/{n}": d for n, d in files.items()}


def test_a_missing_or_deleted_step_lists_the_steps_there_are(api: Api) -> None:
    job_id = api.submit()["id"]
    url = f"/v1/jobs/{job_id}/checkpoints"
    resp = api.client.get(f"{url}/5/download", headers=api.headers)
    assert resp.status_code == 404 and resp.json()["detail"] == f"job {job_id} has no checkpoints yet"
    write_checkpoint(api, job_id, 5)
    write_checkpoint(api, job_id, 10)
    resp = api.client.get(f"{url}/7/download", headers=api.headers)
    assert resp.status_code == 404 and resp.json()["detail"].endswith("its checkpoints: 5, 10")


def test_a_failed_job_without_checkpoints_says_so_not_yet(api: Api) -> None:
    job_id = api.submit()["id"]
    with session_scope(api.db_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(status=FAILED))
    resp = api.client.get(f"/v1/jobs/{job_id}/checkpoints/5/download", headers=api.headers)
    assert (
        resp.status_code == 404
        and resp.json()["detail"] == f"job {job_id} failed without saving a checkpoint"
    )
    resp = api.client.post(f"/v1/jobs/{job_id}/samples", json={"prompt": "def"}, headers=api.headers)
    assert resp.status_code == 409 and "failed without saving a checkpoint" in resp.json()["detail"]


def test_weights_only_download_leaves_out_the_optimizer_state(api: Api) -> None:
    job_id = api.submit()["id"]
    store = open_store(api.settings.resolved_storage_url)
    prefix = f"jobs/{job_id}/checkpoints/iter_0000003"
    names = ["model_00000.bin", "state_00000_000.bin", "metadata.json", "spec.json", "manifest.json"]
    for name in names:
        store.put_bytes(f"{prefix}/{name}", name.encode())
    with session_scope(api.db_url) as s:
        s.add(Checkpoint(job_id=job_id, step=3, uri=f"{store.url}/{prefix}", size_bytes=1))
    url = f"/v1/jobs/{job_id}/checkpoints/3/download"
    for query, want in (("", set(names)), ("?weights_only=true", set(names) - {"state_00000_000.bin"})):
        resp = api.client.get(url + query, headers=api.headers)
        assert resp.status_code == 200, resp.text
        with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
            assert {m.name.removeprefix("iter_0000003/") for m in tar.getmembers()} == want
