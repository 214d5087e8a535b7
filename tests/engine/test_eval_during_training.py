"""training.eval_tasks: lm-eval tasks scored on the training ranks between steps (engine.evaluation.
during), and validation under OpenAI's names (valid_loss, valid_mean_token_accuracy, full_valid_*).

The scores land in the metrics stream at every eval step; the steps' own time excludes them; a run
with tasks trains exactly as one without (lm-eval's seeding is undone); at pp=2 and tp=2 the scores
equal one process's at the same steps."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lm_eval")

from megatrain.spec import parse_spec  # noqa: E402

from .helpers import read_jsonl, tiny_spec  # noqa: E402

TASK = Path(__file__).resolve().parents[2] / "examples" / "eval" / "corpus_mc.yaml"


def _raw(corpus: Path, tasks: bool = True) -> dict[str, Any]:
    raw = tiny_spec(corpus, train_iters=6, eval_interval=3, log_interval=3, checkpoint_interval=0)
    raw["model"]["hidden_dropout"] = 0.1  # the run draws from torch's generator every step
    if tasks:
        raw["training"].update(eval_tasks=[TASK.as_uri()], eval_tasks_limit=6)
    return raw


def _rows(out: Path) -> tuple[list[dict], list[dict], list[dict]]:
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    valid = [r for r in rows if "val_loss" in r]
    scored = [r for r in rows if "eval" in r]
    return train, valid, scored


def test_tasks_are_scored_at_each_eval_step_outside_the_step_time(tmp_path: Path, corpus: Path) -> None:
    from megatrain.engine.train import run

    run(parse_spec(_raw(corpus)), tmp_path / "tasks")
    train, valid, scored = _rows(tmp_path / "tasks")
    assert [r["step"] for r in scored] == [3, 6]
    for row in scored:
        acc = row["eval"]["corpus_mc"]["acc"]
        assert acc["n"] == 6 and 0.0 <= acc["value"] <= 1.0 and acc["stderr"] is not None
    # OpenAI's names beside ours; the whole split at the end.
    assert [r["step"] for r in valid] == [3, 6]
    for row in valid:
        assert row["valid_loss"] == row["val_loss"]
        assert 0.0 < row["valid_mean_token_accuracy"] < 1.0
    assert "full_valid_loss" not in valid[0]
    assert valid[1]["full_valid_loss"] > 0 and 0.0 < valid[1]["full_valid_mean_token_accuracy"] < 1.0
    events = [e for e in read_jsonl(tmp_path / "tasks" / "events.jsonl") if e["event"] == "evaluated"]
    assert [(e["step"], e["what"]) for e in events] == [
        (3, "validation"), (3, "tasks"), (6, "validation"), (6, "tasks"),
    ]  # fmt: skip
    # The pauses after step 3 (validation, then the tasks) are no part of steps 4-6's time: the
    # interval's steps take the wall time between the two rows less the pauses (whatever the load).
    paused = sum(e["seconds"] for e in events if e["step"] == 3)
    between = train[1]["time"] - train[0]["time"]
    assert [r["step"] for r in train] == [3, 6] and paused > 0.05
    assert train[1]["iter_time_s"] * 3 <= between - paused + 0.02, (train, paused)

    # lm-eval seeds every generator as it starts: the run must not notice (dropout draws each step).
    run(parse_spec(_raw(corpus, tasks=False)), tmp_path / "plain")
    plain_train, plain_valid, plain_scored = _rows(tmp_path / "plain")
    assert not plain_scored
    assert [r["loss"] for r in plain_train] == [r["loss"] for r in train]
    assert [r["val_loss"] for r in plain_valid] == [r["val_loss"] for r in valid]


def _rank(rank: int, world: int, raw: dict[str, Any], out: str) -> None:
    import torch.distributed as dist

    from megatrain.engine.runtime import Dist
    from megatrain.engine.train import run

    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    run(parse_spec(raw), Path(out), ctx=ctx)


@pytest.mark.distributed
def test_tasks_during_training_at_pp2_and_tp2_score_as_one_process(tmp_path: Path, corpus: Path) -> None:
    from megatrain.engine.train import run

    from .parallel._launch import run_distributed

    raw = _raw(corpus)
    raw["model"]["hidden_dropout"] = 0.0  # the layouts draw dropout masks differently
    run(parse_spec(raw), tmp_path / "one")
    _, ref_valid, ref = _rows(tmp_path / "one")
    for name, parallelism in {
        "pp2": {"pp": 2, "dp": 1},
        "tp2": {"tp": 2, "dp": 1, "sequence_parallel": True},
    }.items():
        layout = copy.deepcopy(raw)
        layout["parallelism"], layout["resources"] = parallelism, {"devices": 2}
        run_distributed(_rank, 2, layout, str(tmp_path / name), timeout=240)
        _, valid, scored = _rows(tmp_path / name)
        assert [r["step"] for r in scored] == [3, 6], name
        for got, want in zip(scored, ref, strict=True):
            for metric in ("acc", "acc_norm"):
                mine, theirs = got["eval"]["corpus_mc"][metric], want["eval"]["corpus_mc"][metric]
                assert mine["value"] == pytest.approx(theirs["value"]), (name, metric)
                assert mine["n"] == theirs["n"] == 6
        for got, want in zip(valid, ref_valid, strict=True):
            assert got["valid_loss"] == pytest.approx(want["valid_loss"], abs=1e-5), name
            accuracy = want["valid_mean_token_accuracy"]
            assert got["valid_mean_token_accuracy"] == pytest.approx(accuracy, abs=1e-6), name
