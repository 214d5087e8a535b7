"""Ingestion is idempotent: re-read files and resumed attempts never double-count."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sqlalchemy import func, select

from megatrain.db.models import Checkpoint, Job, JobEvent, JobLog, JobMetric
from megatrain.db.session import session_scope
from megatrain.settings import Settings
from megatrain.worker.ingest import JsonlTail, append_logs, ingest_events, ingest_metrics, next_log_seq


def _count(url: str, model: type, job_id: str, **where: object) -> int:
    with session_scope(url) as s:
        q = select(func.count()).select_from(model).where(model.job_id == job_id)
        for k, v in where.items():
            q = q.where(getattr(model, k) == v)
        return s.scalar(q)


def test_metrics_and_checkpoints_are_stored_once(settings: Settings, make_job: Callable[..., str]) -> None:
    url = settings.resolved_database_url
    job_id = make_job(schedule=False)
    rows = [{"step": 10, "loss": 2.0, "tokens_per_s": 5.0, "mfu": 0.3}, {"step": 10, "val_loss": 2.5}]
    ckpt = [{"event": "checkpoint_saved", "step": 10, "uri": "file:///x/iter_0000010", "size_bytes": 7}]
    with session_scope(url) as s:
        assert ingest_metrics(s, job_id, rows) == 2
        ingest_events(s, job_id, ckpt, attempt=1)
    # the same lines again (a restarted runner), then a resumed attempt rewriting step 10
    with session_scope(url) as s:
        assert ingest_metrics(s, job_id, rows) == 0
        assert ingest_metrics(s, job_id, [{"step": 10, "loss": 9.9}, {"step": 11, "loss": 1.9}]) == 1
        ingest_events(s, job_id, ckpt, attempt=2)
    assert _count(url, JobMetric, job_id) == 3
    assert _count(url, Checkpoint, job_id) == 1
    assert _count(url, JobEvent, job_id, kind="checkpoint_saved") == 1
    with session_scope(url) as s:
        first = s.scalar(
            select(JobMetric).where(
                JobMetric.job_id == job_id, JobMetric.kind == "train", JobMetric.step == 10
            )
        )
        assert first.loss == 2.0 and first.data["tokens_per_s"] == 5.0
        job = s.get(Job, job_id)
        assert (job.current_step, job.latest_loss) == (11, 1.9)


def test_tail_reads_only_complete_lines_and_rereads_until_committed(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # no file yet
    path.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"step"')
    assert tail.read() == [{"step": 1}, {"step": 2}]
    assert tail.read() == [{"step": 1}, {"step": 2}]  # not committed: the same rows again
    tail.commit()
    assert tail.read() == []
    with open(path, "a") as f:
        f.write(": 3}\n")
    assert tail.read() == [{"step": 3}]


def test_log_seq_continues_and_is_capped(settings: Settings, make_job: Callable[..., str]) -> None:
    url = settings.resolved_database_url
    job_id = make_job(schedule=False)
    with session_scope(url) as s:
        assert next_log_seq(s, job_id) == 1
        nxt = append_logs(s, job_id, [f"a{i}" for i in range(80)], 1, max_lines=100)
    with session_scope(url) as s:
        assert next_log_seq(s, job_id) == nxt == 81
        append_logs(s, job_id, [f"b{i}" for i in range(50)], nxt, max_lines=100)
    with session_scope(url) as s:
        seqs = s.scalars(select(JobLog.seq).where(JobLog.job_id == job_id).order_by(JobLog.seq)).all()
    assert seqs == list(range(31, 131))


def _steps(url: str, job_id: str) -> list[int]:
    with session_scope(url) as s:
        q = select(Checkpoint.step).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
        return list(s.scalars(q).all())


def _saved(step: int) -> dict[str, object]:
    return {"event": "checkpoint_saved", "step": step, "uri": f"file:///x/iter_{step:07d}", "size_bytes": 1}


def test_retention_removes_rows_once_and_reread_saves_stay_deleted(
    settings: Settings, make_job: Callable[..., str]
) -> None:
    url = settings.resolved_database_url
    job_id = make_job(schedule=False)
    events = [_saved(3), _saved(6), _saved(9), {"event": "checkpoints_deleted", "steps": [3, 6]}]
    with session_scope(url) as s:
        ingest_events(s, job_id, events, attempt=1)
    assert _steps(url, job_id) == [9]
    with session_scope(url) as s:
        kinds = s.execute(
            select(JobEvent.kind, JobEvent.reason, JobEvent.data).where(
                JobEvent.job_id == job_id, JobEvent.kind == "checkpoints_deleted"
            )
        ).all()
    assert len(kinds) == 1 and kinds[0].data["steps"] == [3, 6] and "3, 6" in kinds[0].reason
    # The same file read again (a restarted runner), then only its saves (a backfill of attempt 1).
    with session_scope(url) as s:
        ingest_events(s, job_id, events, attempt=1)
        ingest_events(s, job_id, [_saved(3), _saved(6)], attempt=1)
    assert _steps(url, job_id) == [9]
    assert _count(url, JobEvent, job_id, kind="checkpoints_deleted") == 1
    # A later attempt that resumed below step 6 and saved it again has a new checkpoint.
    with session_scope(url) as s:
        ingest_events(s, job_id, [_saved(6)], attempt=2)
    assert _steps(url, job_id) == [6, 9]


def test_corrupt_checkpoint_becomes_an_event_with_its_reason(
    settings: Settings, make_job: Callable[..., str]
) -> None:
    url = settings.resolved_database_url
    job_id = make_job(schedule=False)
    row = {"event": "checkpoint_corrupt", "step": 9, "reason": "crc32 mismatch in model_0.bin"}
    with session_scope(url) as s:
        ingest_events(s, job_id, [row], attempt=2)
    with session_scope(url) as s:
        ev = s.scalar(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "checkpoint_corrupt")
        )
    assert ev is not None and "crc32 mismatch in model_0.bin" in ev.reason and "step 9" in ev.reason
    assert ev.data == {"step": 9, "reason": "crc32 mismatch in model_0.bin", "attempt": 2}


def test_a_corrupt_checkpoint_is_no_longer_listed_until_saved_again(
    settings: Settings, make_job: Callable[..., str]
) -> None:
    """Found corrupt by attempt 2's resume: its row goes (no download, no init_from of it), a
    backfill of attempt 1's save does not bring it back, attempt 2's own save of the step does; when
    every checkpoint was corrupt and set aside, none is listed."""
    url = settings.resolved_database_url
    job_id = make_job(schedule=False)
    with session_scope(url) as s:
        ingest_events(s, job_id, [_saved(3), _saved(6)], attempt=1)
        ingest_events(s, job_id, [{"event": "checkpoint_corrupt", "step": 6, "reason": "sha256"}], attempt=2)
    assert _steps(url, job_id) == [3]
    with session_scope(url) as s:
        ingest_events(s, job_id, [_saved(6)], attempt=1)  # a backfill of the first attempt's events
    assert _steps(url, job_id) == [3]
    with session_scope(url) as s:
        ingest_events(s, job_id, [_saved(6)], attempt=2)  # resumed from 3, saved 6 anew
    assert _steps(url, job_id) == [3, 6]
    with session_scope(url) as s:
        ingest_events(s, job_id, [{"event": "checkpoints_set_aside", "steps": [6, 3]}], attempt=3)
        reason = s.scalar(select(JobEvent.reason).where(JobEvent.kind == "checkpoints_set_aside"))
    assert _steps(url, job_id) == [] and reason is not None and "steps 6, 3" in reason


def test_a_straggler_is_named_on_the_job(settings: Settings, make_job: Callable[..., str]) -> None:
    url = settings.resolved_database_url
    job_id = make_job(schedule=False)
    text = "rank 3 on node-b is a straggler: its own work per step took 1.62x the median rank's 0.410 s"
    row = {"event": "straggler", "step": 30, "rank": 3, "host": "node-b", "ratio": 1.62, "median_s": 0.41,
           "reason": text}  # fmt: skip
    with session_scope(url) as s:
        ingest_events(s, job_id, [row, {"event": "straggler", "reason": "no rank: ignored"}], attempt=1)
    with session_scope(url) as s:
        (ev,) = s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "straggler"))
    assert ev.reason == text
    assert ev.data == {k: v for k, v in row.items() if k != "event"} | {"attempt": 1}
