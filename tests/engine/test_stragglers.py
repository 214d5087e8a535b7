"""Stragglers and the operator's fault injection: MEGATRAIN_FAULTS is parsed strictly (each bad
entry named); a `slow` fault on rank 1 of a two-rank data-parallel run makes rank 1's own work per
step the slowest (the other rank's time goes to waiting for it), every metrics row
carries the per-rank spread, and after three slow log intervals one `straggler` event names rank 1
and its host; the same run without the fault names nobody."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from megatrain.engine.runtime import Dist
from megatrain.engine.stragglers import StragglerWatch
from megatrain.engine.train import run
from megatrain.faults import ENV, RankFaults, parse
from megatrain.spec import parse_spec

from .helpers import tiny_spec, write_corpus


def test_faults_parse_and_belong_to_their_rank() -> None:
    faults = parse(
        "slow:rank=1,factor=3,from_step=2; hang:rank=0,at_step=5,once=/tmp/m ;kill:rank=2,at_step=1,signal=15"
    )
    assert [(f.kind, f.rank) for f in faults] == [("slow", 1), ("hang", 0), ("kill", 2)]
    assert faults[0].factor == 3.0 and faults[0].from_step == 2 and faults[1].once == "/tmp/m"
    assert faults[2].signal == 15 and parse("") == [] and parse(" ; ") == []
    assert not RankFaults(faults, 3) and len(RankFaults(faults, 1).faults) == 1
    for text, message in [
        ("explode:rank=0", "unknown fault 'explode'"),
        ("hang:rank=0", "hang needs at_step"),
        ("slow:rank=0,factor=2,at_step=3", "slow takes factor, from_step, rank"),
        ("kill:rank=x,at_step=1", "rank, steps, signal and status are integers, the others numbers"),
        ("slow:rank=0,factor=0.5", "factor is at least 1"),
        ("hang:rank", "hang takes at_step, once, rank"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse(text)


def test_a_rank_is_named_after_three_slow_intervals_and_again_after_it_recovers() -> None:
    watch = StragglerWatch(ratio=1.3, intervals=3)
    assert watch.observe([1.0, 1.5, 1.0]) == [] and watch.observe([1.0, 1.5, 1.0]) == []
    ((rank, ratio, median),) = watch.observe([1.0, 1.5, 1.0])
    assert (rank, ratio, median) == (1, 1.5, 1.0)
    assert watch.observe([1.0, 1.5, 1.0]) == []  # named once while it stays slow
    assert watch.observe([1.0, 1.2, 1.0]) == []  # under 1.3x: recovered
    for _ in range(2):
        assert watch.observe([1.0, 2.0, 1.0]) == []
    assert [r for r, _, _ in watch.observe([1.0, 2.0, 1.0])] == [1]
    assert watch.observe([0.0, 0.0]) == []  # no time measured: nobody is slow


def _rank(rank: int, world: int, raw: dict[str, Any], out: str) -> None:
    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    run(parse_spec(raw), Path(out), ctx=ctx)


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.distributed
def test_a_slowed_rank_is_named_a_straggler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from .parallel._launch import run_distributed

    raw = tiny_spec(write_corpus(tmp_path / "c.jsonl"), train_iters=8, log_interval=2, eval_interval=0,
                    checkpoint_interval=0)  # fmt: skip
    raw["parallelism"], raw["resources"] = {"dp": 2, "distributed_optimizer": False}, {"devices": 2}
    run_distributed(_rank, 2, raw, str(tmp_path / "plain"))
    monkeypatch.setenv(ENV, "slow:rank=1,factor=4")
    run_distributed(_rank, 2, raw, str(tmp_path / "slowed"))

    assert [e for e in _read(tmp_path / "plain" / "events.jsonl") if e["event"] == "straggler"] == []
    rows = [r for r in _read(tmp_path / "slowed" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 4 and all(r["slowest_rank"] == 1 for r in rows)
    assert all(r["rank_busy_time_max_s"] > 2 * r["rank_busy_time_min_s"] for r in rows)
    # (Rank 0 spends the difference waiting for rank 1, at the step boundary's collectives.)
    (event,) = [e for e in _read(tmp_path / "slowed" / "events.jsonl") if e["event"] == "straggler"]
    assert event["rank"] == 1 and event["host"] == socket.gethostname() and event["step"] == 6
    assert event["ratio"] > 1.3 and "rank 1 on" in event["reason"]  # (the median of two is their mean)
