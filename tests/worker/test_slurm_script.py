"""The sbatch script of a placed job (worker.slurm.script): its lines for the layouts the planner
places, and that bash accepts it."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatrain.worker.slurm.script import (
    HEAD_ADDR_ENV,
    NODE_RUNNER_MODULE,
    STOP_AT_ENV,
    STOP_SIGNAL_LEAD_S,
    TIME_LIMIT_ENV,
    TIME_LIMIT_FLAG,
    TIME_LIMIT_FLAG_ENV,
    SlurmRequest,
    job_name,
    render_sbatch,
    slurm_time,
    split_world,
    stop_signal_lead_s,
)


def _request(nodes: int, per_node: int, gpus: bool = True, **kw: object) -> SlurmRequest:
    args: dict[str, object] = dict(
        job_id="job-abc",
        attempt=2,
        nodes=nodes,
        procs_per_node=per_node,
        gpus=gpus,
        time_limit_s=3600,
        log_dir=Path("/runs/job-abc/attempt-2/slurm"),
        python="/opt/venv/bin/python",
    )
    args.update(kw)
    return SlurmRequest(**args)  # type: ignore[arg-type]


def _sbatch(script: str) -> dict[str, str]:
    """#SBATCH options as {name: value} ('' for flags)."""
    opts = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            name, _, value = line.removeprefix("#SBATCH --").partition("=")
            opts[name] = value
    return opts


# (tp, pp, dp, devices per node) → (nodes, ranks per node): what the planner places.
LAYOUTS = [
    (1, 1, 1, 8, 1, 1),
    (2, 1, 1, 8, 1, 2),
    (1, 1, 4, 8, 1, 4),
    (2, 2, 2, 8, 1, 8),
    (8, 1, 2, 8, 2, 8),
    (2, 1, 2, 2, 2, 2),
    (4, 2, 2, 4, 4, 4),
    (8, 4, 1, 8, 4, 8),
    (1, 1, 3, 8, 1, 3),
]


@pytest.mark.parametrize(("tp", "pp", "dp", "per_node_devices", "nodes", "per_node"), LAYOUTS)
def test_layouts_split_into_equal_node_shares(
    tp: int, pp: int, dp: int, per_node_devices: int, nodes: int, per_node: int
) -> None:
    assert split_world(tp * pp * dp, per_node_devices) == (nodes, per_node)
    opts = _sbatch(render_sbatch(_request(nodes, per_node)))
    assert opts["nodes"] == str(nodes)
    assert opts["ntasks-per-node"] == "1"
    assert opts["gpus-per-node"] == str(per_node)
    assert opts["cpus-per-task"] == str(per_node)


def test_uneven_world_is_refused() -> None:
    with pytest.raises(ValueError, match="evenly"):
        split_world(9, 8)  # 2 nodes cannot hold 9 ranks in equal shares
    assert split_world(12, 8) == (2, 6)


def test_script_names_attempt_partition_time_and_signal() -> None:
    req = _request(2, 4, partition="gpu", account="ml", qos="high", time_limit_s=90_061)
    script = render_sbatch(req)
    opts = _sbatch(script)
    assert opts["job-name"] == job_name("job-abc", 2) == "megatrain-job-abc-2"
    assert (opts["partition"], opts["account"], opts["qos"]) == ("gpu", "ml", "high")
    assert opts["time"] == "1-01:02:00"  # 90061 s rounds up to 25 h 2 min
    assert opts["signal"] == f"B:USR1@{STOP_SIGNAL_LEAD_S}"
    assert "no-requeue" in opts and "requeue" not in opts
    assert opts["output"] == "/runs/job-abc/attempt-2/slurm/batch.log"
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--nodes=2" in srun and "--ntasks-per-node=1" in srun and "--kill-on-bad-exit=1" in srun
    assert "--gpus-per-node=4" in srun  # the step gets the job's GPUs: Slurm names them to the ranks
    assert "--output=/runs/job-abc/attempt-2/slurm/node-%n.log" in srun
    assert f"/opt/venv/bin/python -u -m {NODE_RUNNER_MODULE} --job-id=job-abc --attempt=2" in srun


def test_cpu_pool_asks_for_cpus_not_gpus_and_omits_unset_placement() -> None:
    script = render_sbatch(_request(1, 3, gpus=False, cpus_per_proc=2))
    opts = _sbatch(script)
    assert "gpus-per-node" not in opts and "--gpus-per-node" not in script
    assert opts["cpus-per-task"] == "6"
    assert not {"partition", "account", "qos"} & set(opts)


def test_requeue_when_asked() -> None:
    opts = _sbatch(render_sbatch(_request(1, 1, requeue=True)))
    assert "requeue" in opts and "no-requeue" not in opts


def test_environment_is_quoted_and_rendezvous_is_the_first_host() -> None:
    env = {"MEGATRAIN_DATABASE_URL": "postgresql+psycopg://u:p@db/x", "MEGATRAIN_STORAGE_URL": "s3://b/it's"}
    script = render_sbatch(_request(2, 2, env=env))
    assert "export MEGATRAIN_DATABASE_URL=postgresql+psycopg://u:p@db/x" in script
    assert "export MEGATRAIN_STORAGE_URL='s3://b/it'\"'\"'s'" in script
    assert "export MEGATRAIN_JOB_ID=job-abc" in script and "export MEGATRAIN_ATTEMPT=2" in script
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    assert 'scontrol show node "$head"' in script
    assert f'export {HEAD_ADDR_ENV}="${{addr:-$head}}"' in script


def test_script_is_valid_bash() -> None:
    script = render_sbatch(_request(4, 8, env={"MEGATRAIN_X": "a b $c"}))
    out = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize(
    ("seconds", "text"), [(1, "0-00:01:00"), (60, "0-00:01:00"), (61, "0-00:02:00"), (86400, "1-00:00:00")]
)
def test_slurm_time(seconds: int, text: str) -> None:
    assert slurm_time(seconds) == text


def test_request_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        _request(0, 1)
    with pytest.raises(ValueError):
        _request(1, 1, time_limit_s=0)


def test_stop_signal_lead_fits_short_limits() -> None:
    assert stop_signal_lead_s(86400) == STOP_SIGNAL_LEAD_S
    assert stop_signal_lead_s(60) == 30  # one granted minute: stop half way, not at once
    assert _sbatch(render_sbatch(_request(1, 1, time_limit_s=30)))["signal"] == "B:USR1@30"


def test_slurm_warning_leaves_the_flag_and_the_script_waits_for_srun(tmp_path: Path) -> None:
    # Stand-ins for scontrol and srun: srun runs until the flag appears, then exits 7.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho n1\n")
    (bin_dir / "srun").write_text(
        f'#!/bin/sh\nwhile [ ! -e "${TIME_LIMIT_FLAG_ENV}" ]; do sleep 0.05; done\n'
        f'echo "limit ${TIME_LIMIT_ENV} stop ${STOP_AT_ENV}"\nexit 7\n'
    )
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    log_dir = tmp_path / "slurm"
    (log_dir).mkdir()
    (log_dir / TIME_LIMIT_FLAG).write_text("")  # a stale flag is removed at start
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(_request(1, 1, gpus=False, log_dir=log_dir, time_limit_s=150)))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "n1"}
    started = time.time()
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    assert proc.poll() is None, "srun ended before the warning"
    proc.send_signal(signal.SIGUSR1)  # what Slurm's --signal=B:USR1@lead sends
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 7  # srun's own exit code, after the trap cut the first wait short
    assert (log_dir / TIME_LIMIT_FLAG).exists()
    limit, stop_at = out.split()[1::2]
    assert limit == "180"  # what --time grants: whole minutes
    # The deadline (for where the warning cannot come): the warning's moment, 90 s before the limit.
    assert started + 90 - 2 <= int(stop_at) <= time.time() + 90
