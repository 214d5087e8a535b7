"""An MoE model trained by the engine (build_model, make_trainable, TrainLoop.step) under tp=2,
tp=2 with sequence parallelism, pp=2 (with full recompute) and dp=2 equals one process on the same
seed and data: losses,
gradient norms and the router statistics over 10 steps.

One spawn of 2 gloo ranks runs the four layouts in turn; the reference runs in this process. The
model has MoE layers 0 and 2 of 4 (so each pipeline stage holds one), a shared expert, a capacity
factor that drops tokens, and aux and z losses whose gradients flow through the autoscaler with the
loop's per-micro-batch scale. Tolerances as the dense layouts' (tests/engine/test_train.py): only the
fp32 summation order differs, ~1e-6 relative over these steps; a wrong shard, a missing tp sum of
the router's gradient or an aux gradient counted tp times moves the loss or norm by far more.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ._launch import run_distributed

STEPS = 10
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2, "dp": 1},
    "tp2-sp": {"tp": 2, "dp": 1, "sequence_parallel": True},
    "pp2": {"pp": 2, "dp": 1, "recompute": "full"},  # recompute: the router stats count once
    "dp2": {"dp": 2},
}


class Windows:
    """An in-memory dataset: sample i is row i of token windows (T + 1 tokens) that follow a fixed
    successor rule from a random start (next = 5·tok + 3 mod V), so a few steps lower the loss."""

    def __init__(self, vocab: int, seq: int, n: int):
        rows = [np.random.default_rng(5).integers(0, vocab, size=n)]
        for _ in range(seq):
            rows.append((5 * rows[-1] + 3) % vocab)
        self.rows = np.stack(rows, axis=1)  # (n, T + 1)

    def batch(self, ids: list[int]) -> Any:
        from megatrain.engine.data import Batch

        return Batch.from_windows(self.rows[ids])

    def prefetch(self, consumed: int) -> None:
        pass


def moe_spec(parallelism: dict[str, Any], world: int) -> dict[str, Any]:
    parallelism = dict(parallelism)
    recompute = parallelism.pop("recompute", "none")
    return {
        "name": "moe",
        "model": {
            "arch": "llama",
            "num_layers": 4,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 64,
            "seq_length": 16,
            "moe": {
                "num_experts": 4,
                "router_topk": 2,
                "ffn_hidden_size": 32,
                "layer_freq": 2,
                "shared_expert_ffn_hidden_size": 16,
                "aux_loss_coeff": 0.1,
                "z_loss_coeff": 1e-2,
                "capacity_factor": 1.25,
                # Softmax weights as they come: renormalised top-2 weights sit near each other, so
                # capacity drops that rank by them flip on fp32 reduction-order noise after a few steps.
                "router_pre_softmax": True,
            },
        },
        "data": {"train": [{"path": "file:///unused"}]},
        "training": {
            "train_iters": STEPS,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "lr": 1e-2,
            "warmup_iters": 1,
            "precision": "fp32",
            "recompute": recompute,
            "seed": 3,
        },
        "parallelism": {**parallelism, "distributed_optimizer": False},
        "resources": {"devices": world},
    }


def train_layout(parallelism: dict[str, Any], world: int) -> dict[str, Any]:
    """STEPS engine steps under `parallelism`: per-step loss and grad norm, the router figures, and
    layer 0's MoE weights gathered into the single-device layout (without a pipeline)."""
    from megatrain.engine.build import build_model, make_trainable
    from megatrain.engine.config import train_config, transformer_config
    from megatrain.engine.loop import Rates, TrainLoop, reduce_mean
    from megatrain.engine.moe_metrics import moe_metrics
    from megatrain.engine.parallel.parallelize import full_state_dict, load_full_state_dict
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.plan.layout import resolve_layout
    from megatrain.spec import parse_spec

    spec = parse_spec(moe_spec(parallelism, world))
    layout = resolve_layout(spec, world)
    cfg = train_config(spec, layout.dp)
    mcfg = transformer_config(spec, 128)
    state = ParallelState.build(layout)
    train = make_trainable(build_model(mcfg, state, cfg.seed, "cpu"), cfg, spec.parallelism, "fp32", mcfg)
    data = Windows(128, mcfg.seq_length, 8 * STEPS)

    class Quiet:
        metrics = events = None

        def say(self, _: str) -> None:
            pass

    loop = TrainLoop(train, cfg, {"train": data}, Quiet(), Rates(1.0, 1, None), lambda _: None)  # type: ignore[arg-type]
    losses, norms = [], []
    for step in range(STEPS):
        train.optimizer.set_lr(cfg.lr)
        loss, result = loop.step(step * cfg.global_batch_size)
        losses.append(reduce_mean(loss, state))
        norms.append(result.grad_norm)
    figures = moe_metrics(train.model.module, mcfg.moe, state)
    experts: dict[str, torch.Tensor] = {}
    if layout.pp == 1:  # the stacked experts gathered from their tp shards, and sliced back again
        module = train.model.module
        full = full_state_dict(module, state)
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        load_full_state_dict(module, full, state)
        assert all(torch.equal(p, before[n]) for n, p in module.named_parameters())
        experts = {n: t for n, t in full.items() if ".mlp." in n and "layers.0." in n}
    return {"losses": losses, "norms": norms, "moe": figures, "experts": experts}


def _layouts_rank(rank: int, world: int) -> dict[str, Any]:
    return {name: train_layout(par, world) for name, par in LAYOUTS.items()}


@pytest.mark.distributed
def test_moe_layouts_match_single_process() -> None:
    ref = train_layout({"dp": 1}, 1)
    assert ref["losses"][-1] < ref["losses"][0] - 0.3  # it learns: the comparison is not of noise
    figures = ref["moe"]
    assert 0 < figures["moe_dropped_fraction"] < 0.5 and figures["moe_load_imbalance"] >= 1.0
    # 2 MoE layers × 10 steps × 8 samples × 16 tokens × top-2 chosen pairs.
    assert sum(figures["moe_tokens_per_expert"]) == 2 * STEPS * 8 * 16 * 2
    got = run_distributed(_layouts_rank, 2, timeout=300)[0]
    for name in LAYOUTS:
        run = got[name]
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-4), name
        assert run["norms"] == pytest.approx(ref["norms"], rel=1e-3), name
        moe = run["moe"]
        assert moe["moe_tokens_per_expert"] == figures["moe_tokens_per_expert"], name
        for key in ("moe_aux_loss", "moe_z_loss", "moe_load_imbalance", "moe_dropped_fraction"):
            assert moe[key] == pytest.approx(figures[key], rel=1e-4), (name, key)
        for key, t in run["experts"].items():  # router, stacked experts, shared expert of layer 0
            assert t.shape == ref["experts"][key].shape, key
            torch.testing.assert_close(t, ref["experts"][key], rtol=1e-3, atol=1e-5, msg=f"{name} {key}")
    assert {"layers.0.mlp.experts.fc1_weight", "layers.0.mlp.router.gate.weight"} <= set(ref["experts"])
