"""The shard runner against the fake engine: ingestion, retries with resume, cancel, time limits."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fixtures.cluster import seed_job, seed_node
from sqlalchemy import func, select, update
from worker_helpers import alive, job_spec, wait_for

from megatrain.db.jobs import reserve_and_schedule
from megatrain.db.models import (
    CANCELLED,
    FAILED,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Checkpoint,
    Job,
    JobEvent,
    JobLog,
    JobMetric,
    Node,
)
from megatrain.db.session import session_scope
from megatrain.scheduler.loop import Scheduler
from megatrain.settings import Settings
from megatrain.worker import shard
from megatrain.worker.nodes import device_env, slot_cpus
from megatrain.worker.shard import run_shard


def _job(url: str, job_id: str) -> Job:
    with session_scope(url) as s:
        return s.get(Job, job_id)


def _events(url: str, job_id: str) -> list[JobEvent]:
    with session_scope(url) as s:
        return list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


def _log(url: str, job_id: str) -> str:
    with session_scope(url) as s:
        return "\n".join(s.scalars(select(JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)))


def _reschedule(url: str, job_id: str) -> None:
    with session_scope(url) as s:
        node_id = s.scalar(select(Node.id).where(Node.hostname == "testnode"))
        assert reserve_and_schedule(s, job_id, node_id, "again")


def test_success_ingests_metrics_events_logs_checkpoints(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path
) -> None:
    url = settings.resolved_database_url
    job_id = make_job(train_iters=20, checkpoint_interval=5)
    assert run_shard(job_id, settings) == 0
    job = _job(url, job_id)
    assert job.status == SUCCEEDED, job.status_reason
    assert (job.current_step, job.total_steps, job.num_params) == (20, 20, 1234)
    assert job.latest_loss == pytest.approx(0.5) and job.latest_tokens_per_s == pytest.approx(1020.0)
    assert job.node_id is None and job.finished_at is not None
    with session_scope(url) as s:
        steps = s.scalars(
            select(JobMetric.step).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
        ).all()
        assert steps == list(range(1, 21))
        ckpts = s.scalars(
            select(Checkpoint.step).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
        )
        assert list(ckpts) == [5, 10, 15, 20]
        lines = s.execute(
            select(JobLog.seq, JobLog.line).where(JobLog.job_id == job_id).order_by(JobLog.seq)
        ).all()
        assert s.get(Node, _job(url, job_id).node_id or "") is None
        assert sum(s.scalars(select(Node.slots_used))) == 0
    assert [seq for seq, _ in lines] == list(range(1, len(lines) + 1))
    assert any("step 20 loss 0.5000" in line for _, line in lines)
    kinds = [e.kind for e in _events(url, job_id)]
    assert kinds[:3] == ["scheduled", "running", "started"]
    assert kinds.count("checkpoint_saved") == 4 and kinds[-1] == "succeeded"
    spec_file = settings.runs_dir / job_id / "attempt-1" / "spec.json"
    assert '"train_iters": 20' in spec_file.read_text()
    # a second delivery of the same job does nothing
    assert run_shard(job_id, settings) == 0
    assert len(_events(url, job_id)) == len(kinds)


def test_failed_attempt_is_retried_and_resumes_from_checkpoint(
    settings: Settings,
    make_job: Callable[..., str],
    fake_engine: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = settings.resolved_database_url
    monkeypatch.setenv("FAKE_ENGINE_FAIL_AT", "12")
    monkeypatch.setenv("FAKE_ENGINE_FAIL_MARKER", str(tmp_path / "failed-once"))
    job_id = make_job(train_iters=20, checkpoint_interval=5)
    assert run_shard(job_id, settings) == 3
    job = _job(url, job_id)
    assert job.status == QUEUED and job.attempt == 1
    # One line; what the engine printed stays in the log.
    assert job.status_reason == "attempt 1: a rank exited with code 3; retrying from the latest checkpoint"
    assert "failing at step 12" in _log(url, job_id)
    assert job.runner_pid is None and job.current_step == 11
    _reschedule(url, job_id)
    assert run_shard(job_id, settings) == 0
    job = _job(url, job_id)
    assert job.status == SUCCEEDED and job.attempt == 2 and job.current_step == 20
    resumed = [e for e in _events(url, job_id) if e.kind == "resumed"]
    assert len(resumed) == 1 and resumed[0].data["resumed_from"] == 10 and resumed[0].data["attempt"] == 2
    with session_scope(url) as s:
        # steps 11 ran twice (before the failure and after the resume) but are stored once
        steps = s.scalars(
            select(JobMetric.step).where(JobMetric.job_id == job_id).order_by(JobMetric.step)
        ).all()
        assert steps == list(range(1, 21))
        seqs = s.scalars(select(JobLog.seq).where(JobLog.job_id == job_id).order_by(JobLog.seq)).all()
        assert seqs == list(range(1, len(seqs) + 1))
        assert s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.job_id == job_id)) == 4


def test_failure_without_retries_fails_in_one_line(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_FAIL_AT", "3")
    monkeypatch.setenv("FAKE_ENGINE_EXIT_CODE", "7")
    job_id = make_job(max_retries=0)
    assert run_shard(job_id, settings) == 7
    job = _job(settings.resolved_database_url, job_id)
    assert job.status == FAILED
    assert job.status_reason == "attempt 1: a rank exited with code 7; no retries left"
    assert "failing at step 3" in _log(settings.resolved_database_url, job_id)


def test_a_package_the_node_lacks_fails_the_job_as_it_is_claimed(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path
) -> None:
    """A pool whose nodes never reported their packages passed the API's check: the node claiming
    the job judges it against its own, and fails it in one line, with no engine started."""
    job_id = make_job(schedule=False)
    url = settings.resolved_database_url
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        job.spec = {**job.spec, "model": {"attention_backend": "flash"}, "training": {**job.spec["training"],
                    "precision": "bf16"}}  # fmt: skip
        node_id = s.scalar(select(Node.id).where(Node.hostname == "testnode"))
        assert reserve_and_schedule(s, job_id, node_id, "test")
    assert run_shard(job_id, settings) == 0
    job = _job(url, job_id)
    assert job.status == FAILED and job.attempt == 1
    assert "model.attention_backend='flash' needs the flash-attn package" in job.status_reason
    assert "cannot import" in job.status_reason and "\n" not in job.status_reason
    with session_scope(url) as s:  # its slot is back
        assert s.scalar(select(Node.slots_used).where(Node.id == node_id)) == 0
    assert _log(url, job_id) == ""  # no engine ran


def _run_in_thread(job_id: str, settings: Settings) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(run_shard(job_id, settings)), daemon=True)
    t.start()
    return t, result


def _rank_pids(settings: Settings, job_id: str, n: int) -> list[int]:
    pid_dir = settings.runs_dir / job_id / "attempt-1" / "pids"
    files = wait_for(
        lambda: len(list(pid_dir.glob("rank*.pid"))) == n and list(pid_dir.glob("rank*.pid")), 60
    )
    return [int(f.read_text()) for f in files]


def _request_cancel(url: str, job_id: str) -> None:
    with session_scope(url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))


@pytest.mark.distributed
def test_cancel_kills_torchrun_and_every_rank(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = settings.resolved_database_url
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.2")
    job_id = make_job(procs=2, train_iters=10_000)
    thread, result = _run_in_thread(job_id, settings)
    ranks = _rank_pids(settings, job_id, 2)
    # torchrun is the ranks' parent; each rank lives in a session of its own
    torchrun = int(Path(f"/proc/{ranks[0]}/stat").read_text().rpartition(")")[2].split()[1])
    assert {os.getpgid(p) for p in ranks} != {os.getpgid(torchrun)}
    wait_for(lambda: _job(url, job_id).current_step > 0, 30)
    _request_cancel(url, job_id)
    thread.join(30)
    assert not thread.is_alive() and result
    assert _job(url, job_id).status == CANCELLED
    for pid in [torchrun, *ranks]:
        assert not alive(pid), f"pid {pid} survived the cancel"


def test_cancel_escalates_to_sigkill(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = settings.resolved_database_url
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.1")
    monkeypatch.setenv("FAKE_ENGINE_IGNORE_SIGTERM", "1")
    monkeypatch.setattr(shard, "KILL_GRACE_S", 0.5)
    job_id = make_job(train_iters=10_000)
    thread, _ = _run_in_thread(job_id, settings)
    (pid,) = _rank_pids(settings, job_id, 1)
    wait_for(lambda: _job(url, job_id).status == RUNNING)
    _request_cancel(url, job_id)
    thread.join(20)
    assert not thread.is_alive()
    assert _job(url, job_id).status == CANCELLED
    assert not alive(pid)


def test_max_runtime_fails_the_job(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.1")
    job_id = make_job(train_iters=10_000, max_runtime_s=1)
    assert run_shard(job_id, settings) != 0
    job = _job(settings.resolved_database_url, job_id)
    assert job.status == FAILED and job.status_reason == "exceeded max_runtime_s=1"
    pid = int((settings.runs_dir / job_id / "attempt-1" / "pids" / "rank0.pid").read_text())
    assert not alive(pid)


def test_logs_are_capped_at_max_log_lines(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0")
    settings = settings.model_copy(update={"max_log_lines": 100})
    job_id = make_job(train_iters=300, checkpoint_interval=0)
    assert run_shard(job_id, settings) == 0
    with session_scope(settings.resolved_database_url) as s:
        seqs = s.scalars(select(JobLog.seq).where(JobLog.job_id == job_id).order_by(JobLog.seq)).all()
    # 300 step lines + the engine's first and last line; only the newest 100 remain
    assert len(seqs) == 100 and seqs[-1] == 302 and seqs == list(range(203, 303))


class _PlaceOnly:
    """An executor that runs nothing: the test runs the shards itself."""

    def submit(self, job_id: str) -> None: ...

    def refresh_nodes(self) -> None: ...

    def runner_alive(self, job: Job) -> bool | None:
        return None

    def runner_failure(self, job: Job) -> dict[str, Any] | None:
        return None


def _cuda_env(settings: Settings, job_id: str) -> dict[str, str]:
    return json.loads((settings.runs_dir / job_id / "attempt-1" / "pids" / "rank0.cuda.json").read_text())


def test_jobs_sharing_a_gpu_node_see_only_their_devices(
    settings: Settings, fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = settings.resolved_database_url
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seed_node(url, 4, "gpu", "gpunode", accelerator="NVIDIA H100 80GB HBM3")
    seed_node(url, 4, "cpu", "cpunode")
    spec = job_spec(train_iters=2)
    # one process each keeps torchrun out of it (slow to start); test_placement covers wider jobs
    a = seed_job(url, 1, pool="gpu", spec=spec)
    b = seed_job(url, 3, pool="gpu", spec=spec)  # placed, never run here
    c = seed_job(url, 1, pool="gpu", spec=spec)  # waits: b leaves no room on the node
    on_cpu = seed_job(url, 1, pool="cpu", spec=spec)
    sched = Scheduler(settings, _PlaceOnly())
    assert sched.schedule_once() == [a, b, on_cpu]
    assert _job(url, b).devices == [1, 2, 3]
    assert run_shard(a, settings) == 0
    only_device_0 = {
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    assert _cuda_env(settings, a) == only_device_0
    assert sched.schedule_once() == [c]  # a's device goes to c, not one of b's
    assert run_shard(c, settings) == 0
    assert _cuda_env(settings, c) == only_device_0
    assert run_shard(on_cpu, settings) == 0
    assert _cuda_env(settings, on_cpu) == {}  # recorded on the job, no effect on a CPU node
    with session_scope(url) as s:  # where each attempt ran stays in its history
        placed = s.scalar(
            select(JobEvent.data).where(JobEvent.job_id == on_cpu, JobEvent.kind == "scheduled")
        )
    assert placed["devices"] == [0]


def test_device_env_counts_within_the_workers_own_devices() -> None:
    # a worker started with CUDA_VISIBLE_DEVICES=4,5,6,7 hands its jobs indices into that list
    assert (
        device_env([2, 3], "NVIDIA A100", {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})["CUDA_VISIBLE_DEVICES"]
        == "6,7"
    )
    assert device_env([0], "NVIDIA A100", {})["CUDA_VISIBLE_DEVICES"] == "0"
    assert device_env([0], "NVIDIA A100", {})["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert device_env([0, 1], "cpu", {}) == {} and device_env(None, "NVIDIA A100", {}) == {}


def test_a_cpu_slot_owns_its_share_of_the_cores() -> None:
    """Jobs side by side on a CPU node each run on their slots' cores, not all on every core."""
    assert slot_cpus([0], 2, [0, 1]) == {0} and slot_cpus([1], 2, [0, 1]) == {1}
    assert slot_cpus([1], 2, range(8)) == {4, 5, 6, 7} and slot_cpus([1, 2], 3, range(6)) == {2, 3, 4, 5}
    assert slot_cpus([3], 4, [0, 1]) == {1}  # more slots than cores: two slots to a core
    assert slot_cpus([0, 1], 2, [0, 1]) is None  # the whole node: nothing to pin
    assert slot_cpus([2], 2, [0, 1]) is None and slot_cpus(None, 2, [0, 1]) is None


def test_inside_a_slurm_step_slurms_gpus_stand() -> None:
    # The scheduler planned devices 2,3 of some node; Slurm gave the step GPUs 5,6 (renumbered 0,1
    # where it constrains devices): its CUDA_VISIBLE_DEVICES is kept as it is.
    slurm = {"SLURM_STEP_GPUS": "5,6", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert device_env([2, 3], "NVIDIA H100", slurm) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def test_the_corrupt_fault_damages_the_checkpoint_the_engine_saved(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MEGATRAIN_FAULTS `corrupt:at_step=N`: once the engine reports the checkpoint of step N saved,
    the runner flips a bit of its largest file (tests/engine/test_checkpoint.py: a resume catches
    it), once, and says so in the job's log; the other checkpoints are untouched."""
    once = Path(settings.home) / "corrupt-once"
    monkeypatch.setenv("MEGATRAIN_FAULTS", f"corrupt:at_step=10,once={once}")
    job_id = make_job(train_iters=15, checkpoint_interval=5)
    assert run_shard(job_id, settings) == 0
    ckpts = Path(settings.resolved_storage_url.removeprefix("file://")) / "jobs" / job_id / "checkpoints"
    states = {s: json.loads((ckpts / f"iter_{s:07d}" / "trainer_state.json").read_bytes()) for s in (5, 15)}
    assert states == {5: {"step": 5}, 15: {"step": 15}}
    damaged = (ckpts / "iter_0000010" / "trainer_state.json").read_bytes()
    assert damaged != json.dumps({"step": 10}).encode() and once.exists()
    url = settings.resolved_database_url
    assert "injected fault corrupt: flipped a bit of trainer_state.json in the checkpoint at step 10" in _log(
        url, job_id
    )


def test_the_silence_fault_cuts_a_node_off_and_its_reports_arrive_after(
    settings: Settings, make_job: Callable[..., str], fake_engine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MEGATRAIN_FAULTS `silence:node=N,after_s=S,for_s=D`: for D seconds nothing of node N's
    reaches the control plane (no heartbeat: the job's stops advancing); what the runner held is
    reported once the silence lifts, each row once."""
    import time

    from megatrain import faults
    from megatrain.worker.nodes import node_name

    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    monkeypatch.setattr(faults, "STARTED", time.monotonic())
    monkeypatch.setenv("MEGATRAIN_FAULTS", f"silence:node={node_name(settings)},after_s=0.6,for_s=1.5")
    url = settings.resolved_database_url
    job_id = make_job(train_iters=50, checkpoint_interval=0)
    beats: list[tuple[float, Any]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            beats.append((time.monotonic(), _job(url, job_id).heartbeat_at))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert run_shard(job_id, settings) == 0
    finally:
        done.set()
        watcher.join(5)
    changes = [t for (t, b), (_, prev) in zip(beats[1:], beats, strict=False) if b != prev]
    assert max(b - a for a, b in zip(changes, changes[1:], strict=False)) > 1.2  # the silence
    assert _job(url, job_id).status == SUCCEEDED
    with session_scope(url) as s:
        steps = s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id).order_by(JobMetric.step))
        assert list(steps) == list(range(1, 51))
