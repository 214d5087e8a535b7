"""The sbatch script of one attempt of a placed job: pure text from a SlurmRequest, no subprocess.

One Slurm job runs a whole gang: `--nodes=N --ntasks-per-node=1`, and `srun` starts one shard runner
per node. The runners meet through torchrun's c10d rendezvous on the allocation's first node: the
script names its address (from `scontrol`), node rank 0's runner publishes the endpoint there with a
port it found free (worker.gang), and the followers read it from the job's events.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

NODE_RUNNER_MODULE = "megatrain.worker.slurm.node"
"""What srun starts on every node: one node's share of the attempt (its rank from SLURM_NODEID)."""
HEAD_ADDR_ENV = "MEGATRAIN_SLURM_HEAD_ADDR"
"""The allocation's first node's address: node rank 0 publishes its rendezvous there (a port it
picks free), so followers on nodes whose Slurm names do not resolve still reach it."""
TIME_LIMIT_FLAG_ENV = "MEGATRAIN_SLURM_TIME_LIMIT_FLAG"
TIME_LIMIT_ENV = "MEGATRAIN_SLURM_TIME_LIMIT_S"
STOP_AT_ENV = "MEGATRAIN_SLURM_STOP_AT"
"""When (Unix time) the runners stop if Slurm's warning has not come by then."""
TIME_LIMIT_FLAG = "time-limit"
"""The file (in the attempt's log folder) the batch shell creates when Slurm's warning comes."""
STOP_SIGNAL_LEAD_S = 120
"""Slurm sends SIGUSR1 to the batch shell this long before the time limit, so the runner can
save a checkpoint and stop rather than be killed mid-step."""


@dataclass(frozen=True)
class SlurmRequest:
    """What one attempt of a placed job asks of Slurm (the executor builds it from the job row, its
    layout and the pool's Slurm settings)."""

    job_id: str
    attempt: int
    nodes: int
    procs_per_node: int
    """Ranks on each node: one device each (GPUs), or one CPU slot each on a CPU pool."""
    gpus: bool
    time_limit_s: int
    """The spec's resources.max_runtime_s, or the cluster's limit on one job where that is shorter
    (the job then runs as a chain of Slurm jobs, each resuming from the last one's checkpoint)."""
    log_dir: Path
    """Where each node's output goes: node-{N}.log, N being the node's rank in the allocation. On a
    filesystem the nodes share, and made before submitting (Slurm opens batch.log first)."""
    python: str
    """The interpreter on the cluster's nodes (the same environment as the scheduler's)."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    cpus_per_proc: int = 1
    env: dict[str, str] = field(default_factory=dict)
    """MEGATRAIN_* settings the runners need (database, storage, ...), exported by the script."""
    runner_module: str = NODE_RUNNER_MODULE
    requeue: bool = False
    """Whether Slurm may requeue the job itself (after a node failure or preemption). Off by default:
    the product's retry owns attempts, and a requeue would reuse this attempt's number."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.procs_per_node < 1:
            raise ValueError("a Slurm job needs at least one node and one rank per node")
        if self.time_limit_s < 1:
            raise ValueError("time_limit_s must be positive")


def split_world(world_size: int, devices_per_node: int) -> tuple[int, int]:
    """(nodes, ranks per node) of a layout's world on a pool: as few nodes as hold it, the ranks
    shared evenly (the planner only places gangs of whole, equal shares)."""
    if world_size < 1 or devices_per_node < 1:
        raise ValueError("world_size and devices_per_node must be positive")
    nodes = math.ceil(world_size / devices_per_node)
    if world_size % nodes:
        raise ValueError(f"{world_size} ranks do not split evenly over {nodes} nodes")
    return nodes, world_size // nodes


def slurm_time(seconds: int) -> str:
    """Slurm's --time as days-hours:minutes:seconds, rounded up to whole minutes (Slurm's
    granularity: it would round a bare count of seconds up anyway)."""
    minutes = max(1, math.ceil(seconds / 60))
    days, minutes = divmod(minutes, 24 * 60)
    hours, minutes = divmod(minutes, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:00"


def granted_s(time_limit_s: int) -> int:
    """What --time grants for a limit of `time_limit_s`: whole minutes."""
    return max(1, math.ceil(time_limit_s / 60)) * 60


def stop_signal_lead_s(time_limit_s: int) -> int:
    """Seconds before the time limit that the stop signal comes: STOP_SIGNAL_LEAD_S, or half a short
    limit (a lead as long as the limit would stop the job as it starts)."""
    return min(STOP_SIGNAL_LEAD_S, granted_s(time_limit_s) // 2)


def job_name(job_id: str, attempt: int) -> str:
    """The Slurm job name of an attempt: how a restarted scheduler finds its jobs in squeue."""
    return f"megatrain-{job_id}-{attempt}"


def render_sbatch(req: SlurmRequest) -> str:
    """The batch script for `req`, to be fed to `sbatch --parsable` on stdin."""
    log, granted = req.log_dir, granted_s(req.time_limit_s)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name(req.job_id, req.attempt)}",
        f"#SBATCH --nodes={req.nodes}",
        "#SBATCH --ntasks-per-node=1",
        # The one task per node is the shard runner; it starts every rank of its node.
        f"#SBATCH --cpus-per-task={req.procs_per_node * req.cpus_per_proc}",
    ]
    if req.gpus:
        lines.append(f"#SBATCH --gpus-per-node={req.procs_per_node}")
    lines += [f"#SBATCH --{opt}={val}" for opt, val in _placement(req) if val]
    lines += [
        f"#SBATCH --time={slurm_time(req.time_limit_s)}",
        # B: to the batch shell only: Slurm would signal every process of a step (torchrun and the
        # ranks too); the shell's trap leaves a flag the runners read, and they stop the ranks.
        f"#SBATCH --signal=B:USR1@{stop_signal_lead_s(req.time_limit_s)}",
        "#SBATCH --requeue" if req.requeue else "#SBATCH --no-requeue",
        f"#SBATCH --output={log / 'batch.log'}",
        "#SBATCH --open-mode=append",
        "",
        "set -euo pipefail",
    ]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(req.env.items())]
    lines += [
        f"export MEGATRAIN_JOB_ID={shlex.quote(req.job_id)}",
        f"export MEGATRAIN_ATTEMPT={req.attempt}",
        f"export MEGATRAIN_NNODES={req.nodes}",
        f"export MEGATRAIN_PROCS_PER_NODE={req.procs_per_node}",
        # The allocation's first node hosts torchrun's c10d store, at its NodeAddr (a node's Slurm
        # name need not resolve); node rank 0 publishes the port.
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "addr=$(scontrol show node \"$head\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)",
        f'export {HEAD_ADDR_ENV}="${{addr:-$head}}"',
        f"mkdir -p {shlex.quote(str(log))}",
        f"flag={shlex.quote(str(log / TIME_LIMIT_FLAG))}",
        'rm -f "$flag"',
        f'export {TIME_LIMIT_FLAG_ENV}="$flag"',
        f"export {TIME_LIMIT_ENV}={granted}",
        # The same moment as a deadline, for where Slurm's warning does not come (slurmrestd).
        f"export {STOP_AT_ENV}=$(( $(date +%s) + {granted - stop_signal_lead_s(req.time_limit_s)} ))",
        "",
        # srun in the background and `wait`: bash runs a trap only between commands, so the
        # SIGTERM Slurm sends before the time limit reaches srun (and the runners) at once.
        " ".join(
            [
                "srun",
                f"--nodes={req.nodes}",
                "--ntasks-per-node=1",
                f"--cpus-per-task={req.procs_per_node * req.cpus_per_proc}",
                # The step's GPUs, named by Slurm in CUDA_VISIBLE_DEVICES (worker.nodes.device_env).
                *([f"--gpus-per-node={req.procs_per_node}"] if req.gpus else []),
                "--kill-on-bad-exit=1",
                f"--output={shlex.quote(str(log / 'node-%n.log'))}",
                shlex.quote(req.python),
                "-u",
                "-m",
                req.runner_module,
                f"--job-id={shlex.quote(req.job_id)}",
                f"--attempt={req.attempt}",
                "&",
            ]
        ),
        "srun_pid=$!",
        "trap 'touch \"$flag\"' USR1",
        "trap 'kill -TERM $srun_pid 2>/dev/null' TERM",
        "set +e",
        'wait "$srun_pid"; rc=$?',
        # A wait cut short by a trap returns >128 while srun still runs: wait again.
        'while [ "$rc" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; rc=$?; done',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def _placement(req: SlurmRequest) -> list[tuple[str, str | None]]:
    return [("partition", req.partition), ("account", req.account), ("qos", req.qos)]
