"""The engine on a CUDA GPU: bf16 and fp16 training through the real entry point (skipped without one).

CPU tests prove the parallel numerics; these prove the GPU path the product sells: bf16 parameters
with fp32 main parameters, fp16 with the dynamic loss scaler, fused AdamW, SDPA's GPU kernels, peak
memory and MFU reported from the device, and losses that track an fp32 run of the same job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatrain.engine.train import run
from megatrain.spec import parse_spec

from .helpers import read_jsonl, tiny_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _train(tmp_path: Path, corpus: Path, name: str, **training: object) -> list[dict]:
    raw = tiny_spec(corpus, train_iters=40, log_interval=5, eval_interval=0, checkpoint_interval=0,
                    lr=1e-2, warmup_iters=3, lr_schedule="constant", **training)  # fmt: skip
    run(parse_spec(raw), tmp_path / name)
    return read_jsonl(tmp_path / name / "metrics.jsonl")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_training_on_gpu_tracks_fp32(tmp_path: Path, corpus: Path, precision: str) -> None:
    gpu = _train(tmp_path, corpus, precision, precision=precision)
    events = read_jsonl(tmp_path / precision / "events.jsonl")
    started = next(e for e in events if e["event"] == "started")
    assert started["precision"] == precision and started["device"] != "cpu"  # the GPU's name
    losses = [r["loss"] for r in gpu]
    assert losses[-1] < 0.7 * losses[0]
    assert all(r["mfu"] > 0 and r["peak_memory_bytes"] > 0 for r in gpu)
    if precision == "fp16":
        assert all(r["loss_scale"] and r["loss_scale"] > 0 for r in gpu)
    ref = [r["loss"] for r in _train(tmp_path, corpus, "fp32-ref", precision="fp32")]
    # Same data order and initialisation; 16-bit rounding drifts slowly over 40 steps.
    assert losses[0] == pytest.approx(ref[0], rel=2e-2)
    assert losses[-1] == pytest.approx(ref[-1], rel=0.15)


@pytest.mark.parametrize("async_checkpoint", [True, False])
def test_checkpoints_from_gpu_resume_exactly(tmp_path: Path, corpus: Path, async_checkpoint: bool) -> None:
    """Sharded saves from device memory (staged into pinned host buffers when async, one box at a
    time when not) resume where the run was on the GPU."""
    import shutil

    raw = tiny_spec(corpus, train_iters=6, checkpoint_interval=3, eval_interval=0, precision="bf16",
                    async_checkpoint=async_checkpoint)  # fmt: skip
    run(parse_spec(raw), tmp_path / "straight")
    losses = [r["loss"] for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]
    shutil.copytree(tmp_path / "straight" / "checkpoints", tmp_path / "resumed" / "checkpoints")
    (tmp_path / "resumed" / "checkpoints" / "iter_0000006" / "manifest.json").unlink()
    run(parse_spec(raw), tmp_path / "resumed")
    # GPU attention backward kernels may add in a different order from run to run: close, not equal.
    assert [r["loss"] for r in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")] == pytest.approx(
        losses[3:], rel=1e-3
    )
