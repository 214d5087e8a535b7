"""An MoE spec trained end to end by the engine: router figures in metrics.jsonl, a resume that
continues exactly, and a checkpoint's stacked expert weights resharded over tp and back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from megatrain.engine.checkpoint import read_weights
from megatrain.engine.train import run
from megatrain.spec import parse_spec

from .helpers import assert_adam_weights_close, read_jsonl, tiny_spec
from .helpers import torchrun as _torchrun

MOE = {"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 32, "shared_expert_ffn_hidden_size": 16,
       "z_loss_coeff": 1e-3, "capacity_factor": 1.5}  # fmt: skip


def moe_spec(corpus: Path, **training: Any) -> dict[str, Any]:
    settings = {"train_iters": 6, "checkpoint_interval": 3, "eval_interval": 0, "log_interval": 1, **training}
    raw = tiny_spec(corpus, **settings)
    raw["model"]["moe"] = dict(MOE)
    return raw


def _resume_at(src: Path, dst: Path, step: int) -> None:
    folder = f"iter_{step:07d}"
    shutil.copytree(src / "checkpoints" / folder, dst / "checkpoints" / folder)
    (dst / "checkpoints" / "latest").write_text(f"{step}\n")


def test_moe_run_logs_router_figures_and_resumes_exactly(tmp_path: Path, corpus: Path) -> None:
    raw = moe_spec(corpus)
    assert run(parse_spec(raw), tmp_path / "a")["step"] == 6
    rows = [r for r in read_jsonl(tmp_path / "a" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        # 2 MoE layers × 8 samples × 32 tokens × top-2 pairs per step.
        assert sum(r["moe_tokens_per_expert"]) == 2 * 8 * 32 * 2 and len(r["moe_tokens_per_expert"]) == 4
        assert 0.009 < r["moe_aux_loss"] < 0.05  # 1e-2 × (1 when balanced .. E when collapsed)
        assert r["moe_z_loss"] > 0 and 0 <= r["moe_dropped_fraction"] < 0.5
        assert r["moe_load_imbalance"] >= 1.0
    assert rows[-1]["loss"] < rows[0]["loss"]
    # The planner's estimate counts the experts: the measured model state (parameters, gradients,
    # optimizer state of the real tensors) agrees with it, as for dense models.
    started = next(e for e in read_jsonl(tmp_path / "a" / "events.jsonl") if e["event"] == "started")
    est = started["memory_estimate"]
    assert rows[-1]["measured_params_bytes"] == pytest.approx(est["params_bytes"], rel=0.05)
    planned = est["params_bytes"] + est["grads_bytes"] + est["optimizer_bytes"]
    assert rows[-1]["model_state_bytes"] == pytest.approx(planned, rel=0.05)
    # Resumed at step 3 in a fresh folder: steps 4-6 are the same numbers.
    _resume_at(tmp_path / "a", tmp_path / "b", 3)
    run(parse_spec(raw), tmp_path / "b")
    again = {r["step"]: r for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "loss" in r}
    assert sorted(again) == [4, 5, 6]
    for r in rows[3:]:
        assert again[r["step"]]["loss"] == r["loss"]
        assert again[r["step"]]["moe_tokens_per_expert"] == r["moe_tokens_per_expert"]


@pytest.mark.distributed
def test_moe_checkpoint_reshards_over_tensor_parallel_ranks(tmp_path: Path, corpus: Path) -> None:
    """tp=2 with sequence parallelism resumes a one-process checkpoint (each rank reads its slice of
    the stacked experts: fc1 rows with stride 2, fc2 columns) and continues as the single run did;
    its own final checkpoint holds the full single-device weights again."""
    raw = moe_spec(corpus)
    run(parse_spec(raw), tmp_path / "single")
    _resume_at(tmp_path / "single", tmp_path / "tp", 3)
    raw["parallelism"] = {"tp": 2, "sequence_parallel": True}
    raw["resources"] = {"devices": 2}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    proc = _torchrun(2, tmp_path / "spec.json", tmp_path / "tp", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ref = {r["step"]: r for r in read_jsonl(tmp_path / "single" / "metrics.jsonl") if "loss" in r}
    got = {r["step"]: r for r in read_jsonl(tmp_path / "tp" / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == [4, 5, 6]
    for s, r in got.items():
        assert r["loss"] == pytest.approx(ref[s]["loss"], rel=1e-4)
        assert r["moe_aux_loss"] == pytest.approx(ref[s]["moe_aux_loss"], rel=1e-4)
    mine, _ = read_weights(tmp_path / "tp" / "checkpoints" / "iter_0000006")
    theirs, _ = read_weights(tmp_path / "single" / "checkpoints" / "iter_0000006")
    assert "layers.0.mlp.experts.fc1_weight" in mine
    assert_adam_weights_close(mine, theirs, lr=raw["training"]["lr"], steps=3)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_moe_run_tracks_fp32(
    tmp_path: Path, corpus: Path, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16/fp16 MoE weights with fp32 main weights (routing in fp32; fp16's dynamic loss scale on
    the aux gradient too) train like fp32, within test_train's 3% for the loss. The aux gradient's
    scale itself is checked in test_moe_metrics."""
    from megatrain.settings import reset_settings_cache

    monkeypatch.setenv("MEGATRAIN_CPU_LOW_PRECISION", "1")
    reset_settings_cache()
    raw = moe_spec(corpus, checkpoint_interval=0)
    raw["model"]["moe"]["capacity_factor"] = None  # a drop decided by a rounding would be noise
    run(parse_spec(raw), tmp_path / "fp32")
    raw["training"]["precision"] = precision
    run(parse_spec(raw), tmp_path / precision)
    ref = [r["loss"] for r in read_jsonl(tmp_path / "fp32" / "metrics.jsonl")]
    rows = read_jsonl(tmp_path / precision / "metrics.jsonl")
    assert [r["loss"] for r in rows] == pytest.approx(ref, rel=3e-2)
    assert [r["moe_aux_loss"] for r in rows] == pytest.approx(
        [r["moe_aux_loss"] for r in read_jsonl(tmp_path / "fp32" / "metrics.jsonl")], rel=5e-2
    )
