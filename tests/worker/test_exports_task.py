"""The export task on a real checkpoint: an fp32 export of an engine-trained checkpoint loads in
transformers with the logits of `load_checkpoint`'s model and carries the job's tokenizer.json; a
LoRA checkpoint's merged model loads in transformers and its adapter in peft, both with our LoRA
model's logits; a missing checkpoint (or adapters) fails with its reason and leaves nothing behind;
the scheduler hands exports out once and recovers lost workers (a Celery worker's run:
test_checkpoint_tasks_celery.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fixtures.checkpoints import train_job_checkpoint
from sqlalchemy import select, update
from worker_helpers import add_row, get_row, wait_for

from megatrain.db.models import FAILED, PENDING, READY, RUNNING_EXPORT, Checkpoint, CheckpointExport, utcnow
from megatrain.db.session import session_scope
from megatrain.scheduler.exports import (
    MAX_EXPORT_ATTEMPTS,
    UNCLAIMED_RESUBMIT_S,
    dispatch_exports,
    reconcile_exports,
)
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.storage import open_store
from megatrain.worker.executors import LocalExecutor
from megatrain.worker.exports import export_checkpoint

ATOL = 1e-5  # fp32 logits of the same weights; reduction orders differ by a few ulps


def _add_export(settings: Settings, job_id: str, step: int, dtype: str = "fp32", **row: object) -> str:
    return add_row(
        settings, CheckpointExport, job_id=job_id, step=step, format="hf", dtype=dtype, status=PENDING, **row
    )


def _row(settings: Settings, export_id: str) -> CheckpointExport:
    return get_row(settings, CheckpointExport, export_id)


def test_fp32_export_loads_in_transformers_with_the_checkpoints_logits(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    job_id = make_job(schedule=False)
    train_job_checkpoint(settings, job_id, tmp_path / "train")
    with session_scope(settings.resolved_database_url) as s:
        assert s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)).all() == [2]
    export_id = _add_export(settings, job_id, 2)
    assert export_checkpoint(export_id, settings) == READY
    assert export_checkpoint(export_id, settings) is None  # a second delivery does nothing
    exp = _row(settings, export_id)
    folder = f"{settings.resolved_storage_url}/jobs/{job_id}/exports/hf/iter_0000002-fp32"
    assert (exp.status, exp.uri, exp.error) == (READY, folder, "")
    path = Path(folder.removeprefix("file://"))
    assert exp.size_bytes == sum(p.stat().st_size for p in path.iterdir())
    assert (path / "tokenizer.json").read_bytes() == (tmp_path / "train" / "tokenizer.json").read_bytes()
    assert {p.name for p in path.iterdir()} >= {"tokenizer_config.json", "special_tokens_map.json",
                                                "generation_config.json"}  # fmt: skip

    tokenizer = _assert_same_model(
        f"{settings.resolved_storage_url}/jobs/{job_id}/checkpoints/iter_0000002", path
    )
    # generate() stops at the end-of-document token the job's documents ended with.
    generation = transformers.GenerationConfig.from_pretrained(path)
    assert (
        generation.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    )
    assert generation.pad_token_id == tokenizer.pad_token_id == generation.eos_token_id


def _assert_same_model(checkpoint_url: str, folder: Path) -> Any:
    """transformers' model from `folder` (fp32) computes load_checkpoint's logits; returns the
    folder's tokenizer."""
    import torch
    import transformers

    from megatrain.engine.checkpoint import load_checkpoint

    ours, spec = load_checkpoint(checkpoint_url)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert theirs.dtype == torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "def add(a, b):\n    return a + b"
    tokens = torch.tensor([tokenizer.encode(text)[: spec.model.seq_length]])
    with torch.no_grad():
        want = ours(tokens)
        got = theirs(tokens).logits
    # The export keeps the tokenizer's rows and drops the engine's padding rows (never predicted).
    assert got.shape[-1] == len(tokenizer) < want.shape[-1]
    torch.testing.assert_close(got, want[..., : got.shape[-1]], atol=ATOL, rtol=0)
    return tokenizer


TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


def test_a_lora_job_exports_its_merged_model_and_its_peft_adapter(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    """Both forms of one LoRA checkpoint: the merged model loads in transformers, the adapter in
    peft on the frozen base, and both compute the logits of our model with its adapters."""
    import torch

    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    job_id = make_job(schedule=False)
    train_job_checkpoint(settings, job_id, tmp_path / "train", lora={"rank": 4, "alpha": 8.0})
    merged_id, adapter_id = _add_export(settings, job_id, 2), _add_export(settings, job_id, 2, form="adapter")
    assert export_checkpoint(merged_id, settings) == READY
    assert export_checkpoint(adapter_id, settings) == READY
    storage = settings.resolved_storage_url
    merged, adapter = _row(settings, merged_id), _row(settings, adapter_id)
    assert merged.uri == f"{storage}/jobs/{job_id}/exports/hf/iter_0000002-fp32"
    assert adapter.uri == f"{storage}/jobs/{job_id}/exports/hf/iter_0000002-fp32-adapter"
    merged_path, adapter_path = (Path(e.uri.removeprefix("file://")) for e in (merged, adapter))
    assert {p.name for p in merged_path.iterdir()} == {
        "config.json", "model.safetensors", "generation_config.json", *TOKENIZER_FILES
    }  # fmt: skip
    assert {p.name for p in adapter_path.iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", *TOKENIZER_FILES
    }  # fmt: skip
    for name in TOKENIZER_FILES:  # the job's tokenizer, the same in both
        assert (merged_path / name).read_bytes() == (adapter_path / name).read_bytes(), name
    assert (merged_path / "tokenizer.json").read_bytes() == (
        tmp_path / "train" / "tokenizer.json"
    ).read_bytes()
    config = json.loads((adapter_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, None)

    checkpoint = f"{storage}/jobs/{job_id}/checkpoints/iter_0000002"
    ours = _our_lora_model(checkpoint, tmp_path / "base")
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged_path)
    tokens = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b")[:16]])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        want = ours(tokens)[..., : len(tokenizer)]
        got = transformers.AutoModelForCausalLM.from_pretrained(merged_path).eval()(tokens).logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        with_adapter = peft.PeftModel.from_pretrained(base, adapter_path).eval()
        torch.testing.assert_close(with_adapter(tokens).logits, want, atol=ATOL, rtol=0)
        with with_adapter.disable_adapter():  # two steps moved the adapters: the check has teeth
            assert (with_adapter(tokens).logits - want).abs().max() > 100 * ATOL


def _our_lora_model(checkpoint_url: str, base_folder: Path) -> Any:
    """Our model with its adapters, every tensor read from the checkpoint; its frozen base is exported
    to `base_folder` (transformers' model for peft to load the adapter on)."""
    import torch

    from megatrain.engine.build import build_model
    from megatrain.engine.checkpoint import CheckpointReader
    from megatrain.engine.config import lora_config
    from megatrain.engine.interop.hf import export_hf
    from megatrain.engine.parallel.state import ParallelState

    reader = CheckpointReader(checkpoint_url)
    cfg, lora = reader.model_config, lora_config(reader.spec)
    model = build_model(cfg, ParallelState.single(), seed=0, device="cpu", lora=lora).module.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.tensor(name))
    export_hf(reader.tensor, cfg, base_folder, dtype=torch.float32)  # the base: no adapter merged
    return model


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_export_on_s3_storage(
    settings: Settings,
    make_job: Callable[..., str],
    tmp_path: Path,
    s3_bucket_url: str,
    moto_s3_endpoint: str,
) -> None:
    pytest.importorskip("transformers")
    s3 = settings.model_copy(
        update={"storage_url": f"{s3_bucket_url}/prod", "s3_endpoint_url": moto_s3_endpoint}
    )
    job_id = make_job(schedule=False)
    train_job_checkpoint(s3, job_id, tmp_path / "train")
    export_id = _add_export(s3, job_id, 2)
    assert export_checkpoint(export_id, s3) == READY
    exp = _row(s3, export_id)
    assert exp.uri == f"{s3_bucket_url}/prod/jobs/{job_id}/exports/hf/iter_0000002-fp32"
    store = open_store(exp.uri, moto_s3_endpoint)
    local = tmp_path / "fetched"
    for obj in store.list():
        store.get_file(obj.key, local / obj.key)
    assert exp.size_bytes == sum(o.size for o in store.list())
    _assert_same_model(f"{s3_bucket_url}/prod/jobs/{job_id}/checkpoints/iter_0000002", local)


def test_missing_checkpoint_fails_with_its_reason_and_leaves_nothing(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    job_id = make_job(schedule=False)
    export_id = _add_export(settings, job_id, 40, dtype="bf16")
    store = open_store(settings.resolved_storage_url)
    stale = f"jobs/{job_id}/exports/hf/iter_0000040-bf16/model.safetensors"
    store.put_bytes(stale, b"left by a lost attempt")
    assert export_checkpoint(export_id, settings) == FAILED
    exp = _row(settings, export_id)
    assert exp.status == FAILED and "iter_0000040" in exp.error and exp.finished_at is not None
    assert store.list(f"jobs/{job_id}/exports") == []
    # An adapter of a checkpoint that trained every weight (a row the API would have refused).
    train_job_checkpoint(settings, job_id, tmp_path / "train")
    export_id = _add_export(settings, job_id, 2, form="adapter")
    assert export_checkpoint(export_id, settings) == FAILED
    assert "training.method is 'full'" in _row(settings, export_id).error
    assert store.list(f"jobs/{job_id}/exports") == []


class _Recorder:
    def __init__(self) -> None:
        self.exports: list[str] = []

    def submit_export(self, export_id: str) -> None:
        self.exports.append(export_id)


def test_dispatch_once_and_recover_lost_workers(settings: Settings, make_job: Callable[..., str]) -> None:
    job_id = make_job(schedule=False)
    first, second = _add_export(settings, job_id, 1), _add_export(settings, job_id, 2)
    executor = _Recorder()
    assert dispatch_exports(settings, executor) == [first, second]  # type: ignore[arg-type]
    assert dispatch_exports(settings, executor) == []
    assert executor.exports == [first, second]
    old = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s + 5)
    with session_scope(settings.resolved_database_url) as s:
        for export_id, attempt in ((first, 1), (second, MAX_EXPORT_ATTEMPTS)):
            s.execute(
                update(CheckpointExport)
                .where(CheckpointExport.id == export_id)
                .values(status=RUNNING_EXPORT, attempt=attempt, runner_host="elsewhere", heartbeat_at=old)
            )
    assert sorted(reconcile_exports(settings, LocalExecutor(settings))) == sorted([first, second])
    retried, given_up = _row(settings, first), _row(settings, second)
    assert (retried.status, retried.submitted_at) == (PENDING, None) and "retrying" in retried.error
    assert given_up.status == FAILED and "giving up" in given_up.error
    assert dispatch_exports(settings, executor) == [first]
    # Handed out but never claimed (its process died first): handed out again after a while.
    with session_scope(settings.resolved_database_url) as s:
        s.execute(
            update(CheckpointExport)
            .where(CheckpointExport.id == first)
            .values(submitted_at=utcnow() - timedelta(seconds=UNCLAIMED_RESUBMIT_S + 5))
        )
    assert reconcile_exports(settings, LocalExecutor(settings)) == [first]
    assert dispatch_exports(settings, executor) == [first]
    assert reconcile_exports(settings, LocalExecutor(settings)) == []


def _wait_done(settings: Settings, export_id: str, timeout_s: float = 120.0) -> CheckpointExport:
    wait_for(lambda: _row(settings, export_id).status in (READY, FAILED), timeout_s, interval=0.2)
    return _row(settings, export_id)


def test_the_local_executor_exports_through_the_scheduler(
    settings: Settings, make_job: Callable[..., str], tmp_path: Path
) -> None:
    """The real path: the scheduler hands the export to a detached `python -m megatrain.worker.exports`."""
    pytest.importorskip("transformers")
    job_id = make_job(schedule=False)
    train_job_checkpoint(settings, job_id, tmp_path / "train")
    export_id = _add_export(settings, job_id, 2, dtype="bf16")
    sched = Scheduler(settings, executor=LocalExecutor(settings))
    assert sched.exports_once() == [export_id]
    assert sched.exports_once() == []  # handed out once
    exp = _wait_done(settings, export_id)
    assert exp.status == READY, exp.error
    assert exp.runner_host is not None and exp.attempt == 1
    config = json.loads(open_store(exp.uri).get_bytes("config.json"))
    assert config["dtype"] == "bfloat16"


@pytest.mark.parametrize(
    ("init_from", "recorded"),
    [
        (None, None),
        ("hf:file:///models/llama", "/models/llama"),  # a local folder: AutoPeftModel loads it
        ("hf:s3://bucket/llama", "s3://bucket/llama"),
        ("checkpoint:job-1@20", "checkpoint:job-1@20"),
    ],
)
def test_an_adapter_names_the_base_its_job_started_from(init_from: str | None, recorded: str | None) -> None:
    from megatrain.worker.exports import _base_model

    assert _base_model(init_from) == recorded
