"""A rank the kernel's OOM killer ends (SIGKILL, no failure record) fails the job at once with "out of
memory on node N (rank R)" (worker.oom): the decision on fabricated counters and exits, torchrun's
own failure report parsed, and the runner end to end with a fake engine that kills itself while a
fabricated cgroup counter rises."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import select

from megatrain.db.models import FAILED, Job, JobEvent
from megatrain.db.session import session_scope
from megatrain.progress_files import RankProgress
from megatrain.settings import Settings
from megatrain.worker import oom
from megatrain.worker.nodes import node_name
from megatrain.worker.oom import OomCounts, RankExits, killed_ranks, oom_evidence, oom_record
from megatrain.worker.shard import run_shard

KILL = int(signal.SIGKILL)


def test_the_counter_files_of_cgroup_v2_and_v1(tmp_path: Path) -> None:
    proc, fs = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    # v1 (or a hybrid host): the memory controller's own hierarchy.
    (proc / "self" / "cgroup").write_text("4:memory:/slurm/job_7\n1:cpu,cpuacct:/slurm/job_7\n0::/\n")
    v1 = fs / "memory" / "slurm" / "job_7" / "memory.oom_control"
    v1.parent.mkdir(parents=True)
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert oom.cgroup_counter_file(proc, fs) == v1
    # v2: the one unified line.
    (proc / "self" / "cgroup").write_text("0::/system.slice/worker.service\n")
    assert oom.cgroup_counter_file(proc, fs) is None  # no memory.events there: not readable
    v2 = fs / "system.slice" / "worker.service" / "memory.events"
    v2.parent.mkdir(parents=True)
    v2.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 5\noom_group_kill 0\n")
    assert oom.cgroup_counter_file(proc, fs) == v2
    assert oom._field(v2.read_text(), "oom_kill") == 5 and oom._field("", "oom_kill") is None


def test_read_oom_counts(oom_counters: Path) -> None:
    assert oom.read_oom_counts() == OomCounts(cgroup=1, node=7)
    oom_counters.unlink()
    assert oom.read_oom_counts() == OomCounts(cgroup=None, node=7)


@pytest.mark.parametrize(
    ("before", "after", "counter"),
    [
        (OomCounts(1, 7), OomCounts(2, 8), "cgroup"),
        (OomCounts(1, 7), OomCounts(1, 8), None),  # an OOM kill elsewhere on the node: not ours
        (OomCounts(None, 7), OomCounts(None, 8), "node"),  # no cgroup counter: the node's decides
        (OomCounts(None, 7), OomCounts(None, 7), None),
        (OomCounts(None, None), OomCounts(None, None), None),
    ],
)
def test_the_cgroup_counter_decides_where_it_can_be_read(
    before: OomCounts, after: OomCounts, counter: str | None
) -> None:
    evidence = oom_evidence(before, after)
    assert (evidence or {}).get("counter") == counter


def test_which_ranks_sigkill_ended() -> None:
    assert killed_ranks(-KILL, {}, launcher=False) == [0]
    assert killed_ranks(1, {}, launcher=False) == []
    assert killed_ranks(1, {3: KILL, 0: int(signal.SIGTERM)}, launcher=True) == [3]
    assert killed_ranks(-KILL, {}, launcher=True) == [None]  # torchrun itself: its ranks unknown
    assert killed_ranks(1, {0: int(signal.SIGTERM)}, launcher=True) == []


def test_torchruns_own_failure_report_names_the_killed_rank() -> None:
    """The report as torchrun itself formats it (the other side's own code, not our reading)."""
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {
        3: ProcessFailure(local_rank=1, pid=4242, exitcode=-KILL, error_file="/nonexistent/3.json"),
        2: ProcessFailure(local_rank=0, pid=4241, exitcode=-int(signal.SIGTERM), error_file="/nonexistent"),
    }
    report = ChildFailedError("megatrain.engine.train", failures).format_msg()
    exits = RankExits()
    for line in report.splitlines():
        exits.observe(line)
    assert exits.signalled == {3: KILL, 2: int(signal.SIGTERM)}


def test_the_record_names_node_rank_and_what_it_was_doing() -> None:
    progress = [RankProgress(0, 40, 111, "training"), RankProgress(1, 40, 112, "training")]
    record = oom_record(OomCounts(4, 7), OomCounts(5, 8), [1], "gpu-07", progress)
    assert record is not None
    assert {k: record[k] for k in ("kind", "rank", "node", "phase", "step", "exception", "cause")} == {
        "kind": "out_of_memory",
        "rank": 1,
        "node": "gpu-07",
        "phase": "training",
        "step": 41,
        "exception": "SIGKILL",
        "cause": "oom_killer",
    }
    assert record["evidence"] == {"counter": "cgroup", "before": 4, "after": 5, "killed_ranks": [1]}
    assert oom_record(OomCounts(4, 7), OomCounts(4, 8), [1], "gpu-07", progress) is None
    assert oom_record(OomCounts(4, 7), OomCounts(5, 8), [], "gpu-07", progress) is None


def _ended(url: str, job_id: str) -> tuple[Job, JobEvent]:
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        event = s.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id.desc())
        ).first()
        s.expunge_all()
        return job, event


@pytest.mark.parametrize("procs", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_rank_the_oom_killer_ends_fails_the_job_at_once(
    settings: Settings,
    make_job: Callable[..., str],
    fake_engine: Path,
    oom_counters: Path,
    monkeypatch: pytest.MonkeyPatch,
    procs: int,
) -> None:
    """A real SIGKILL of a real rank, the fabricated cgroup counter bumped as the kernel would:
    failed at attempt 1 with retries left, in one line naming the node and the rank."""
    monkeypatch.setenv("FAKE_ENGINE_SIGNAL", str(KILL))
    monkeypatch.setenv("FAKE_ENGINE_FAIL_AT", "3")
    monkeypatch.setenv("FAKE_ENGINE_OOM_COUNTER", str(oom_counters))
    monkeypatch.setenv("FAKE_ENGINE_FAIL_RANK", str(procs - 1))
    monkeypatch.setenv("FAKE_ENGINE_STEP_S", "0.05")
    job_id = make_job(procs=procs, max_retries=2, train_iters=200)
    assert run_shard(job_id, settings) != 0
    job, event = _ended(settings.resolved_database_url, job_id)
    assert (job.status, job.attempt) == (FAILED, 1), job.status_reason
    node, rank = node_name(settings), procs - 1
    assert job.status_reason == (
        f"out of memory on node {node} (rank {rank}) while training at step 3: SIGKILL: killed by the "
        "kernel's OOM killer; not retried: this layout's ranks need more memory than the node has"
    )
    failure = event.data["failure"]
    assert (failure["kind"], failure["rank"], failure["node"], failure["cause"]) == (
        "out_of_memory",
        rank,
        node,
        "oom_killer",
    )
    assert failure["evidence"]["counter"] == "cgroup"
