"""worker.slurm against a real Slurm started on this machine (tests/fixtures/slurm.py): commands
submit, follow and cancel jobs, and the rendered sbatch script runs one runner per node."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from fixtures.slurm import SlurmCluster

from megatrain.worker.slurm.commands import SlurmCli
from megatrain.worker.slurm.script import HEAD_ADDR_ENV, SlurmRequest, render_sbatch
from megatrain.worker.slurm.states import SlurmState

pytestmark = pytest.mark.slow
FOLLOW_TIMEOUT_S = 30.0


def _cli(cluster: SlurmCluster) -> SlurmCli:
    return SlurmCli(env=cluster.env)


def _follow(cli: SlurmCli, slurm_id: str, until: tuple[str, ...]) -> SlurmState:
    deadline = time.monotonic() + FOLLOW_TIMEOUT_S
    while time.monotonic() < deadline:
        state = cli.status([slurm_id]).get(slurm_id)
        if state is not None and (state.phase in until or state.state in until):
            return state
        time.sleep(0.5)
    raise AssertionError(f"job {slurm_id} never reached {until}: last {state}")


def test_capacity_lists_the_nodes(slurm_cluster: SlurmCluster) -> None:
    nodes = _cli(slurm_cluster).capacity(slurm_cluster.partition)
    assert sorted(n.name for n in nodes) == slurm_cluster.node_names
    assert all(n.cpus == 2 and n.gpus == 0 and n.usable for n in nodes)


def test_submit_and_follow_to_completed(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cli = _cli(slurm_cluster)
    out = tmp_path / "out.txt"
    slurm_id = cli.submit(f"#!/bin/bash\n#SBATCH --output={tmp_path / 'log'}\necho done > {out}\n")
    assert _follow(cli, slurm_id, ("succeeded", "failed", "cancelled")).state == "COMPLETED"
    assert out.read_text() == "done\n"


def test_scancel_cancels(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    cli = _cli(slurm_cluster)
    slurm_id = cli.submit(f"#!/bin/bash\n#SBATCH --output={tmp_path / 'log'}\nsleep 300\n")
    _follow(cli, slurm_id, ("running",))
    cli.cancel(slurm_id)
    state = _follow(cli, slurm_id, ("succeeded", "failed", "cancelled"))
    assert (state.state, state.phase) == ("CANCELLED", "cancelled")


def test_rendered_script_runs_one_runner_per_node(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # A stand-in runner module: it writes what each node's runner would see.
    (tmp_path / "echo_runner.py").write_text(
        "import os, sys\n"
        "print('node', os.environ['SLURM_NODEID'], 'of', os.environ['MEGATRAIN_NNODES'],\n"
        f"      os.environ['{HEAD_ADDR_ENV}'], os.environ['MEGATRAIN_MARK'], ' '.join(sys.argv[1:]))\n"
    )
    nodes = len(slurm_cluster.node_names)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    req = SlurmRequest(
        job_id="job-x",
        attempt=3,
        nodes=nodes,
        procs_per_node=1,
        gpus=False,
        time_limit_s=120,
        log_dir=log_dir,
        python=sys.executable,
        partition=slurm_cluster.partition,
        env={"PYTHONPATH": str(tmp_path), "MEGATRAIN_MARK": "a b"},
        runner_module="echo_runner",
    )
    cli = _cli(slurm_cluster)
    slurm_id = cli.submit(render_sbatch(req))
    state = _follow(cli, slurm_id, ("succeeded", "failed", "cancelled"))
    assert state.state == "COMPLETED", (log_dir / "batch.log").read_text()
    for rank, name in enumerate(slurm_cluster.node_names):
        line = (log_dir / f"node-{rank}.log").read_text().strip()
        # Every node meets at the first node's address (NodeAddr 127.0.0.1 here).
        assert line == f"node {rank} of {nodes} 127.0.0.1 a b --job-id=job-x --attempt=3", name
