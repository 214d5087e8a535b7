"""Whole models under context parallelism (alone and with tp+sp, pp, dp and the distributed optimizer,
recompute, packed documents, bf16) against one process on the same seed and data: the engine's own
build (build_model, make_trainable) and training step (TrainLoop.step) over 10 steps.

Tolerances. fp32: cp changes only the order of fp32 sums (blockwise softmax merging, gradients summed
over cp ranks, split matmuls under tp); measured, losses agree to ~1e-6 relative and first-step
gradients to ~1e-7 absolute. Asserted: losses rtol 1e-4, grad norms rtol 1e-3, gradients atol 1e-5,
while a rank at the wrong positions, a missing K/V block or a loss averaged over the wrong ranks moves
the loss by > 1e-2. bf16 (one case): both runs keep bf16 weights and activations, whose rounding
(2^-8 relative) differs between the layouts from the first matmul on; losses asserted at rtol 2e-2.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from megatrain.engine.build import build_model, make_trainable
from megatrain.engine.config import TrainConfig, TransformerConfig
from megatrain.engine.data.batch import Batch
from megatrain.engine.loop import TrainLoop, reduce_mean
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout
from megatrain.spec import ParallelismSpec

from ._launch import run_distributed

SEED, STEPS, GLOBAL_BATCH, MICRO_BATCH = 1234, 10, 8, 2


class _Data:
    """Sample i: a successor-rule sequence (learnable) from a seeded start; packed: 2-3 documents per
    row with positions restarting at each and the first label of each document masked out."""

    def __init__(self, vocab: int, seq: int, packed: bool):
        self.vocab, self.seq, self.packed = vocab, seq, packed

    def batch(self, ids: list[int]) -> Batch:
        rows = []
        for i in ids:
            x = [int(np.random.default_rng(i).integers(self.vocab))]
            for _ in range(self.seq):
                x.append((5 * x[-1] + 3) % self.vocab)
            rows.append(x)
        a = np.array(rows, dtype=np.int64)
        out = Batch.from_windows(a)
        if self.packed:
            seg = np.zeros((len(ids), self.seq), dtype=np.int64)
            for r, i in enumerate(ids):
                seg[r, 3 + i % 5 :] = 1
                seg[r, 11 + i % 3 :] = 2 if i % 2 else 1
            starts = np.ones_like(seg, dtype=bool)
            starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
            pos = np.zeros_like(seg)
            for r in range(len(ids)):
                for t in range(1, self.seq):
                    pos[r, t] = 0 if starts[r, t] else pos[r, t - 1] + 1
            out = Batch(out.tokens, out.labels, (~starts).astype(np.float32), pos, seg)
        return out

    def prefetch(self, start: int) -> None:
        pass


def _train_config(dp: int, opts: dict[str, Any], seq: int) -> TrainConfig:
    return TrainConfig(
        train_iters=STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
        data_parallel_size=dp, seq_length=seq, lr=1e-2, min_lr=1e-3, lr_schedule="constant",
        warmup_iters=0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6,
        clip_grad=0.5, precision=opts["precision"], fp8_recipe="tensorwise", fp8_backend="torchao",
        recompute=opts["recompute"], recompute_every=1,
        compile=False, initial_loss_scale=2.0**16, min_loss_scale=1.0, loss_scale_window=1000,
        hysteresis=2, checkpoint_interval=0, log_interval=1, eval_interval=0, eval_iters=0, seed=SEED,
    )  # fmt: skip


def _model_config(opts: dict[str, Any]) -> TransformerConfig:
    cfg = TransformerConfig.preset("tiny-gpt2" if opts["model"] == "gpt2" else "tiny-llama")
    return replace(cfg, num_layers=opts["layers"])


def _run(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_run_case(c) for c in cases]


def _run_case(opts: dict[str, Any]) -> dict[str, Any]:
    """Train one case on this rank; losses and grad norms per step, first-step gradients by name."""
    layout = Layout(**opts["layout"])
    state = ParallelState.build(layout)
    mcfg = _model_config(opts)
    cfg = _train_config(layout.dp, opts, mcfg.seq_length)
    par = ParallelismSpec(distributed_optimizer=opts["distopt"], grad_bucket_elements=4000)
    train = make_trainable(build_model(mcfg, state, SEED, "cpu"), cfg, par, cfg.precision, mcfg)
    data = _Data(mcfg.vocab_size, mcfg.seq_length, opts["packed"])
    loop = TrainLoop(train, cfg, {"train": data}, None, None, lambda p: None)  # type: ignore[arg-type]
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        loss, result = loop.step(step * GLOBAL_BATCH)
        losses.append(reduce_mean(loss, state))
        norms.append(result.grad_norm)
        if step == 0 and layout.tp == 1 and not train.ddp.use_distributed_optimizer:
            grads = {name: p.main_grad.detach().float().clone() for p, name in train.names.items()}
    return {"losses": losses, "norms": norms, "grads": grads}


def _case(layout: dict[str, Any], **kw: Any) -> dict[str, Any]:
    base = {"model": "llama", "layers": 2, "packed": False, "precision": "fp32", "recompute": "none"}
    base["distopt"] = False
    return {**base, **kw, "layout": layout}


CP2 = {  # two ranks
    "cp2": _case({"cp": 2}),
    "cp2-packed": _case({"cp": 2}, packed=True),
    "cp2-gpt2-selective": _case({"cp": 2}, model="gpt2", recompute="selective"),
    "cp2-bf16": _case({"cp": 2}, precision="bf16"),
}
CP2_X2 = {  # four ranks
    "cp2-tp2-sp": _case({"cp": 2, "tp": 2, "sequence_parallel": True}, recompute="full"),
    "cp2-pp2": _case({"cp": 2, "pp": 2}, layers=4, packed=True),
    "cp2-dp2": _case({"cp": 2, "dp": 2}),
    "cp2-dp2-distopt": _case({"cp": 2, "dp": 2}, model="gpt2", distopt=True, recompute="full"),
}


def _reference(opts: dict[str, Any]) -> dict[str, Any]:
    return _run_case({**opts, "layout": {}})


def _check(name: str, opts: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    ref = _reference(opts)
    bf16 = opts["precision"] == "bf16"
    for r, got in enumerate(ranks):
        assert got["losses"] == pytest.approx(ref["losses"], rel=2e-2 if bf16 else 1e-4), (name, r)
        if not bf16:
            assert got["norms"] == pytest.approx(ref["norms"], rel=1e-3), (name, r)
            for param, g in got["grads"].items():
                torch.testing.assert_close(g, ref["grads"][param], rtol=0, atol=1e-5, msg=f"{name} {param}")
    assert ref["losses"][-1] < 0.8 * ref["losses"][0]  # the runs learn: the comparison means something
    if opts["layout"].get("tp", 1) == 1 and not opts["distopt"]:
        # Every parameter's gradient was compared on some rank (pp stages each hold theirs).
        assert set().union(*(g["grads"] for g in ranks)) == set(ref["grads"]), name


@pytest.mark.distributed
def test_cp2_matches_single_process() -> None:
    ranks = run_distributed(_run, 2, list(CP2.values()), timeout=300)
    for c, (name, opts) in enumerate(CP2.items()):
        _check(name, opts, [r[c] for r in ranks])


@pytest.mark.distributed
def test_cp2_with_tp_pp_dp_matches_single_process() -> None:
    ranks = run_distributed(_run, 4, list(CP2_X2.values()), timeout=300)
    for c, (name, opts) in enumerate(CP2_X2.items()):
        _check(name, opts, [r[c] for r in ranks])
