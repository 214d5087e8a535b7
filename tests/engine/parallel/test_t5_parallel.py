"""T5 under tensor (+ sequence) and pipeline parallelism against one process (gloo ranks on CPU).

Each layout runs 3 SGD steps of a tiny T5 (heads × kv_channels != hidden, a padded vocabulary,
encoder padding masks, decoder padding and masked targets with T5's -1 labels) on the batch one
process trains on (T5Model.loss, the fused head), and must give its losses, every gradient of the
first step, gathered over tp to its single-device name on each stage that holds it (so the copies of
the embedding and of the relative bias tables are each checked), and the final weights.

Tolerances (rtol 1e-5, atol 1e-6): only the fp32 summation order differs (row-parallel partial
sums, the vocab-parallel softmax over shards, micro-batch gradients accumulated one by one, copies'
gradients summed over stages), a few ulps per op: measured, losses within 1 ulp (5e-7 at ~4.1),
gradients within 5e-8 of the reference's (the largest are 0.3), weights within 1.2e-7 after three
SGD steps of lr 0.5 (SGD passes a gradient's error on linearly: lr·steps·5e-8; Adam would turn the
rounding noise of a near-zero gradient into an lr-sized step). A missing reduction, a wrong head
slice or a copy out of sync moves values by >= 1e-3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from megatrain.engine.microbatch import token_share
from megatrain.engine.models.t5 import T5Config, T5Model
from megatrain.engine.parallel.mappings import (
    allreduce_sequence_parallel_grads,
    gather_shards,
    is_tensor_parallel,
)
from megatrain.engine.parallel.parallelize import full_state_dict, load_full_state_dict
from megatrain.engine.parallel.parallelize_t5 import parallelize_t5, t5_lm_loss
from megatrain.engine.parallel.pipeline import load_pipeline_state_dict, pipeline_full_state_dict
from megatrain.engine.parallel.pipeline_t5 import (
    StageLayers,
    T5MicroBatch,
    allreduce_t5_shared_grads,
    build_t5_schedule,
    build_t5_stages,
    t5_boundary_shapes,
    t5_shared_stages,
    t5_stage_layers,
    t5_stage_parameter_names,
)
from megatrain.engine.parallel.random import RNGStatesTracker
from megatrain.engine.parallel.schedules import pipeline_loss
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout, LayoutError

from ._launch import run_distributed
from ._tp_common import fake_state

SEED, STEPS, BATCH, MICRO, LR = 1234, 3, 4, 2, 0.5
TOL = {"rtol": 1e-5, "atol": 1e-6}  # see the module docstring


def t5_config(flavour: str, **overrides: Any) -> T5Config:
    values: dict[str, Any] = {
        "num_layers": 2,
        "num_decoder_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "kv_channels": 6,  # inner width 24 != hidden 32
        "ffn_hidden_size": 48,
        "vocab_size": 64,
        "vocab_size_unpadded": 60,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "encoder_seq_length": 16,
        "decoder_seq_length": 8,
    }
    if flavour == "relu-tied":
        values |= {"activation": "relu", "tie_embeddings": True}
    else:
        values |= {"activation": "gated-gelu", "tie_embeddings": False}
    return T5Config(**(values | overrides))


def make_batch(cfg: T5Config, step: int) -> T5MicroBatch:
    """Rows of different real lengths in both stacks, T5's -1 under padded labels, and one more
    decoder token per row left out of the loss."""
    g = torch.Generator().manual_seed(SEED * 100 + step)
    s, t, v = cfg.encoder_seq_length, cfg.decoder_seq_length, cfg.real_vocab_size
    enc_len, dec_len = torch.tensor([16, 11, 7, 13]), torch.tensor([8, 5, 3, 6])
    enc_mask = (torch.arange(s) < enc_len[:, None]).long()
    dec_mask = (torch.arange(t) < dec_len[:, None]).long()
    enc = torch.randint(1, v, (BATCH, s), generator=g) * enc_mask
    dec = torch.randint(1, v, (BATCH, t), generator=g) * dec_mask
    labels = torch.randint(1, v, (BATCH, t), generator=g).masked_fill(dec_mask == 0, -1)
    loss_mask = dec_mask.float()
    loss_mask[:, 1] = 0.0
    return T5MicroBatch(enc, labels, loss_mask, dec_tokens=dec, enc_mask=enc_mask, dec_mask=dec_mask)


def reference(cfg: T5Config) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = T5Model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        b = make_batch(cfg, step)
        opt.zero_grad()
        loss = model.loss(b.tokens, b.dec_tokens, b.labels, b.loss_mask, b.enc_mask, b.dec_mask)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.item())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "weights": weights}


def _gather(names: dict[nn.Parameter, str], state: ParallelState, grad: bool) -> dict[str, torch.Tensor]:
    out = {}
    for p, name in names.items():
        t = (p.grad if grad else p).detach()
        if is_tensor_parallel(p):
            t = gather_shards(t, p.partition_dim, p.partition_stride, state.tp_group, state.tp_size)
        out[name] = t.clone()
    return out


def _rank(
    rank: int, world: int, flavour: str, tp: int, pp: int, sp: bool, split: int | None, schedule: str
) -> dict:
    cfg = t5_config(flavour)
    state = ParallelState.build(Layout(tp=tp, pp=pp, sequence_parallel=sp, pipeline_schedule=schedule))
    torch.manual_seed(SEED)
    model = T5Model(cfg)
    tracker = RNGStatesTracker.for_tensor_parallel(SEED, state) if tp > 1 else None
    model = parallelize_t5(model, state, rng_tracker=tracker)
    limit = cfg.real_vocab_size
    if pp > 1:
        stages = build_t5_stages(model, state, split)
        module: nn.Module = nn.ModuleList(stages)
        names = t5_stage_parameter_names(stages)
        sched = build_t5_schedule(stages, state, split, MICRO, dtype=torch.float32, schedule=schedule)
    else:
        module, names = model, {p: n for n, p in model.named_parameters()}
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        b = make_batch(cfg, step)
        opt.zero_grad()
        if pp > 1:
            mbs = b.split(MICRO)
            denom = float(sum(mb.num_loss_tokens for mb in mbs))

            def loss_fn(out: torch.Tensor, mb: Any, denom: float = denom) -> torch.Tensor:
                mean = t5_lm_loss(out, mb.labels, mb.loss_mask, state, limit)
                return token_share(mean, mb.num_loss_tokens, denom)

            loss = pipeline_loss(sched.forward_backward(mbs, loss_fn), state)
            allreduce_t5_shared_grads(stages, state)
        else:
            logits = model(b.tokens, b.dec_tokens, b.enc_mask, b.dec_mask)  # (B, T, V/tp)
            loss = t5_lm_loss(logits, b.labels, b.loss_mask, state, limit)
            loss.backward()
        allreduce_sequence_parallel_grads(module, state)
        if step == 0:
            grads = _gather(names, state, grad=True)
        opt.step()
        losses.append(loss.item())
    weights = _gather(names, state, grad=False)
    # The generic state-dict helpers on T5: gathered == the weights, and loading them back is exact.
    if pp > 1:
        full = pipeline_full_state_dict(stages, state)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        canonical = full if full is not None else {}
        whole = [canonical]
        torch.distributed.broadcast_object_list(whole, src=0)
        load_pipeline_state_dict(stages, whole[0], state)
    else:
        full = full_state_dict(model, state)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        load_full_state_dict(model, full, state)
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    return {
        "stage": state.pp_rank,
        "tp_rank": state.tp_rank,
        "losses": losses,
        "grads": grads,
        "weights": weights,
        "full": full,
    }


CASES = {
    # name: (flavour, tp, pp, sequence_parallel, split_rank)
    "tp2-sp-gated-untied": ("gated-untied", 2, 1, True, None),
    "tp2-relu-tied": ("relu-tied", 2, 1, False, None),
    "pp2-split1-relu-tied": ("relu-tied", 1, 2, False, 1),
    "pp4-split2-relu-tied": ("relu-tied", 1, 4, False, 2),
    "tp2-sp-pp2-gated-untied": ("gated-untied", 2, 2, True, 1),
    # zb-h1: each backward split into the input gradient (B) and the deferred weight GEMMs (W).
    "pp4-split2-relu-tied-zbh1": ("relu-tied", 1, 4, False, 2),
    "tp2-sp-pp2-gated-untied-zbh1": ("gated-untied", 2, 2, True, 1),
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_t5_parallel_matches_single_process(case: str) -> None:
    flavour, tp, pp, sp, split = CASES[case]
    schedule = "zb-h1" if case.endswith("zbh1") else "1f1b"
    results = run_distributed(_rank, tp * pp, flavour, tp, pp, sp, split, schedule, timeout=120)
    ref = reference(t5_config(flavour))
    seen: set[str] = set()
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL)
        if res["tp_rank"]:
            continue
        assert res["grads"].keys() == res["weights"].keys()
        for name, grad in res["grads"].items():
            where = f"stage {res['stage']}: {name}"
            torch.testing.assert_close(grad, ref["grads"][name], **TOL, msg=where)
            torch.testing.assert_close(res["weights"][name], ref["weights"][name], **TOL, msg=where)
        seen |= res["grads"].keys()
    assert seen == ref["weights"].keys()  # every parameter lives on some stage
    full = results[0]["full"]
    for name, value in ref["weights"].items():
        torch.testing.assert_close(full[name], value, **TOL, msg=name)


def _dropout_rank(rank: int, world: int) -> list[float]:
    cfg = t5_config("gated-untied", hidden_dropout=0.2, attention_dropout=0.2)
    state = ParallelState.build(Layout(tp=2, sequence_parallel=True))
    torch.manual_seed(SEED)
    model = parallelize_t5(T5Model(cfg), state, rng_tracker=RNGStatesTracker.for_tensor_parallel(SEED, state))
    b = make_batch(cfg, 0)
    losses = []
    for _ in range(2):
        logits = model(b.tokens, b.dec_tokens, b.enc_mask, b.dec_mask)
        loss = t5_lm_loss(logits, b.labels, b.loss_mask, state, cfg.real_vocab_size)
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed
def test_t5_dropout_under_tensor_parallelism() -> None:
    """With every dropout on (those on split tensors under the tracker's stream), a tensor-parallel
    forward and backward run, the ranks agree on the loss, and each forward draws new masks."""
    first, second = run_distributed(_dropout_rank, 2, timeout=120)
    assert first == second and all(torch.isfinite(torch.tensor(first)))
    assert first[0] != first[1]


# --------------------------------------------------------------------------------------------------
# The plan and the checks, without processes.


def test_stage_layers_split_and_rules() -> None:
    cfg = t5_config("relu-tied", num_layers=3, num_decoder_layers=2)
    assert t5_stage_layers(cfg, 1, None) == [StageLayers((0, 3), (0, 2))]
    assert t5_stage_layers(cfg, 4, 2) == [
        StageLayers((0, 1), None),
        StageLayers((1, 3), None),
        StageLayers(None, (0, 1)),
        StageLayers(None, (1, 2)),
    ]
    assert t5_stage_layers(cfg, 3, 1, [3, 1, 1])[0] == StageLayers((0, 3), None)
    for split, counts in ((None, None), (0, None), (3, None), (1, [2, 1, 2]), (1, [3, 2, 0])):
        with pytest.raises(LayoutError):
            t5_stage_layers(cfg, 3, split, counts)
    with pytest.raises(LayoutError, match="every stage needs a layer"):
        t5_stage_layers(cfg, 4, 1)


def test_shared_stages_and_boundary_shapes() -> None:
    assert t5_shared_stages(2, 1, True) == {"embed.weight": (0, 1)}
    assert t5_shared_stages(4, 2, True) == {
        "embed.weight": (0, 2, 3),
        "encoder.rel_bias.weight": (0, 1),
        "decoder.rel_bias.weight": (2, 3),
    }
    assert t5_shared_stages(3, 1, False) == {"embed.weight": (0, 1), "decoder.rel_bias.weight": (1, 2)}
    # pp 4, split 2, micro-batch 2, S 16, T 8, C 32, sequence-parallel over 2.
    shapes = [t5_boundary_shapes(s, 4, 2, 2, 16, 8, 32, 2) for s in range(4)]
    assert shapes == [
        (None, (2, 8, 32)),
        ((2, 8, 32), (2, 8, 32)),  # the encoder's output reaches the first decoder stage alone
        ((2, 8, 32), (2, 12, 32)),  # then travels beside the decoder stream
        ((2, 12, 32), None),
    ]


def test_parallelize_checks_layout_and_dropout() -> None:
    torch.manual_seed(SEED)
    with pytest.raises(LayoutError, match="num_attention_heads"):
        parallelize_t5(T5Model(t5_config("relu-tied")), fake_state(3, 0))
    with pytest.raises(LayoutError, match="model.t5.decoder_seq_length"):
        parallelize_t5(T5Model(t5_config("relu-tied", decoder_seq_length=6)), fake_state(4, 0, sp=True))
    with pytest.raises(ValueError, match="rng_tracker"):
        parallelize_t5(T5Model(t5_config("relu-tied", hidden_dropout=0.1)), fake_state(2, 0))


def test_one_stage_pipeline_is_the_model() -> None:
    cfg = t5_config("gated-untied")
    torch.manual_seed(SEED)
    model = T5Model(cfg)
    (stage,) = build_t5_stages(model, ParallelState.single(), None)
    b = make_batch(cfg, 0)
    expect = model(b.tokens, b.dec_tokens, b.enc_mask, b.dec_mask)
    torch.testing.assert_close(stage(b.tokens, **b.model_inputs), expect, rtol=0, atol=0)
    assert set(t5_stage_parameter_names([stage]).values()) == {n for n, _ in model.named_parameters()}
