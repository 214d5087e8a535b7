"""The SDK against the real API (uvicorn on a free port), on SQLite and PostgreSQL."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures.live import LiveApi, add_checkpoint, start_live_api

from megatrain.client import ApiError, Client


def test_submit_get_list_cancel(live_api: LiveApi) -> None:
    with Client() as c:  # URL and key come from the settings and the credentials file
        job = c.submit(live_api.spec("first"))
        assert job.status == "queued" and job.name == "first" and job.total_steps == 10
        again = c.submit(live_api.spec("first"), idempotency_key="k1")
        assert c.submit(live_api.spec("first"), idempotency_key="k1").id == again.id != job.id
        assert c.get_job(job.id).id == job.id
        ids = [j.id for j in c.list_jobs(page_size=1)]
        assert sorted(ids) == sorted({job.id, again.id}) and len(ids) == 2
        assert [j.id for j in c.list_jobs(limit=1)] == ids[:1]
        c.cancel(job.id)
        assert c.get_job(job.id).status == "cancelled"
        assert [j.id for j in c.list_jobs(status="cancelled")] == [job.id]
        assert [j.id for j in c.list_jobs(status="queued")] == [again.id]
        kinds = [e.get("kind") or e.get("to_status") for e in c.events(job.id)]
        assert "cancelled" in kinds
        assert c.logs(job.id) == [] and c.metrics(job.id) == []


def test_validation_error_names_the_field(live_api: LiveApi) -> None:
    spec = live_api.spec()
    spec["model"]["hidden_size"] = 33  # not divisible by 2 heads
    with Client() as c, pytest.raises(ApiError) as ei:
        c.submit(spec)
    assert ei.value.status == 422
    assert "model.hidden_size" in ei.value.fields
    assert "model.hidden_size" in str(ei.value)


def test_wrong_key_and_unknown_job(live_api: LiveApi) -> None:
    with Client(live_api.url, api_key="mt_not-a-key") as c, pytest.raises(ApiError) as ei:
        c.get_job("job-x")
    assert ei.value.status == 401
    with Client() as c, pytest.raises(ApiError) as ei:
        c.get_job("job-does-not-exist")
    assert ei.value.status == 404


def test_health_and_schema(live_api: LiveApi) -> None:
    with Client() as c:
        assert isinstance(c.health(), dict)
        assert "properties" in c.spec_schema()


def test_download_checkpoint(live_api: LiveApi, tmp_path: Path) -> None:
    with Client() as c:
        job = c.submit(live_api.spec())
        add_checkpoint(live_api.settings, job.id, 5, payload=b"five")
        add_checkpoint(live_api.settings, job.id, 10, payload=b"ten")
        assert [cp.step for cp in c.checkpoints(job.id)] == [5, 10]
        latest = c.download(job.id, dest=tmp_path / "latest")
        assert (latest / "model.safetensors").read_bytes() == b"ten"
        assert (latest / "manifest.json").is_file()
        older = c.download(job.id, step=5, dest=tmp_path / "five")
        assert (older / "model.safetensors").read_bytes() == b"five"
        with pytest.raises(ApiError) as ei:
            c.download(job.id, step=7, dest=tmp_path / "seven")
        assert ei.value.status == 404


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # PostgreSQL adds nothing here but time
def test_tiny_job_end_to_end(live_stack: LiveApi, tmp_path: Path) -> None:
    """A real (tiny) training job through scheduler, local executor and engine; checkpoint loads."""
    pytest.importorskip("megatrain.engine.train", reason="the engine entry point has not landed yet")
    from megatrain.engine.checkpoint import load_checkpoint

    with Client() as c:
        job = c.submit(live_stack.spec("e2e"))
        final = c.wait(job.id, timeout_s=120, poll_interval_s=0.5)
        log_text = "\n".join(ln.line for ln in c.logs(job.id))
        assert final.status == "succeeded", f"{final.status_reason}\n{log_text[-3000:]}"
        assert final.current_step == 10 and final.latest_loss is not None
        train = [m for m in c.metrics(job.id) if m.get("kind", "train") == "train"]
        assert [m["step"] for m in train][-1] == 10
        assert [cp.step for cp in c.checkpoints(job.id)][-1] == 10
        # The SSE stream replays the stored rows, then ends because the job has finished.
        streamed = list(c.stream_metrics(job.id))
        assert [(m["step"], m["kind"]) for m in streamed] == [
            (m["step"], m["kind"]) for m in c.metrics(job.id)
        ]
        assert [m["step"] for m in c.stream_metrics(job.id, since_step=6)] == [8, 10]
        assert "".join(ln.line for ln in c.follow_logs(job.id)) == "".join(ln.line for ln in c.logs(job.id))
        path = c.download(job.id, dest=tmp_path / "ckpt")
    model, spec = load_checkpoint(str(path))
    assert sum(p.numel() for p in model.parameters()) > 0
    assert spec.name == "e2e"


@pytest.mark.slow
@pytest.mark.distributed
def _wait_succeeded(c: Client, job_id: str) -> tuple[str, dict]:
    """Wait for a parallel job to succeed (its log in the failure message); its log and started event."""
    final = c.wait(job_id, timeout_s=180, poll_interval_s=0.5)
    log_text = "\n".join(ln.line for ln in c.logs(job_id))
    assert final.status == "succeeded", f"{final.status_reason}\n{log_text[-3000:]}"
    return log_text, next(e for e in c.events(job_id) if e["kind"] == "started")


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_tensor_and_data_parallel_job_through_the_api(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp=2 × dp=2 submitted through the API runs on 4 CPU processes and trains like one process."""
    pytest.importorskip("megatrain.engine.train", reason="the engine entry point has not landed yet")
    for live in start_live_api(tmp_path, monkeypatch, with_scheduler=True, cpu_slots=4):
        spec = live.spec("tp2dp2", global_batch_size=4)
        spec["parallelism"] = {"tp": 2, "dp": 2, "sequence_parallel": True}
        spec["resources"] = {"devices": 4}
        with Client() as c:
            job = c.submit(spec)
            assert job.num_procs == 4 and job.layout is not None and job.layout["dp"] == 2
            log_text, started = _wait_succeeded(c, job.id)
            assert started["data"]["world_size"] == 4 and started["data"]["layout"]["tp"] == 2
            losses = [m["loss"] for m in c.metrics(job.id) if m.get("kind", "train") == "train"]
            assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
            assert "tp=2+sp cp=1 dp=2 pp=1" in log_text
            path = c.download(job.id, dest=tmp_path / "ckpt")
        from megatrain.engine.checkpoint import load_checkpoint

        model, _ = load_checkpoint(str(path))  # full single-device weights from a 4-way layout
        assert model.config.num_attention_heads == 2


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_tensor_and_pipeline_parallel_job_through_the_api(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp=2 × pp=2 × dp=1 submitted through the API runs on 4 CPU processes with the 1F1B schedule."""
    pytest.importorskip("megatrain.engine.train", reason="the engine entry point has not landed yet")
    for live in start_live_api(tmp_path, monkeypatch, with_scheduler=True, cpu_slots=4):
        spec = live.spec("tp2pp2", global_batch_size=8, train_iters=4)
        spec["model"]["num_layers"] = 2  # one per stage
        spec["parallelism"] = {"tp": 2, "pp": 2, "dp": 1}
        spec["resources"] = {"devices": 4}
        with Client() as c:
            job = c.submit(spec)
            assert job.num_procs == 4 and job.layout is not None and job.layout["pp"] == 2
            log_text, started = _wait_succeeded(c, job.id)
            assert started["data"]["layout"]["pp"] == 2 and started["data"]["layout"]["tp"] == 2
            assert len(started["data"]["memory_estimate"]["stage_total_bytes"]) == 2
            rows = [m for m in c.metrics(job.id) if m.get("kind", "train") == "train"]
            assert len(rows) == 2 and all(math.isfinite(m["loss"]) for m in rows)
            assert all(0 < m["pipeline_bubble_fraction"] < 1 for m in rows)  # for the dashboard
            assert "tp=2 cp=1 dp=1 pp=2" in log_text and "pipeline: 1f1b schedule" in log_text
            path = c.download(job.id, dest=tmp_path / "ckpt")
        from megatrain.engine.checkpoint import load_checkpoint

        model, _ = load_checkpoint(str(path))  # full single-device weights gathered from both stages
        assert model.config.num_layers == 2


@pytest.fixture
def s3_live_api(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    """The live API with its storage on S3 (moto over real HTTP), so downloads are presigned URLs."""
    import os
    import uuid

    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
                       "AWS_SHARED_CREDENTIALS_FILE": os.devnull}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"mt-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        monkeypatch.setenv("MEGATRAIN_STORAGE_URL", f"s3://{bucket}/prod")
        monkeypatch.setenv("MEGATRAIN_S3_ENDPOINT_URL", endpoint)
        yield from start_live_api(tmp_path, monkeypatch, with_scheduler=False)
    finally:
        server.stop()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_download_from_s3_presigned_urls(
    s3_live_api: LiveApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched: list[str] = []
    original = Client._fetch_to_file

    def spy(self: Client, url: str, target: Path, base: str) -> None:
        fetched.append(url)
        original(self, url, target, base)

    monkeypatch.setattr(Client, "_fetch_to_file", spy)
    with Client() as c:
        job = c.submit(s3_live_api.spec())
        add_checkpoint(s3_live_api.settings, job.id, 4, payload=b"from-s3" * 1000)
        dest = c.download(job.id, dest=tmp_path / "ckpt")
    assert (dest / "model.safetensors").read_bytes() == b"from-s3" * 1000
    assert sorted(p.name for p in dest.iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "trainer_state.json",
    ]
    # Every file came straight from S3 by presigned URL, not through the API.
    assert len(fetched) == 3 and all("Signature" in u and not u.startswith(s3_live_api.url) for u in fetched)
