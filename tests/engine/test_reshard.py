"""Sharded checkpoints across layouts: a chain tp2×pp2 -> dp2 (distributed optimizer) -> tp4 -> one
process (a vocabulary padded differently), each link loading the last one's checkpoint. The logits
of the live model before its save equal those of the next layout right after its load, and the
losses continue the single-process run on the same seed and data."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatrain.engine.build import Trainable
from megatrain.engine.checkpoint import load_checkpoint
from megatrain.engine.microbatch import MicroBatch
from megatrain.engine.runtime import Dist
from megatrain.engine.train import run
from megatrain.spec import parse_spec

from .helpers import read_jsonl, tiny_spec
from .parallel._launch import run_distributed

PROBE = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(3))


def logits_of(train: Trainable) -> torch.Tensor | None:
    """The full (B, T, V) logits of PROBE on the rank holding the last stage's tp rank 0; else None."""
    state, model = train.model.state, train.model
    train.ddp.eval()
    tokens = PROBE.to(state.device)
    with torch.no_grad():
        if train.pipeline is not None:
            outs: list[torch.Tensor] = []

            def keep(out: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
                outs.append(out.detach())
                return out.sum() * 0

            train.pipeline.forward_only([(tokens, tokens)], keep)
            if not outs:
                return None
            out = outs[0]
            last = model.chunks[-1]
            if getattr(last, "return_hidden", False):  # tp=1 fuses the head into the loss
                out = out @ last.lm_head.weight.t()
        else:
            out = train.ddp.module(tokens)
    if state.tp_size > 1:
        parts = [torch.empty_like(out) for _ in range(state.tp_size)]
        dist.all_gather(parts, out.contiguous(), group=state.tp_group)
        out = torch.cat(parts, dim=-1)
    return out.float().cpu() if state.tp_rank == 0 and state.dp_rank == 0 else None


def _rank(rank: int, world: int, raw: dict[str, Any], out: str) -> Any:
    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    summary = run(parse_spec(raw), Path(out), ctx=ctx, probe=logits_of)
    return summary["probe"]


def _link(
    raw: dict[str, Any], parallelism: dict[str, Any], world: int, out: Path, iters: int
) -> torch.Tensor:
    raw = copy.deepcopy(raw)
    raw["parallelism"], raw["resources"] = parallelism, {"devices": world}
    raw["training"]["train_iters"] = iters
    results = run_distributed(_rank, world, raw, str(out), timeout=240)
    found = [r for r in results if r is not None]
    assert len(found) == 1
    return found[0]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r}


@pytest.mark.distributed
def test_checkpoints_reshard_across_layouts(tmp_path: Path, corpus: Path) -> None:
    # A constant schedule: each link stops early (train_iters) without changing any step's lr.
    raw = tiny_spec(corpus, train_iters=6, checkpoint_interval=1, eval_interval=0, log_interval=1,
                    lr_schedule="constant")  # fmt: skip
    raw["model"]["num_query_groups"] = 4  # tp=4 needs whole key/value groups per rank
    ref_out = tmp_path / "single"
    run(parse_spec(raw), ref_out)
    ref = _losses(ref_out)

    run_dir = tmp_path / "run"  # one checkpoint root that every layout resumes from in turn
    before = _link(raw, {"tp": 2, "pp": 2}, 4, run_dir, 3)
    after = _link(raw, {"dp": 2, "distributed_optimizer": True, "grad_bucket_elements": 3000}, 2, run_dir, 3)
    # Same weights, other layout: only the fp32 summation order differs (~1e-7).
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    dp_end = _link(raw, {"dp": 2, "distributed_optimizer": True, "grad_bucket_elements": 3000}, 2, run_dir, 5)
    tp4 = _link(raw, {"tp": 4}, 4, run_dir, 5)
    torch.testing.assert_close(tp4, dp_end, rtol=1e-5, atol=1e-5)
    _link(raw, {"tp": 4}, 4, run_dir, 6)

    got = _losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]  # every step once: none lost, none counted twice
    for step, loss in got.items():
        assert loss == pytest.approx(ref[step], rel=1e-4), step
    events = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "started"]
    assert [e["resumed_from"] for e in events] == [None, 3, 3, 5, 5]

    # One process, the vocabulary padded to 512 rows instead of 384: the rows both have are the
    # checkpoint's, so the real vocabulary's logits are unchanged.
    final, _ = load_checkpoint(run_dir / "checkpoints")
    wider = copy.deepcopy(raw)
    wider["model"]["vocab_size"] = 512
    wider["training"]["train_iters"] = 6
    single = run(parse_spec(wider), tmp_path / "wide", checkpoint_url=(run_dir / "checkpoints").as_uri(),
                 probe=logits_of)  # fmt: skip
    assert single["probe"].shape[-1] == 512
    with torch.no_grad():
        expected = final(PROBE)
    torch.testing.assert_close(single["probe"][..., :384], expected, rtol=1e-5, atol=1e-5)
    assert (
        json.loads((run_dir / "checkpoints" / "iter_0000006" / "manifest.json").read_text())["layout"]["tp"]
        == 4
    )


@pytest.mark.distributed
def test_exact_resume_under_tp2_dp2(tmp_path: Path, corpus: Path) -> None:
    """tp=2 × dp=2 with the distributed optimizer: resumed from step 3 of its own run, the losses of
    steps 4-6 are bit-identical to the uninterrupted run's."""
    raw = tiny_spec(corpus, train_iters=6, checkpoint_interval=3, eval_interval=0, log_interval=1,
                    lr_schedule="constant")  # fmt: skip
    layout = {"tp": 2, "dp": 2, "distributed_optimizer": True, "grad_bucket_elements": 3000}
    _link(raw, layout, 4, tmp_path / "straight", 6)
    resumed = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "iter_0000003", resumed / "iter_0000003")
    _link(raw, layout, 4, tmp_path / "resumed", 6)
    straight, again = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(again) == [4, 5, 6]
    assert all(again[s] == straight[s] for s in again), (again, straight)
