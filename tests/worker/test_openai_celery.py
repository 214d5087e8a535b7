"""The OpenAI-compatible API's job controls on the production stack: PostgreSQL, the scheduler on the
Celery executor with a real worker (Redis), and S3 (moto's server) for files and checkpoints, driven
by the `openai` SDK with the fake engine. A job paused checkpoints to the bucket, is held, and resumes
from that checkpoint on the worker; a paused job is cancelled; a dpo job runs; jobs are paged; the
fine-tuned model and the file are deleted, the file's objects with it. The same controls on the
embedded default: test_openai_api.py; real training on this stack: test_openai_training.py."""

from __future__ import annotations

from pathlib import Path

import boto3
import openai
import pytest
from fixtures.celery import celery_stack
from fixtures.openai_kit import (
    SchemaCheck,
    finished_job,
    jsonl,
    pause_resume_and_cancel,
    preference_records,
    register_model,
    sdk,
    tiny_model,
    wait_for,
)

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.redis,
    pytest.mark.parametrize("db_url", ["postgres"], indirect=True),
]


def test_pause_resume_cancel_and_delete_on_postgres_celery_and_s3(
    db_url: str,
    redis_url: str,
    s3_bucket_url: str,
    fake_engine: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 30 steps of 0.25 s: the pause (asked at step 3) lands well before the end, on a loaded host too.
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.25")
    monkeypatch.setenv("MEGATRAIN_MAX_ACTIVE_FINE_TUNING_JOBS_PER_TENANT", "2")
    with celery_stack(tmp_path, monkeypatch, redis_url, STORAGE_URL=f"{s3_bucket_url}/store") as live:
        s3 = boto3.client("s3", endpoint_url=live.settings.s3_endpoint_url)
        bucket = s3_bucket_url.removeprefix("s3://")

        def keys() -> list[str]:
            return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]

        check = SchemaCheck()
        register_model(live.url, live.key, "tiny", tiny_model(live.data_path.parent / "tiny"))
        client = sdk(live.url, live.key, check)
        done, train = pause_resume_and_cancel(client, timeout_s=120)
        job = done.model_extra["megatrain"]["job_id"]
        # The pause's checkpoint, and the final one, went to the bucket (the resume read the first).
        steps = {c.step_number for c in client.fine_tuning.jobs.checkpoints.list(done.id).data}
        assert 30 in steps and len(steps) >= 2, steps
        stored = keys()
        for step in steps:
            assert any(k.startswith(f"store/jobs/{job}/checkpoints/iter_{step:07d}/") for k in stored), step

        # A dpo job on a preference file, run by the worker; the jobs paged newest first.
        prefs = client.files.create(file=("prefs.jsonl", jsonl(preference_records(4))), purpose="fine-tune")
        dpo = client.fine_tuning.jobs.create(
            model="tiny", training_file=prefs.id,
            method={"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 2, "beta": 0.2}}},
        )  # fmt: skip
        finished = wait_for(lambda: finished_job(client, dpo.id), 120)
        assert finished.status == "succeeded" and finished.method.dpo.hyperparameters.beta == 0.2
        metrics = [e for e in client.fine_tuning.jobs.list_events(dpo.id, limit=100) if e.type == "metrics"]
        assert sorted(e.data["step"] for e in metrics) == [1, 2]
        first = client.fine_tuning.jobs.list(limit=1)
        assert [j.id for j in first.data] == [dpo.id] and first.has_more
        rest = client.fine_tuning.jobs.list(limit=10, after=dpo.id)
        assert done.id in {j.id for j in rest.data} and not rest.has_more

        # Deletes: the fine-tuned model is gone from the tenant's models; the file with its objects.
        model = done.fine_tuned_model
        assert client.models.delete(model).deleted
        assert model not in {m.id for m in client.models.list()}
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(model)
        uploaded = [k for k in keys() if f"/datasets/{train.id}/" in k]
        assert uploaded
        assert client.files.delete(train.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(train.id)
        assert not set(uploaded) & set(keys())
        assert check.violations == []
