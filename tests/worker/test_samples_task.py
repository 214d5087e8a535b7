"""The sample task on a real checkpoint: its text is the engine CheckpointSampler's for the same
arguments (greedy and seeded), and greedy decoding continues the prompt as transformers' generate()
does on the Hugging Face export of the same checkpoint; a prompt too long for the model and a
missing checkpoint are failed samples with their reasons; the scheduler hands samples out once,
recovers lost workers, and the local executor runs one end to end."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures.checkpoints import train_job_checkpoint
from worker_helpers import add_row, get_row, wait_for

from megatrain.db.models import FAILED, PENDING, READY, RUNNING_EXPORT, CheckpointSample, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.scheduler.samples import MAX_SAMPLE_ATTEMPTS, dispatch_samples, reconcile_samples
from megatrain.settings import Settings
from megatrain.worker.executors import LocalExecutor
from megatrain.worker.samples import get_sampler, sample_checkpoint

PROMPT = "def add(a, b):\n"


def _add_sample(settings: Settings, job_id: str, step: int, prompt: str = PROMPT, **row: object) -> str:
    return add_row(settings, CheckpointSample, job_id=job_id, step=step, prompt=prompt, status=PENDING, **row)


def _row(settings: Settings, sample_id: str) -> CheckpointSample:
    return get_row(settings, CheckpointSample, sample_id)


@pytest.fixture
def job_id(settings: Settings, make_job: Callable[..., str], tmp_path: Path) -> str:
    """A job with an engine-trained checkpoint at step 2 (seq_length 16, tokenizer.json in tmp_path/train)."""
    job = make_job(schedule=False)
    train_job_checkpoint(settings, job, tmp_path / "train")
    return job


def test_text_equals_the_samplers_and_transformers_greedy(
    settings: Settings, job_id: str, tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from megatrain.engine.interop.hf import export_checkpoint_hf
    from megatrain.engine.sampling import CheckpointSampler

    folder = f"{settings.resolved_storage_url}/jobs/{job_id}/checkpoints/iter_0000002"
    greedy = _add_sample(settings, job_id, 2, max_new_tokens=10)
    seeded = _add_sample(
        settings, job_id, 2, max_new_tokens=10, temperature=1.5, top_k=50, top_p=0.95, seed=7
    )
    assert sample_checkpoint(greedy, settings) == READY
    assert sample_checkpoint(greedy, settings) is None  # a second delivery does nothing
    assert sample_checkpoint(seeded, settings) == READY

    # The process's sampler keeps the model loaded for the next sample (a Celery worker's warm model).
    assert get_sampler() is get_sampler() and folder in get_sampler()._models
    reference = CheckpointSampler(keep=1)
    want = reference.sample(folder, PROMPT, 10)
    got = _row(settings, greedy)
    assert (got.status, got.error, got.attempt) == (READY, "", 1)
    assert (got.text, got.prompt_tokens, got.new_tokens) == (
        want.text,
        len(want.prompt_ids),
        len(want.new_ids),
    )
    assert got.new_tokens > 0 and got.elapsed_s is not None and got.finished_at is not None
    want_seeded = reference.sample(folder, PROMPT, 10, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    assert _row(settings, seeded).text == want_seeded.text

    # The same checkpoint in transformers: greedy generate() continues the prompt with the same ids.
    hf = tmp_path / "hf"
    tokenizer_file = (tmp_path / "train" / "tokenizer.json").read_bytes()
    eos = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "train" / "tokenizer.json"))
    eos_id = eos.convert_tokens_to_ids("<|endoftext|>")
    export_checkpoint_hf(
        folder, hf.as_uri(), dtype=torch.float32, tokenizer_files={"tokenizer.json": tokenizer_file},
        extra_config={"eos_token_id": eos_id},
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    ids = torch.tensor([want.prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, eos_token_id=eos_id,
        pad_token_id=eos_id,
    )  # fmt: skip
    theirs = out[0, ids.shape[1] :].tolist()
    # The engine stops where its context (seq_length 16) is full; transformers goes on past it.
    assert want.new_ids and want.new_ids == theirs[: len(want.new_ids)]
    assert len(want.new_ids) == len(theirs) or len(want.prompt_ids) + len(want.new_ids) == 16


def test_a_prompt_too_long_and_a_missing_checkpoint_fail_with_their_reasons(
    settings: Settings, job_id: str
) -> None:
    too_long = _add_sample(settings, job_id, 2, prompt="print(i) " * 40)
    missing = _add_sample(settings, job_id, 40)
    assert sample_checkpoint(too_long, settings) == FAILED
    row = _row(settings, too_long)
    assert "this model reads at most 15" in row.error and row.text is None and row.finished_at is not None
    assert sample_checkpoint(missing, settings) == FAILED
    assert "iter_0000040" in _row(settings, missing).error


def test_the_scheduler_hands_samples_out_once_and_gives_up_after_lost_workers(
    settings: Settings, make_job: Callable[..., str]
) -> None:
    job_id = make_job(schedule=False)  # no checkpoint needed: nothing runs the samples here
    ids = [_add_sample(settings, job_id, 1) for _ in range(2)]
    submitted: list[str] = []
    executor = SimpleNamespace(submit_sample=submitted.append)
    assert dispatch_samples(settings, executor) == ids and dispatch_samples(settings, executor) == []
    # Both workers stopped heartbeating: the first attempt is retried, the last one fails.
    silent_since = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s + 5)
    for sample_id, attempt in zip(ids, (1, MAX_SAMPLE_ATTEMPTS), strict=True):
        with session_scope(settings.resolved_database_url) as s:
            row = s.get(CheckpointSample, sample_id)
            row.status, row.attempt, row.heartbeat_at = RUNNING_EXPORT, attempt, silent_since
            row.runner_host = "gone"
    assert sorted(reconcile_samples(settings, LocalExecutor(settings))) == sorted(ids)
    retried, given_up = (_row(settings, i) for i in ids)
    assert (retried.status, given_up.status) == (PENDING, FAILED)
    assert "retrying" in retried.error and "giving up" in given_up.error
    assert dispatch_samples(settings, executor) == ids[:1] and submitted == [*ids, ids[0]]


def test_the_local_executor_samples_through_the_scheduler(settings: Settings, job_id: str) -> None:
    """The real path: the scheduler hands the sample to a detached `python -m megatrain.worker.samples`."""
    sample_id = _add_sample(settings, job_id, 2, max_new_tokens=4, seed=1, temperature=0.8)
    sched = Scheduler(settings, executor=LocalExecutor(settings))
    assert sched.samples_once() == [sample_id]
    assert sched.samples_once() == []  # handed out once
    wait_for(lambda: _row(settings, sample_id).status in (READY, FAILED), 120.0, interval=0.2)
    row = _row(settings, sample_id)
    assert row.status == READY, row.error
    assert row.runner_host is not None and row.attempt == 1 and row.new_tokens and row.text is not None
