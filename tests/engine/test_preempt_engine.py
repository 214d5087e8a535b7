"""The real engine on SIGUSR2 (preemption): it checkpoints at the next step boundary, exits
EXIT_PREEMPTED, and a run resumed from that checkpoint continues the loss curve of an uninterrupted
run exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatrain.engine.train import EXIT_PREEMPTED, run
from megatrain.spec import parse_spec
from megatrain.worker.preempt import rank_pids

from .helpers import read_jsonl, tiny_spec

ITERS = 60


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}


def test_sigusr2_checkpoints_at_the_step_boundary_and_the_resumed_run_continues(
    tmp_path: Path, corpus: Path
) -> None:
    raw = tiny_spec(corpus, train_iters=ITERS, log_interval=1, eval_interval=0, checkpoint_interval=0)
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    out = tmp_path / "preempted"
    cmd = [sys.executable, "-m", "megatrain.engine.train", "--spec", str(tmp_path / "spec.json"),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "metrics.jsonl").exists() or len(_losses(out)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR2)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    events = read_jsonl(out / "events.jsonl")
    (stopped,) = [e for e in events if e["event"] == "preempted"]
    step = stopped["step"]
    assert 2 <= step < ITERS
    assert not any(e["event"] == "finished" for e in events)
    saved = [e["step"] for e in events if e["event"] == "checkpoint_saved"]
    assert saved == [step]  # saved at the boundary it stopped on (checkpoint_interval=0: only then)
    assert max(_losses(out)) == step  # no step ran past the checkpoint: no work lost
    assert (out / "checkpoints" / f"iter_{step:07d}" / "manifest.json").exists()

    resumed = tmp_path / "resumed"
    summary = run(parse_spec(raw), resumed, (out / "checkpoints").as_uri())
    assert summary["step"] == ITERS and not summary.get("preempted")
    assert read_jsonl(resumed / "events.jsonl")[0]["resumed_from"] == step
    reference = tmp_path / "reference"
    run(parse_spec(raw), reference)
    ref, got = _losses(reference), _losses(out) | _losses(resumed)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert [got[s] for s in sorted(got)] == pytest.approx([ref[s] for s in sorted(ref)], rel=1e-5)


@pytest.mark.distributed
def test_ranks_that_see_the_signal_a_step_apart_stop_together(tmp_path: Path, corpus: Path) -> None:
    """SIGUSR2 reaches one rank only (as it may reach ranks a step apart): they agree at the step
    boundary, save one complete checkpoint there and all stop."""
    raw = tiny_spec(corpus, train_iters=400, log_interval=1, eval_interval=0, checkpoint_interval=0)
    raw["parallelism"], raw["resources"] = {"dp": 2}, {"devices": 2}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "megatrain.engine.train", "--spec", str(tmp_path / "spec.json"),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or len(_losses(out)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        ranks = rank_pids(proc, SimpleNamespace(num_procs=2, rendezvous=None))  # type: ignore[arg-type]
        assert len(ranks) == 2
        os.kill(max(ranks), signal.SIGUSR2)  # one rank only
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode != 0  # torchrun reports its ranks' EXIT_PREEMPTED as a failure
    events = read_jsonl(out / "events.jsonl")
    (stopped,) = [e for e in events if e["event"] == "preempted"]
    assert stopped["step"] < 400, stderr[-3000:]
    assert [e["step"] for e in events if e["event"] == "checkpoint_saved"] == [stopped["step"]]
    assert (out / "checkpoints" / f"iter_{stopped['step']:07d}" / "manifest.json").exists()
