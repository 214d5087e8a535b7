"""Slurm's command output parsed (worker.slurm.commands), on output written as Slurm 22.05 prints
it, and SlurmCli's command lines through a recording runner."""

from __future__ import annotations

import subprocess

import pytest

from megatrain.worker.slurm.commands import (
    SlurmCli,
    SlurmError,
    parse_duration,
    parse_sacct,
    parse_sbatch_parsable,
    parse_sinfo,
    parse_squeue,
)


def test_sbatch_parsable() -> None:
    assert parse_sbatch_parsable("4211\n") == "4211"
    assert parse_sbatch_parsable("4212;cluster-a\n") == "4212"
    with pytest.raises(SlurmError):
        parse_sbatch_parsable("sbatch: error: Batch job submission failed\n")


def test_squeue_rows() -> None:
    text = "101|PENDING|Resources\n102|RUNNING|None\n103|PENDING|QOSMaxJobsPerUserLimit\n104|COMPLETED|None\n"
    rows = {s.slurm_id: s for s in parse_squeue(text)}
    assert rows["101"].phase == "pending" and rows["101"].reason == "Resources"
    assert rows["102"].phase == "running" and rows["102"].reason is None
    assert rows["103"].reason == "QOSMaxJobsPerUserLimit"
    assert rows["104"].phase == "succeeded"


def test_sacct_rows_last_run_wins_and_flags_stripped() -> None:
    text = (
        "200|NODE_FAIL|1:0|None\n"
        "201|CANCELLED by 1000|0:15|None\n"
        "202|TIMEOUT|0:0|None\n"
        "200|COMPLETED|0:0|None\n"  # the same id again after a requeue: its last run counts
    )
    rows = {s.slurm_id: s for s in parse_sacct(text)}
    assert rows["200"].state == "COMPLETED"
    assert rows["201"].state == "CANCELLED" and rows["201"].exit_code == "0:15"
    assert rows["202"].cause == "slurm_timeout" and rows["202"].retryable


def test_sinfo_nodes() -> None:
    text = (
        "gpu001|64|gpu:h100:8(S:0-1)|mix|1-00:00:00|gpu*\n"
        "gpu002|64|gpu:8|drain*|1-00:00:00|gpu*\n"
        "cpu001|128|(null)|idle|infinite|cpu\n"
        "gpu003|64|gpu:a:4,gpu:b:2|alloc|4:00:00|gpu*\n"
    )
    nodes = parse_sinfo(text)
    assert [(n.name, n.cpus, n.gpus, n.state, n.partition, n.max_time_s) for n in nodes] == [
        ("gpu001", 64, 8, "mix", "gpu", 86400),
        ("gpu002", 64, 8, "drain", "gpu", 86400),
        ("cpu001", 128, 0, "idle", "cpu", None),
        ("gpu003", 64, 6, "alloc", "gpu", 4 * 3600),
    ]
    assert [n.usable for n in nodes] == [True, False, True, True]


class Recorder:
    """A Runner answering each command from a table, recording what was run."""

    def __init__(self, answers: dict[str, tuple[int, str, str]]):
        self.answers = answers
        self.calls: list[tuple[list[str], str | None, dict[str, str] | None]] = []

    def __call__(
        self, args: list[str], stdin: str | None, env: dict[str, str] | None
    ) -> subprocess.CompletedProcess[str]:
        self.calls.append((args, stdin, env))
        rc, out, err = self.answers[args[0].rsplit("/", 1)[-1]]
        return subprocess.CompletedProcess(args, rc, out, err)


def test_submit_feeds_the_script_on_stdin() -> None:
    run = Recorder({"sbatch": (0, "77\n", "")})
    cli = SlurmCli(bin_dir="/opt/slurm/bin", run=run, env={"SLURM_CONF": "/x"})
    assert cli.submit("#!/bin/bash\n") == "77"
    assert run.calls == [(["/opt/slurm/bin/sbatch", "--parsable"], "#!/bin/bash\n", {"SLURM_CONF": "/x"})]


def test_submit_failure_raises_with_stderr() -> None:
    cli = SlurmCli(run=Recorder({"sbatch": (1, "", "sbatch: error: invalid partition specified: nope")}))
    with pytest.raises(SlurmError, match="invalid partition"):
        cli.submit("#!/bin/bash\n")


def test_status_falls_back_to_sacct_for_forgotten_ids() -> None:
    run = Recorder({"squeue": (0, "5|RUNNING|None\n", ""), "sacct": (0, "6|PREEMPTED|0:15|None\n", "")})
    states = SlurmCli(run=run).status(["5", "6", "7"])
    assert {k: v.state for k, v in states.items()} == {"5": "RUNNING", "6": "PREEMPTED"}
    assert run.calls[0][0][:3] == ["squeue", "-h", "--states=all"] and "--jobs=5,6,7" in run.calls[0][0]
    assert "--jobs=6,7" in run.calls[1][0] and "-X" in run.calls[1][0]


def test_status_all_forgotten_without_accounting_is_empty() -> None:
    run = Recorder(
        {
            "squeue": (1, "", "slurm_load_jobs error: Invalid job id specified"),
            "sacct": (1, "", "Slurm accounting storage is disabled"),
        }
    )
    assert SlurmCli(run=run).status(["9"]) == {}


def test_status_query_failure_is_not_a_state() -> None:
    run = Recorder({"squeue": (1, "", "slurm_load_jobs error: Unable to contact slurm controller")})
    with pytest.raises(SlurmError, match="Unable to contact"):
        SlurmCli(run=run).status(["9"])


def test_cancel_and_signal() -> None:
    run = Recorder({"scancel": (0, "", "")})
    cli = SlurmCli(run=run)
    cli.cancel("12")
    cli.cancel("12", signal="TERM")
    assert [c[0] for c in run.calls] == [["scancel", "12"], ["scancel", "--signal=TERM", "--full", "12"]]


def test_capacity_of_a_partition() -> None:
    run = Recorder({"sinfo": (0, "n1|2|(null)|idle|infinite|debug*\n", "")})
    nodes = SlurmCli(run=run).capacity("debug")
    assert nodes[0].name == "n1" and "--partition=debug" in run.calls[0][0]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),  # a bare number is minutes
        ("30:15", 1815),
        ("2:00:00", 7200),
        ("1-00:00:00", 86400),
        ("1-12", 129600),  # after a day count, hours
        ("1-12:30", 131400),
        ("infinite", None),
        ("UNLIMITED", None),
        ("n/a", None),
    ],
)
def test_slurm_durations(text: str, seconds: int | None) -> None:
    assert parse_duration(text) == seconds
