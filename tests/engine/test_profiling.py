"""training.profile_steps / --profile: a Chrome trace per rank of the steps named in the `profiled`
event, written in the run folder and copied next to the checkpoints, with the step's phases labelled;
the losses are the unprofiled run's; bad values are named. And a zero-bubble job run whole (profiled
too): its losses and validation losses are one process's."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from megatrain.engine.profiling import SKIP_STEPS, profiled_steps
from megatrain.engine.runtime import Dist
from megatrain.engine.train import main, run
from megatrain.spec import SpecError, parse_spec

from .helpers import read_jsonl, tiny_spec, write_corpus


def _trace(path: Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _rank(rank: int, world: int, raw: dict[str, Any], out: str, ckpt: str) -> None:
    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    run(parse_spec(raw), Path(out), checkpoint_url=ckpt, ctx=ctx)


@pytest.mark.distributed
def test_every_rank_writes_a_trace_of_the_named_steps(tmp_path: Path) -> None:
    from .parallel._launch import run_distributed

    corpus = write_corpus(tmp_path / "c.jsonl")
    raw = tiny_spec(corpus, train_iters=9, log_interval=1, eval_interval=0, checkpoint_interval=0)
    raw["parallelism"], raw["resources"] = {"dp": 2}, {"devices": 2}
    plain = tmp_path / "plain"
    run_distributed(_rank, 2, raw, str(plain), (tmp_path / "store0" / "checkpoints").as_uri())
    raw["training"]["profile_steps"] = 2
    out, store = tmp_path / "run", tmp_path / "store" / "jobs" / "j1"
    run_distributed(_rank, 2, raw, str(out), (store / "checkpoints").as_uri())

    (event,) = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "profiled"]
    first, last = profiled_steps(0, 2)
    assert event["steps"] == [first, last] == [SKIP_STEPS + 2, SKIP_STEPS + 3]
    assert event["files"] == ["trace.rank0.json.gz", "trace.rank1.json.gz"]
    for name in event["files"]:
        local, beside = out / "profile" / name, store / "profile" / name
        assert local.read_bytes() == beside.read_bytes()  # copied next to the checkpoints
        events = _trace(local)
        steps = sorted(e["name"] for e in events if e["name"].startswith("ProfilerStep#"))
        assert steps == [f"ProfilerStep#{SKIP_STEPS + 1}", f"ProfilerStep#{SKIP_STEPS + 2}"]
        names = {e["name"] for e in events}
        assert {"data", "forward", "backward", "grad_sync", "optimizer"} <= names
        assert "aten::mm" in names
    # Profiling watches; it changes nothing the run computes.
    losses = [[r["loss"] for r in read_jsonl(d / "metrics.jsonl") if "loss" in r] for d in (plain, out)]
    assert len(losses[0]) == 9 and losses[0] == losses[1]


def test_a_run_shorter_than_the_window_ends_without_a_trace(tmp_path: Path) -> None:
    raw = tiny_spec(write_corpus(tmp_path / "c.jsonl"), train_iters=3, eval_interval=0, profile_steps=2)
    run(parse_spec(raw), tmp_path / "run")
    assert not (tmp_path / "run" / "profile").exists()
    assert not [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "profiled"]


def test_bad_profile_steps_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = tiny_spec(write_corpus(tmp_path / "c.jsonl"), profile_steps=21)
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert "training.profile_steps" in str(err.value)
    raw["training"]["profile_steps"] = 0
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(raw))
    assert main(["--spec", str(spec), "--out", str(tmp_path / "out"), "--profile", "-1"]) == 2
    assert "--profile -1: training.profile_steps must be in [0, 20]" in capsys.readouterr().err


def _plain_rank(rank: int, world: int, raw: dict[str, Any], out: str) -> None:
    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    run(parse_spec(raw), Path(out), ctx=ctx)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_a_zero_bubble_job_trains_and_validates_as_one_process(tmp_path: Path, schedule: str) -> None:
    """The engine run whole at pp=2 under a zero-bubble schedule (its validation is the schedule's
    forward_only): the losses and validation losses of one process, and a profile of its steps."""
    from .parallel._launch import run_distributed

    corpus = write_corpus(tmp_path / "c.jsonl")
    raw = tiny_spec(corpus, train_iters=6, log_interval=1, eval_interval=3, checkpoint_interval=0)
    raw["model"]["num_layers"] = 4
    run(parse_spec(raw), tmp_path / "one")
    v = 2 if schedule == "zbv" else 1
    raw["parallelism"] = {"pp": 2, "virtual_stages": v, "pipeline_schedule": schedule}
    raw["resources"] = {"devices": 2}
    raw["training"]["profile_steps"] = 1
    run_distributed(_plain_rank, 2, raw, str(tmp_path / "pp"))
    rows = [read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("one", "pp")]
    for key in ("loss", "val_loss"):
        got, want = ([r[key] for r in rs if key in r] for rs in (rows[1], rows[0]))
        assert len(want) >= 2 and got == pytest.approx(want, rel=1e-4), key
    assert [e["files"] for e in read_jsonl(tmp_path / "pp" / "events.jsonl") if e["event"] == "profiled"] == [
        ["trace.rank0.json.gz", "trace.rank1.json.gz"]
    ]
