"""Real training through the OpenAI-compatible API, driven by the `openai` SDK: a tiny Hugging Face
Llama registered as the base, fine-tuning files uploaded through /openai/v1/files, jobs created,
polled to success with the real engine on CPU, their metrics events and checkpoints read back and
the fine-tuned models listed. On the embedded default (SQLite, the local executor): a supervised
LoRA job on a chat file and a dpo job on a preference file; on PostgreSQL + Celery (Redis) + S3
(moto): a supervised job on a prompt/completion file, whose model then answers chats from a model
server the Celery worker runs. A few steps each: the API's own behaviour is
test_openai_api.py's (fake engine)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fixtures.celery import celery_stack
from fixtures.live import LiveApi
from fixtures.openai_kit import (
    SchemaCheck,
    chat_records,
    jsonl,
    megatrain_generate,
    preference_records,
    prompt_completion_records,
    register_model,
    sdk,
    tiny_model,
    wait_for,
)

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 240.0
"""Far above a run here (seconds on two CPU cores): only a stuck job reaches it."""
EXTENSION = {"megatrain": {"seq_length": 32}}


def _succeeded(client: Any, job_id: str, live: LiveApi) -> Any:
    """The job once it has finished; the test fails with its events unless it succeeded."""

    def finished() -> Any:
        job = client.fine_tuning.jobs.retrieve(job_id)
        return job if job.status in ("succeeded", "failed", "cancelled") else None

    job = wait_for(finished, JOB_TIMEOUT_S, 0.5)
    if job.status != "succeeded":
        events = "\n".join(e.message for e in client.fine_tuning.jobs.list_events(job_id, limit=50).data)
        pytest.fail(f"{job_id} {job.status}: {job.error}\n{events}")
    return job


def _train_losses(client: Any, job_id: str) -> list[tuple[int, float]]:
    events = client.fine_tuning.jobs.list_events(job_id, limit=100).data
    return sorted((e.data["step"], e.data["train_loss"]) for e in events if "train_loss" in (e.data or {}))


def _create_supervised(client: Any, records: list[dict[str, Any]], held_out: list[Any] | None = None) -> Any:
    """8 records, batch 4, 1 epoch: 2 steps, a checkpoint at the end (and a validation file
    evaluated every step when `held_out`)."""
    train = client.files.create(file=("train.jsonl", jsonl(records)), purpose="fine-tune")
    valid = (
        client.files.create(file=("valid.jsonl", jsonl(held_out)), purpose="fine-tune") if held_out else None
    )
    hp = {"n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 50.0}
    return client.fine_tuning.jobs.create(
        model="tiny", training_file=train.id, suffix="sft", extra_body=EXTENSION,
        validation_file=valid.id if valid else openai.NOT_GIVEN,
        method={"type": "supervised", "supervised": {"hyperparameters": hp}},
    )  # fmt: skip


def _check_supervised(client: Any, job: Any, live: LiveApi) -> Any:
    done = _succeeded(client, job.id, live)
    losses = _train_losses(client, job.id)
    assert [s for s, _ in losses] == [1, 2] and all(math.isfinite(loss) for _, loss in losses)
    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    accuracy = [e.data["train_mean_token_accuracy"] for e in events if "train_loss" in (e.data or {})]
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)  # the engine's token_accuracy
    (ckpt,) = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert ckpt.step_number == 2 and ckpt.metrics.train_loss == losses[-1][1]
    assert done.fine_tuned_model in {m.id for m in client.models.list()}
    # The records' tokens (two steps of four short chats): fewer than the rows' 2 x 4 x 32 with padding.
    assert done.trained_tokens is not None and 0 < done.trained_tokens < 2 * 4 * 32
    return done


def _the_embedded_default(live: LiveApi) -> None:
    check = SchemaCheck()
    register_model(live.url, live.key, "tiny", tiny_model(live.data_path.parent / "tiny", real=True))
    client = sdk(live.url, live.key, check)
    sft = _create_supervised(client, chat_records(8), held_out=chat_records(12)[8:])
    prefs = client.files.create(file=("prefs.jsonl", jsonl(preference_records(4))), purpose="fine-tune")
    hp = {"n_epochs": 1, "batch_size": 2, "beta": 0.1}
    dpo = client.fine_tuning.jobs.create(
        model="tiny", training_file=prefs.id, extra_body=EXTENSION,
        method={"type": "dpo", "dpo": {"hyperparameters": hp}},
    )  # fmt: skip
    # The two run side by side (a CPU slot each).
    _check_supervised(client, sft, live)
    # The validation file, held out whole, evaluated every step (steps_per_epoch // 4, at least 1).
    events = client.fine_tuning.jobs.list_events(sft.id, limit=100).data
    valid = sorted((e.data["step"], e.data["valid_loss"]) for e in events if "valid_loss" in (e.data or {}))
    assert [s for s, _ in valid] == [1, 2] and all(math.isfinite(v) for _, v in valid)
    accuracy = [e.data["valid_mean_token_accuracy"] for e in events if "valid_loss" in (e.data or {})]
    assert len(accuracy) == 2 and all(0.0 <= a <= 1.0 for a in accuracy)
    (ckpt,) = client.fine_tuning.jobs.checkpoints.list(sft.id).data
    assert ckpt.metrics.valid_loss == valid[-1][1]
    # At the end, the whole held-out file (OpenAI's full_valid_*), beside the last eval's figures.
    assert ckpt.metrics.valid_mean_token_accuracy == accuracy[-1]
    assert (
        math.isfinite(ckpt.metrics.full_valid_loss) and 0 <= ckpt.metrics.full_valid_mean_token_accuracy <= 1
    )
    _succeeded(client, dpo.id, live)
    # The policy starts as the reference (the adapters' B is zero): -log σ(0) = log 2. The pairs
    # were read as OpenAI's preference records (input, preferred_output, non_preferred_output).
    losses = _train_losses(client, dpo.id)
    assert [s for s, _ in losses] == [1, 2] and losses[0][1] == pytest.approx(math.log(2), abs=1e-4)
    _continue_the_lora_fine_tune(live, client, client.fine_tuning.jobs.retrieve(sft.id))
    assert check.violations == []


def _continue_the_lora_fine_tune(live: LiveApi, client: Any, done: Any) -> None:
    """A LoRA fine-tuned model as `model`: its adapters train on over the same base. Same file,
    seed and batches: fresh adapters would start at the first job's step-1 loss exactly."""
    hp = {"n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 50.0}
    more = client.fine_tuning.jobs.create(
        model=done.fine_tuned_model, training_file=done.training_file, seed=done.seed,
        extra_body=EXTENSION, method={"type": "supervised", "supervised": {"hyperparameters": hp}},
    )  # fmt: skip
    _succeeded(client, more.id, live)
    first, again = _train_losses(client, done.id), _train_losses(client, more.id)
    assert again[0][1] < first[0][1] - 1e-3, (first, again)
    job = more.model_extra["megatrain"]["job_id"]
    spec = httpx.get(f"{live.url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {live.key}"}).json()[
        "spec"
    ]
    prior = done.model_extra["megatrain"]["job_id"]
    assert spec["model"]["adapter_from"] == f"checkpoint:{prior}@2" and spec["training"]["method"] == "lora"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_supervised_and_dpo_on_the_embedded_default(live_stack: LiveApi) -> None:
    _the_embedded_default(live_stack)


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_supervised_on_postgres_celery_and_s3(
    db_url: str, redis_url: str, s3_bucket_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its model servers are reached at MEGATRAIN_NODE_ADDRESS.
    env = {"STORAGE_URL": f"{s3_bucket_url}/store", "NODE_ADDRESS": "127.0.0.1"}
    with celery_stack(tmp_path, monkeypatch, redis_url, **env) as live:
        check = SchemaCheck()
        register_model(live.url, live.key, "tiny", tiny_model(live.data_path.parent / "tiny", real=True))
        client = sdk(live.url, live.key, check)
        done = _check_supervised(client, _create_supervised(client, prompt_completion_records(8)), live)
        # The upload, its records and the checkpoints are in the bucket.
        job = client.fine_tuning.jobs.retrieve(done.id).model_extra["megatrain"]["job_id"]
        import boto3

        bucket = s3_bucket_url.removeprefix("s3://")
        keys = [o["Key"] for o in boto3.client("s3", endpoint_url=live.settings.s3_endpoint_url)
                .list_objects_v2(Bucket=bucket)["Contents"]]  # fmt: skip
        assert any(k.endswith("records.jsonl") for k in keys)
        assert any(k.startswith(f"store/jobs/{job}/checkpoints/iter_0000002/") for k in keys)
        _chat_on_the_celery_node(live, client, done, job)
        assert check.violations == []


def _chat_on_the_celery_node(live: LiveApi, client: Any, done: Any, job_id: str) -> None:
    """The fine-tuned model answers through a serve job the Celery worker runs: its model server
    listens on the node's published address and answers only requests with its token; greedy
    equals megatrain's generate on the checkpoint in the bucket."""
    import httpx

    from megatrain.client import Client

    chat = [{"role": "user", "content": "def add(a, b): # 1"}]
    with Client(api_url=live.url, api_key=live.key) as ours:
        spec, uri = ours.get_job(job_id).spec, ours.checkpoints(job_id)[-1].uri
    prompt, want = megatrain_generate(uri, spec, chat, 6)
    # The first request waits for the serve job to start on the node: up to the API's
    # serve_start_timeout_s (120 s), past the SDK client's 60 s on a slow host.
    raw = client.with_options(timeout=180).chat.completions.with_raw_response.create(
        model=done.fine_tuned_model, messages=chat, temperature=0, max_tokens=6
    )
    answer = raw.parse()
    assert answer.choices[0].message.content == want and answer.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(
        model=done.fine_tuned_model, messages=chat, temperature=0, max_tokens=6, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    serve_id = raw.headers["x-megatrain-serve-job"]
    with Client(api_url=live.url, api_key=live.key) as ours:
        (serving,) = [e["data"] for e in ours.events(serve_id) if e["kind"] == "serving"]
        assert serving["url"].startswith("http://127.0.0.1:")  # MEGATRAIN_NODE_ADDRESS
        assert "token" not in json.dumps(serving)
        body = {"model": "m", "messages": chat, "max_tokens": 1}
        assert httpx.post(f"{serving['url']}/v1/chat/completions", json=body).status_code == 401
        ours.cancel(serve_id)
        assert ours.wait(serve_id, timeout_s=60, poll_interval_s=0.2).status == "cancelled"
