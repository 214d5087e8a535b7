"""The sample task on a real checkpoint: its text is the engine CheckpointSampler's for the same
arguments (greedy and seeded), and greedy decoding continues the prompt as transformers' generate()
does on the Hugging Face export of the same checkpoint; a prompt too long for the model and a
missing checkpoint are failed samples with their reasons; the scheduler hands samples out once,
recovers lost workers, and the local executor runs one end to end."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from fixtures.checkpoints import train_job_checkpoint
from sqlalchemy import update
from worker_helpers import wait_for

from megatrain.db.models import FAILED, PENDING, READY, RUNNING_EXPORT, CheckpointSample, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.scheduler.samples import MAX_SAMPLE_ATTEMPTS, dispatch_samples, reconcile_samples
from megatrain.settings import Settings
from megatrain.worker.executors import LocalExecutor
from megatrain.worker.samples import sample_checkpoint

PROMPT = "def add(a, b):\n"


def _add_sample(settings: Settings, job_id: str, step: int, prompt: str = PROMPT, **row: object) -> str:
    with session_scope(settings.resolved_database_url) as s:
        sample = CheckpointSample(job_id=job_id, step=step, prompt=prompt, status=PENDING, **row)
        s.add(sample)
        s.flush()
        return sample.id


def _row(settings: Settings, sample_id: str) -> CheckpointSample:
    with session_scope(settings.resolved_database_url) as s:
        row = s.get(CheckpointSample, sample_id)
        s.expunge(row)
        return row


def test_text_equals_the_samplers_and_transformers_greedy(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from megatrain.engine.interop.hf import export_checkpoint_hf
    from megatrain.engine.sampling import CheckpointSampler

    job_id = make_job(schedule=False)
    train_job_checkpoint(settings, job_id, tmp_path / "train")
    folder = f"{settings.resolved_storage_url}/jobs/{job_id}/checkpoints/iter_0000002"
    greedy = _add_sample(settings, job_id, 2, max_new_tokens=10)
    seeded = _add_sample(
        settings, job_id, 2, max_new_tokens=10, temperature=1.5, top_k=50, top_p=0.95, seed=7
    )
    assert sample_checkpoint(greedy, settings) == READY
    assert sample_checkpoint(greedy, settings) is None  # a second delivery does nothing
    assert sample_checkpoint(seeded, settings) == READY

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
    settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    job_id = make_job(schedule=False)
    train_job_checkpoint(settings, job_id, tmp_path / "train")
    too_long = _add_sample(settings, job_id, 2, prompt="print(i) " * 40)
    missing = _add_sample(settings, job_id, 40)
    assert sample_checkpoint(too_long, settings) == FAILED
    row = _row(settings, too_long)
    assert "this model reads at most 15" in row.error and row.text is None and row.finished_at is not None
    assert sample_checkpoint(missing, settings) == FAILED
    assert "iter_0000040" in _row(settings, missing).error


class _Recorder:
    def __init__(self) -> None:
        self.samples: list[str] = []

    def submit_sample(self, sample_id: str) -> None:
        self.samples.append(sample_id)


def test_dispatch_once_and_recover_lost_workers(settings: Settings, make_job: Callable[..., str]) -> None:
    job_id = make_job(schedule=False)
    first, second = _add_sample(settings, job_id, 1), _add_sample(settings, job_id, 2)
    executor = _Recorder()
    assert dispatch_samples(settings, executor) == [first, second]  # type: ignore[arg-type]
    assert dispatch_samples(settings, executor) == []  # type: ignore[arg-type]
    old = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s + 5)
    with session_scope(settings.resolved_database_url) as s:
        for sample_id, attempt in ((first, 1), (second, MAX_SAMPLE_ATTEMPTS)):
            s.execute(
                update(CheckpointSample)
                .where(CheckpointSample.id == sample_id)
                .values(status=RUNNING_EXPORT, attempt=attempt, runner_host="elsewhere", heartbeat_at=old)
            )
    assert sorted(reconcile_samples(settings)) == sorted([first, second])
    assert _row(settings, first).status == PENDING and "retrying" in _row(settings, first).error
    assert _row(settings, second).status == FAILED and "giving up" in _row(settings, second).error
    assert dispatch_samples(settings, executor) == [first]  # type: ignore[arg-type]
    assert executor.samples == [first, second, first]


def test_the_local_executor_samples_through_the_scheduler(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    """The real path: the scheduler hands the sample to a detached `python -m megatrain.worker.samples`."""
    job_id = make_job(schedule=False)
    train_job_checkpoint(settings, job_id, tmp_path / "train")
    sample_id = _add_sample(settings, job_id, 2, max_new_tokens=4, seed=1, temperature=0.8)
    sched = Scheduler(settings, executor=LocalExecutor(settings))
    assert sched.samples_once() == [sample_id]
    assert sched.samples_once() == []  # handed out once
    wait_for(lambda: _row(settings, sample_id).status in (READY, FAILED), 120.0, interval=0.2)
    row = _row(settings, sample_id)
    assert row.status == READY, row.error
    assert row.runner_host is not None and row.attempt == 1 and row.new_tokens and row.text is not None
