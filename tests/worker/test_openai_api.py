"""The OpenAI-compatible API (/openai/v1) driven by the `openai` SDK itself against a live embedded
stack (SQLite, the scheduler, the local executor) whose jobs run the fake engine (fast, no torch):
files in each format and a bad line refused, fine-tuning jobs created, polled, listed and paged,
their events and checkpoints, models, pause/resume/cancel, deletes; another tenant's ids are 404 on
every endpoint; errors are OpenAI's (the SDK raises its own classes); every answer validates
against OpenAI's schemas. Real training through this API: test_openai_training.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fixtures.live import LiveApi, start_live_api
from fixtures.openai_kit import (
    SchemaCheck,
    chat_records,
    finished_job,
    jsonl,
    pause_resume_and_cancel,
    preference_records,
    prompt_completion_records,
    register_model,
    sdk,
    tiny_model,
    wait_for,
)

from megatrain.api.auth import create_api_key
from megatrain.api.models.schemas import ModelCreate
from megatrain.api.models.service import register_shared
from megatrain.db.session import session_scope

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.fixture
def stack(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_engine: Path
) -> Iterator[LiveApi]:
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.02")
    monkeypatch.setenv("MEGATRAIN_MAX_ACTIVE_FINE_TUNING_JOBS_PER_TENANT", "2")
    yield from start_live_api(tmp_path, monkeypatch, with_scheduler=True)


@pytest.fixture
def check() -> Iterator[SchemaCheck]:
    check = SchemaCheck()
    yield check
    assert check.violations == [], "\n".join(check.violations)


def _other_key(live: LiveApi) -> str:
    with session_scope(live.settings.resolved_database_url) as s:
        return create_api_key(s, "globex", "test")


def _upload(client: Any, records: list[Any], name: str = "train.jsonl") -> Any:
    return client.files.create(file=(name, jsonl(records)), purpose="fine-tune")


def test_files_jobs_and_models_through_the_sdk(stack: LiveApi, check: SchemaCheck) -> None:
    base = tiny_model(stack.data_path.parent / "tiny")
    register_model(stack.url, stack.key, "tiny", base)
    client = sdk(stack.url, stack.key, check)

    # Files: each format, read back, listed; the content is the upload, byte for byte.
    chat = _upload(client, chat_records(6), "chat.jsonl")
    assert (chat.object, chat.purpose, chat.status, chat.filename) == (
        "file",
        "fine-tune",
        "processed",
        "chat.jsonl",
    )
    pc = _upload(client, prompt_completion_records(4))
    prefs = _upload(client, preference_records(4))
    assert client.files.retrieve(chat.id).bytes == len(jsonl(chat_records(6)))
    assert client.files.content(pc.id).content == jsonl(prompt_completion_records(4))
    assert [f.id for f in client.files.list()] == [prefs.id, pc.id, chat.id]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == [prefs.id, pc.id] and page.has_more
    assert [f.id for f in page.get_next_page().data] == [chat.id]

    # A malformed line is refused naming it (OpenAI's 400), and leaves no file behind.
    bad = jsonl(chat_records(2)) + b'{"messages": [{"role": "user", "content": "x"}]}\n'
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    assert "line 3" in err.value.message and err.value.param == "file"
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", jsonl(chat_records(1))), purpose="batch")
    assert len(client.files.list().data) == 3

    # A supervised job: "auto" resolved and reported, then run to success.
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=chat.id, suffix="mine", seed=7, metadata={"team": "a"},
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 2}}},
        integrations=[{"type": "wandb", "wandb": {"project": "p"}}],
    )  # fmt: skip
    assert job.status == "queued" and job.seed == 7 and job.metadata == {"team": "a"}
    assert job.method.supervised.hyperparameters.learning_rate_multiplier == 1.0  # auto, resolved
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (2, 2)
    assert job.integrations[0].wandb.project == "p"
    done = wait_for(lambda: finished_job(client, job.id))
    assert done.status == "succeeded", done
    assert done.fine_tuned_model == f"ft:tiny:local:mine:{job.id.removeprefix('ftjob-')}"
    assert done.trained_tokens and done.finished_at and done.error is None
    ours = done.model_extra["megatrain"]
    assert ours["training_method"] == "lora" and ours["job_id"] == job.id.removeprefix("ft")

    # The same job on /v1, as the dashboard sees it: 6 records, batch 2, 2 epochs = 6 steps.
    v1 = httpx.get(
        f"{stack.url}/v1/jobs/{ours['job_id']}", headers={"Authorization": f"Bearer {stack.key}"}
    ).json()
    assert v1["kind"] == "finetune" and v1["spec"]["training"]["train_iters"] == 6
    assert v1["spec"]["training"]["method"] == "lora" and v1["spec"]["data"]["train"][0]["dataset"] == chat.id

    # Events: newest first, paged; metrics events carry the step and the training loss.
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=3))  # every page, 3 at a time
    assert events[0].message.startswith("The job has successfully completed")
    assert events[-1].message == f"Created fine-tuning job: {job.id}"
    assert [e.created_at for e in events] == sorted((e.created_at for e in events), reverse=True)
    metrics = [e for e in events if e.type == "metrics"]
    assert [e.data["step"] for e in metrics] == [6, 5, 4, 3, 2, 1]
    assert all(e.data["train_loss"] > 0 for e in metrics)
    assert len({e.id for e in events}) == len(events)

    # Checkpoints: one an epoch, newest first, each a usable model id.
    ckpts = client.fine_tuning.jobs.checkpoints.list(job.id)
    assert [c.step_number for c in ckpts.data] == [6, 3]
    assert ckpts.data[0].fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-6"
    assert ckpts.data[0].metrics.train_loss > 0
    assert client.models.retrieve(ckpts.data[1].fine_tuned_model_checkpoint).owned_by == "local"

    # A dpo job on the preference file; the wrong format for a method is a 400 naming the file.
    with pytest.raises(openai.BadRequestError) as err:
        client.fine_tuning.jobs.create(model="tiny", training_file=prefs.id)
    assert err.value.param == "training_file"
    method = {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2}}}
    full = {"megatrain": {"training_method": "full"}}
    dpo = client.fine_tuning.jobs.create(model="tiny", training_file=prefs.id, method=method, extra_body=full)
    assert dpo.method.dpo.hyperparameters.beta == 0.2 and dpo.method.type == "dpo"
    assert dpo.model_extra["megatrain"]["training_method"] == "full"
    assert wait_for(lambda: finished_job(client, dpo.id)).status == "succeeded"
    # Continuing a LoRA fine-tuned model trains its adapters (test_openai_training): not every weight.
    with pytest.raises(openai.BadRequestError, match="LoRA fine-tune") as err:
        client.fine_tuning.jobs.create(model=done.fine_tuned_model, training_file=chat.id, extra_body=full)
    assert err.value.param == "megatrain.training_method"

    # Jobs: newest first, cursor pages, a metadata filter.
    assert [j.id for j in client.fine_tuning.jobs.list()] == [dpo.id, job.id]
    first = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in first.data] == [dpo.id] and first.has_more
    assert [j.id for j in first.get_next_page().data] == [job.id]
    assert [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "a"})] == [job.id]

    # Models: the base and both fine-tuned models; a deleted one is gone (its job stays).
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "tiny" and set(ids[1:]) == {
        done.fine_tuned_model,
        finished_job(client, dpo.id).fine_tuned_model,
    }
    assert client.models.retrieve("tiny").owned_by == "local"
    assert client.models.delete(done.fine_tuned_model).deleted
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(done.fine_tuned_model)
    assert client.fine_tuning.jobs.retrieve(job.id).fine_tuned_model is None

    # A file a job trains on is deleted once nothing unfinished reads it.
    assert client.files.delete(pc.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(pc.id)

    # Continuing from a full fine-tuned model: a job starting from its last checkpoint.
    dpo_model = client.fine_tuning.jobs.retrieve(dpo.id).fine_tuned_model
    more = client.fine_tuning.jobs.create(model=dpo_model, training_file=chat.id)  # (full: as it was)
    assert more.model == dpo_model and more.model_extra["megatrain"]["training_method"] == "full"
    job_id = more.model_extra["megatrain"]["job_id"]
    spec = httpx.get(
        f"{stack.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {stack.key}"}
    ).json()["spec"]
    last = client.fine_tuning.jobs.checkpoints.list(dpo.id).data[0].step_number
    assert spec["model"]["init_from"] == f"checkpoint:{dpo.id.removeprefix('ft')}@{last}"
    assert client.fine_tuning.jobs.cancel(more.id).status in ("cancelled", "running")

    every = {"file", "file_list", "file_deleted", "job", "job_list", "event_list", "checkpoint_list", "model",
             "model_list", "model_deleted", "error", "document"}  # fmt: skip
    assert check.checked.keys() >= every


def test_pause_resume_and_cancel(stack: LiveApi, check: SchemaCheck, monkeypatch: pytest.MonkeyPatch) -> None:
    # 30 steps of 0.25 s: the pause (asked at step 3) lands well before the end, on a loaded host too.
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.25")  # (read by the runners this process spawns)
    register_model(stack.url, stack.key, "tiny", tiny_model(stack.data_path.parent / "tiny"))
    pause_resume_and_cancel(sdk(stack.url, stack.key, check))


def test_another_tenants_ids_are_404_everywhere(stack: LiveApi, check: SchemaCheck) -> None:
    register_model(stack.url, stack.key, "tiny", tiny_model(stack.data_path.parent / "tiny"))
    mine = sdk(stack.url, stack.key, check)
    theirs = sdk(stack.url, _other_key(stack), check)
    f = _upload(mine, chat_records(2))
    job = mine.fine_tuning.jobs.create(model="tiny", training_file=f.id, hyperparameters={"batch_size": 1})
    done = wait_for(lambda: finished_job(mine, job.id))
    ckpt = mine.fine_tuning.jobs.checkpoints.list(job.id).data[0]
    calls = {
        "files.retrieve": lambda: theirs.files.retrieve(f.id),
        "files.content": lambda: theirs.files.content(f.id),
        "files.delete": lambda: theirs.files.delete(f.id),
        "jobs.retrieve": lambda: theirs.fine_tuning.jobs.retrieve(job.id),
        "jobs.cancel": lambda: theirs.fine_tuning.jobs.cancel(job.id),
        "jobs.pause": lambda: theirs.fine_tuning.jobs.pause(job.id),
        "jobs.resume": lambda: theirs.fine_tuning.jobs.resume(job.id),
        "jobs.list_events": lambda: theirs.fine_tuning.jobs.list_events(job.id),
        "jobs.checkpoints": lambda: theirs.fine_tuning.jobs.checkpoints.list(job.id),
        "models.retrieve": lambda: theirs.models.retrieve(done.fine_tuned_model),
        "models.retrieve checkpoint": lambda: theirs.models.retrieve(ckpt.fine_tuned_model_checkpoint),
        "models.delete": lambda: theirs.models.delete(done.fine_tuned_model),
        "models.retrieve base": lambda: theirs.models.retrieve("tiny"),
        "jobs.create on their file": lambda: theirs.fine_tuning.jobs.create(model="tiny", training_file=f.id),
        "jobs.create from their model": lambda: theirs.fine_tuning.jobs.create(
            model=done.fine_tuned_model, training_file=f.id
        ),
    }
    for name, call in calls.items():
        with pytest.raises(openai.NotFoundError):
            call()
            pytest.fail(f"{name} answered another tenant")
    assert theirs.files.list().data == [] and theirs.fine_tuning.jobs.list().data == []
    assert [m.id for m in theirs.models.list()] == []
    # Their own key still works; ours still sees everything.
    assert mine.files.retrieve(f.id).id == f.id and mine.models.retrieve(done.fine_tuned_model)


def test_errors_are_openais(stack: LiveApi, check: SchemaCheck) -> None:
    client = sdk(stack.url, stack.key, check)
    with pytest.raises(openai.AuthenticationError):
        sdk(stack.url, "mt_" + "x" * 40, check).models.list()
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o-mini")
    assert err.value.code == "model_not_found"
    f = _upload(client, chat_records(2))
    with pytest.raises(openai.BadRequestError) as err:  # validation: OpenAI's 400, naming the param
        client.fine_tuning.jobs.create(model="x", training_file=f.id, suffix="no:colons")
    assert err.value.param == "suffix"
    with pytest.raises(openai.BadRequestError) as err:  # an argument OpenAI does not know either
        client.fine_tuning.jobs.create(model="x", training_file=f.id, extra_body={"nonsense": 1})
    assert err.value.param == "nonsense"
    with pytest.raises(openai.NotFoundError):  # unknown routes too
        client.get("/no/such/thing", cast_to=object)
    # Past the tenant's active jobs: a 429 with Retry-After (paused jobs stay active).
    register_model(stack.url, stack.key, "tiny", tiny_model(stack.data_path.parent / "tiny"))
    held = []
    for _ in range(2):
        held.append(client.fine_tuning.jobs.create(model="tiny", training_file=f.id))
        client.fine_tuning.jobs.pause(held[-1].id)
    with pytest.raises(openai.RateLimitError) as err:
        client.fine_tuning.jobs.create(model="tiny", training_file=f.id)
    assert err.value.response.headers["retry-after"] == "30" and err.value.code == "rate_limit_exceeded"
    for job in held:
        client.fine_tuning.jobs.cancel(job.id)
    # Base models: the tenant's own is forgotten on delete; the operator's shared one is not its to delete.
    with session_scope(stack.settings.resolved_database_url) as s:
        body = ModelCreate(name="common", url=(stack.data_path.parent / "tiny").as_uri())
        register_shared(s, stack.settings, body)
    assert {m.id: m.owned_by for m in client.models.list()} == {"common": "system", "tiny": "local"}
    with pytest.raises(openai.PermissionDeniedError):
        client.models.delete("common")
    assert client.models.delete("tiny").deleted
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny")
    # Our own /v1 keeps its shape.
    resp = httpx.get(f"{stack.url}/v1/jobs/nope", headers={"Authorization": f"Bearer {stack.key}"})
    assert resp.status_code == 404 and "detail" in resp.json()
    assert json.loads(httpx.get(f"{stack.url}/openai/v1/models").text)["error"]["code"] == "invalid_api_key"
