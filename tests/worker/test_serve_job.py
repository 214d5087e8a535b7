"""A serve job under the shard runner with the real engine: the model server starts on a free port,
publishes its address as a `serving` job event, answers (greedy: generate()'s tokens) the requests
that carry its attempt's token, and ends cleanly: by itself once idle (succeeded), or on cancel
(cancelled)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from worker_helpers import wait_for

from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import CANCELLED, SUCCEEDED, Job, JobEvent, JobLog, Node
from megatrain.db.session import session_scope
from megatrain.plan.layout import resolve_layout
from megatrain.progress_files import read_progress
from megatrain.settings import Settings, get_settings, reset_settings_cache
from megatrain.spec import parse_spec
from megatrain.worker.shard import run_shard

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)]
MODEL = {"arch": "llama", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 32,
         "init_method_std": 0.3}  # fmt: skip
PROMPT = [72, 105, 33]


def _base_checkpoint(settings: Settings) -> Any:
    """A tiny model saved as job `job_base`'s checkpoint (what `checkpoint:job_base` names)."""
    import torch

    from megatrain.engine.checkpoint import save_model
    from megatrain.engine.config import transformer_config
    from megatrain.engine.models.gpt import GPTModel

    spec = parse_spec({"name": "base", "model": MODEL, "data": {"train": [{"path": "file:///dev/null"}]}})
    torch.manual_seed(0)
    model = GPTModel(transformer_config(spec, 257)).eval()
    save_model(f"{settings.resolved_storage_url}/jobs/job_base/checkpoints", 1, model, spec)
    return model


def _serve_job(settings: Settings, make_job: Callable[..., str]) -> str:
    spec = {"name": "serve-base", "kind": "serve", "model": {**MODEL, "init_from": "checkpoint:job_base"},
            "data": {"tokenizer": {"type": "byte"}}, "training": {"precision": "fp32"},
            "resources": {"devices": 1, "max_runtime_s": 300}}  # fmt: skip
    job_id = make_job(schedule=False)
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        job.kind, job.spec, job.layout = "serve", spec, resolve_layout(parse_spec(spec)).as_dict()
    with session_scope(settings.resolved_database_url) as s:
        assert reserve_and_schedule(s, job_id, s.scalar(select(Node.id).where(Node.hostname == "testnode")))
    return job_id


def _url(settings: Settings, job_id: str) -> str | None:
    with session_scope(settings.resolved_database_url) as s:
        data = s.scalar(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "serving"))
        return data["url"] if data else None


def _status(settings: Settings, job_id: str) -> tuple[str, str]:
    with session_scope(settings.resolved_database_url) as s:
        job = s.get(Job, job_id)
        log = "\n".join(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)))
        return job.status, f"{job.status_reason}\n--- log ---\n{log}"


def _auth(settings: Settings, job_id: str) -> dict[str, str]:
    """The header the running attempt's server asks for (the token its runner set on the job)."""
    with session_scope(settings.resolved_database_url) as s:
        return {"authorization": f"Bearer {s.get(Job, job_id).serve_token}"}


def _start(settings: Settings, make_job: Callable[..., str]) -> tuple[str, threading.Thread, str, Any]:
    model = _base_checkpoint(settings)
    job_id = _serve_job(settings, make_job)
    runner = threading.Thread(target=run_shard, args=(job_id, settings), daemon=True)
    runner.start()
    try:
        url = wait_for(lambda: _url(settings, job_id), timeout=90, interval=0.1)
    except AssertionError:
        pytest.fail(f"the server never listened: {_status(settings, job_id)}")
    return job_id, runner, url, model


@pytest.fixture
def real_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.delenv("MEGATRAIN_ENGINE_MODULE", raising=False)


def test_a_serve_job_answers_then_ends_when_idle(
    real_engine: None, make_job: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRAIN_SERVE_IDLE_TIMEOUT_S", "2")
    reset_settings_cache()
    settings = get_settings()
    from megatrain.engine.generate import generate

    job_id, runner, url, model = _start(settings, make_job)
    body = {"model": "base", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 401  # no token
    answer = httpx.post(
        f"{url}/v1/completions", json=body, headers=_auth(settings, job_id), timeout=30
    ).json()
    choice = answer["choices"][0]
    want = generate(model, PROMPT, 8, eos_id=256, vocab_limit=257)
    assert answer["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": len(want),
        "total_tokens": 3 + len(want),
    }
    assert choice["text"] == bytes(t for t in want if t < 256).decode("utf-8", "replace")
    runner.join(timeout=60)  # idle for 2 s: the server stops by itself
    status, why = _status(settings, job_id)
    assert not runner.is_alive() and status == SUCCEEDED, why
    with session_scope(settings.resolved_database_url) as s:  # the token ended with its server
        assert s.get(Job, job_id).serve_token is None
    # The batching thread ticked the hang watch's progress file while it served.
    (progress,) = read_progress(settings.runs_dir / job_id / "attempt-1")
    assert progress.phase == "serving" and progress.step >= 1


def test_a_cancelled_serve_job_stops_cleanly(
    real_engine: None, settings: Settings, make_job: Callable[..., str]
) -> None:
    job_id, runner, url, _ = _start(settings, make_job)
    assert httpx.get(f"{url}/health", headers=_auth(settings, job_id), timeout=10).json()["status"] == "ok"
    with session_scope(settings.resolved_database_url) as s:
        s.get(Job, job_id).cancel_requested = True
    runner.join(timeout=60)
    status, why = _status(settings, job_id)
    assert not runner.is_alive() and status == CANCELLED, why
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)
