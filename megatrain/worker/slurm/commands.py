"""Talking to a Slurm cluster: submit a batch script, read jobs' states, cancel, read capacity.

`SlurmCommands` is the interface the executor uses; `SlurmCli` implements it with the commands on
PATH (sbatch, squeue, sacct, scancel, sinfo), as on a login node. The parsers are pure functions of
the commands' text so they are tested on captured output without a cluster.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from megatrain.worker.slurm.states import SlurmState, normalise_state, parse_reason

COMMAND_TIMEOUT_S = 30.0
SQUEUE_FORMAT = "%i|%T|%r"
"""Job id, extended state (PENDING, RUNNING, ...), reason: '|' never occurs in the first two."""
SACCT_FIELDS = "JobIDRaw,State,ExitCode,Reason"
SINFO_FORMAT = "%N|%c|%G|%t|%l|%P"
"""Node name, CPUs, generic resources (gpu:4), compact state (idle, mix, alloc, drain*...), the
partition's time limit (MaxTime), partition."""


class SlurmError(RuntimeError):
    """A Slurm command failed (its stderr in the message); the caller must not read it as a state."""


@dataclass(frozen=True)
class SlurmNode:
    """One node as sinfo reports it, in one partition."""

    name: str
    cpus: int
    gpus: int
    state: str
    """sinfo's compact state without its flag suffix (idle, mix, alloc, drain, down, ...)."""
    partition: str
    max_time_s: int | None = None
    """The partition's limit on one job's run time (MaxTime); None: none (or not known)."""

    @property
    def usable(self) -> bool:
        """Whether Slurm would place work on it now or soon (not down, drained or failing)."""
        return self.state in ("idle", "mix", "alloc", "comp", "completing", "plnd", "planned")


class SlurmCommands(Protocol):
    def submit(self, script: str) -> str:
        """Submit a batch script; Slurm's job id. Raises SlurmError."""
        ...

    def status(self, slurm_ids: Sequence[str]) -> dict[str, SlurmState]:
        """The states of the jobs Slurm still knows; ids it has forgotten are absent. Raises
        SlurmError when it could not find out (then nothing may be concluded)."""
        ...

    def cancel(self, slurm_id: str, signal: str | None = None) -> None:
        """scancel the job (with `signal`, only signal its steps and batch shell)."""
        ...

    def capacity(self, partition: str | None = None) -> list[SlurmNode]:
        """The nodes of `partition` (or every partition)."""
        ...


Runner = Callable[[list[str], str | None, dict[str, str] | None], subprocess.CompletedProcess[str]]


def run_command(
    args: list[str], stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            args, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"{args[0]}: {exc}") from exc


class SlurmCli:
    """SlurmCommands through the CLI tools on PATH (`bin_dir` to use others); `env` for the commands
    (e.g. SLURM_CONF), else this process's."""

    def __init__(
        self, bin_dir: str | None = None, run: Runner = run_command, env: dict[str, str] | None = None
    ):
        self.bin_dir = bin_dir
        self._run = run
        self.env = env

    def _cmd(self, name: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        exe = os.path.join(self.bin_dir, name) if self.bin_dir else name
        return self._run([exe, *args], stdin, self.env)

    def submit(self, script: str) -> str:
        out = self._cmd("sbatch", "--parsable", stdin=script)
        if out.returncode != 0:
            raise SlurmError(f"sbatch failed ({out.returncode}): {out.stderr.strip()}")
        return parse_sbatch_parsable(out.stdout)

    def status(self, slurm_ids: Sequence[str]) -> dict[str, SlurmState]:
        ids = [i for i in slurm_ids if i]
        if not ids:
            return {}
        # squeue first (slurmctld's memory: exact while a job runs and for MinJobAge after it ends);
        # sacct for the ones it has forgotten, where accounting is configured.
        out = self._cmd(
            "squeue", "-h", "--states=all", f"--jobs={','.join(ids)}", f"--format={SQUEUE_FORMAT}"
        )
        if out.returncode == 0:
            states = {s.slurm_id: s for s in parse_squeue(out.stdout)}
        elif "Invalid job id" in out.stderr:
            states = {}  # every id is gone from slurmctld's memory
        else:
            raise SlurmError(f"squeue failed ({out.returncode}): {out.stderr.strip()}")
        missing = [i for i in ids if i not in states]
        if missing:
            states.update(self._sacct(missing))
        return {i: states[i] for i in ids if i in states}

    def _sacct(self, ids: list[str]) -> dict[str, SlurmState]:
        out = self._cmd("sacct", "-n", "-P", "-X", f"--jobs={','.join(ids)}", f"--format={SACCT_FIELDS}")
        if out.returncode != 0:
            if "accounting storage is disabled" in out.stderr:
                return {}  # no accounting: a forgotten job stays unknown
            raise SlurmError(f"sacct failed ({out.returncode}): {out.stderr.strip()}")
        return {s.slurm_id: s for s in parse_sacct(out.stdout)}

    def cancel(self, slurm_id: str, signal: str | None = None) -> None:
        args = [f"--signal={signal}", "--full"] if signal else []
        out = self._cmd("scancel", *args, slurm_id)
        if out.returncode != 0 and "Invalid job id" not in out.stderr:
            raise SlurmError(f"scancel failed ({out.returncode}): {out.stderr.strip()}")

    def capacity(self, partition: str | None = None) -> list[SlurmNode]:
        args = ["-h", "-N", f"--format={SINFO_FORMAT}"] + ([f"--partition={partition}"] if partition else [])
        out = self._cmd("sinfo", *args)
        if out.returncode != 0:
            raise SlurmError(f"sinfo failed ({out.returncode}): {out.stderr.strip()}")
        return parse_sinfo(out.stdout)


def parse_sbatch_parsable(text: str) -> str:
    """`sbatch --parsable` prints 'jobid' or 'jobid;cluster'."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    job_id = first.split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id: {text.strip()!r}")
    return job_id


def _rows(text: str, fields: int) -> Iterable[list[str]]:
    for line in text.splitlines():
        if line.strip():
            parts = line.split("|", fields - 1)
            if len(parts) == fields:
                yield [p.strip() for p in parts]


def parse_squeue(text: str) -> list[SlurmState]:
    """Rows of `squeue -h --format='%i|%T|%r'`."""
    return [
        SlurmState(i, normalise_state(state), parse_reason(reason)) for i, state, reason in _rows(text, 3)
    ]


def parse_sacct(text: str) -> list[SlurmState]:
    """Rows of `sacct -n -P -X --format=JobIDRaw,State,ExitCode,Reason`. A requeued job has one
    row per run without -D only for the last: the last row of an id wins either way."""
    states: dict[str, SlurmState] = {}
    for job_id, state, exit_code, reason in _rows(text, 4):
        states[job_id] = SlurmState(job_id, normalise_state(state), parse_reason(reason), exit_code or None)
    return list(states.values())


def gpu_count(gres: str) -> int:
    """GPUs in sinfo's %G: 'gpu:4', 'gpu:a100:8(S:0-1)', several comma-separated, or '(null)'."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(", 1)[0].split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_sinfo(text: str) -> list[SlurmNode]:
    """Rows of `sinfo -h -N --format='%N|%c|%G|%t|%l|%P'`; a default partition's name ends in '*'."""
    nodes = []
    for name, cpus, gres, state, limit, partition in _rows(text, 6):
        nodes.append(
            SlurmNode(
                name,
                int(cpus),
                gpu_count(gres),
                state.rstrip("*~#!%$@^-"),
                partition.rstrip("*"),
                parse_duration(limit),
            )
        )
    return nodes


def parse_duration(text: str) -> int | None:
    """Seconds in a Slurm time ('30' minutes, 'MM:SS', 'HH:MM:SS', 'D-HH', 'D-HH:MM', 'D-HH:MM:SS');
    None for 'infinite', 'UNLIMITED', 'n/a' or anything else unreadable (no limit known)."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if not all(p.isdigit() for p in parts) or (days and not days.isdigit()) or len(parts) > 3:
        return None
    nums = [int(p) for p in parts]
    if days:  # after a day count the first field is hours
        h, m, s = (nums + [0, 0])[:3]
    else:
        h, m, s = ([0, 0] + nums)[-3:] if len(nums) > 1 else (0, nums[0], 0)
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s
