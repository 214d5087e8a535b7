"""megatrain/hostinfo.py: a job's own CPU time over its process tree, the host's other load beside
it (what the job page greys a comparison by), and when that load counts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from megatrain import hostinfo

# Burns 0.3 s of CPU time (not wall time: on a busy host that takes longer), then says so and waits.
BURN = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()"


def test_tree_cpu_counts_the_children() -> None:
    """A parent that only waits on a child that burns 0.3 s: its tree holds the child's time. (Timed
    on its own tree, not this process's: a child of ours that ends meanwhile would drop out of it.)"""
    spawn = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURN!r}])"
    parent = subprocess.Popen([sys.executable, "-c", spawn], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"done\n"
        tree = hostinfo.tree_cpu_s(parent.pid)
    finally:
        parent.communicate(b"")
    assert tree is not None and tree >= 0.29  # the child's 0.3 s (ticks of 10 ms), beside the parent's


def test_the_job_root_is_torchruns_agent_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert hostinfo.job_root_pid() == os.getpid()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert hostinfo.job_root_pid() == os.getppid()


def _clock(values: list[float]) -> Iterator[float]:
    yield from values


def test_host_load_is_the_hosts_busy_time_less_the_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Over 10 s the host ran 25 CPU seconds, the job's tree 9: other work kept 1.6 cores busy.
    busy, ours, wall = _clock([100.0, 125.0, 125.0]), _clock([50.0, 59.0, 59.0]), _clock([0.0, 10.0, 20.0])
    monkeypatch.setattr(hostinfo, "host_busy_s", lambda: next(busy))
    monkeypatch.setattr(hostinfo, "tree_cpu_s", lambda _root: next(ours))
    monkeypatch.setattr(hostinfo.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(hostinfo.os, "cpu_count", lambda: 2)
    load = hostinfo.HostLoad(1234)
    assert load.sample() == {
        "host_other_cores": 1.6, "host_job_cores": 0.9, "host_cores": 2, "host_under_load": True
    }  # fmt: skip
    # Then a quiet interval: nobody ran.
    assert load.sample()["host_under_load"] is False


def test_host_load_without_proc_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostinfo, "host_busy_s", lambda: None)
    assert hostinfo.HostLoad(1).sample() == {}


@pytest.mark.parametrize(
    ("other", "own", "cores", "loaded"),
    [
        (0.1, 2.0, 2, False),  # a quiet CPU host, the job on every core
        (0.4, 1.8, 2, True),  # other work took a core's share the job needed
        (3.0, 1.0, 8, False),  # a GPU job's one busy core; five cores idle beside the other work
        (7.0, 1.0, 8, True),  # every core the job left idle was taken, and more
    ],
)
def test_under_load(other: float, own: float, cores: int, loaded: bool) -> None:
    assert hostinfo.under_load(other, own, cores) is loaded
