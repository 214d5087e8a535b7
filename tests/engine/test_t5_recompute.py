"""T5 activation recompute (training.recompute full | selective, recompute_every): the same losses
and gradients as without it, on one process and in a pipeline's stages (dropout on: the rerun
draws the first pass's masks), under tensor + sequence parallelism with every dropout on (the RNG
tracker's streams replayed), through the engine from a spec; and less memory held for backward.

Equality is exact: a recompute reruns the very ops of the first pass on the very inputs, and the
backward then runs the same kernels in the same order (fp32, one thread count, one process).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from megatrain.engine.memtrack import LiveTensorBytes
from megatrain.engine.models.t5 import T5Config, T5Model
from megatrain.engine.parallel.pipeline_t5 import T5MicroBatch, T5Stage, t5_stage_layers

MODES = [("none", 1), ("selective", 1), ("full", 1), ("full", 2)]


def config(**overrides: Any) -> T5Config:
    values: dict[str, Any] = {
        "num_layers": 3,
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
        "activation": "gated-gelu",
        "tie_embeddings": False,
    }
    return T5Config(**(values | overrides))


def batch(cfg: T5Config, rows: int = 2) -> T5MicroBatch:
    """Padded rows in both stacks (the masks carry position biases and padding into every layer)."""
    g = torch.Generator().manual_seed(5)
    s, t, v = cfg.encoder_seq_length, cfg.decoder_seq_length, cfg.real_vocab_size
    enc_mask = (torch.arange(s) < torch.tensor([s, s - 5])[:rows, None]).long()
    dec_mask = (torch.arange(t) < torch.tensor([t, t - 3])[:rows, None]).long()
    enc = torch.randint(1, v, (rows, s), generator=g) * enc_mask
    dec = torch.randint(1, v, (rows, t), generator=g) * dec_mask
    labels = torch.randint(1, v, (rows, t), generator=g).masked_fill(dec_mask == 0, -1)
    return T5MicroBatch(enc, labels, dec_mask.float(), dec_tokens=dec, enc_mask=enc_mask, dec_mask=dec_mask)


def loss_and_grads(model: T5Model, b: T5MicroBatch, seed: int = 0) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)  # the dropout masks' stream
    model.zero_grad(set_to_none=True)
    loss = model.loss(b.tokens, b.dec_tokens, b.labels, b.loss_mask, b.enc_mask, b.dec_mask)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_set_recompute_marks_layers_per_stack() -> None:
    torch.manual_seed(0)
    model = T5Model(config())
    model.set_recompute("full", every=2)  # each stack counts its own layers from 0
    assert [layer.recompute for layer in model.encoder.layers] == [True, False, True]
    assert [layer.recompute for layer in model.decoder.layers] == [True, False]
    model.set_recompute("selective")
    assert not any(layer.recompute for layer in [*model.encoder.layers, *model.decoder.layers])
    assert all(layer.attn.recompute_core for layer in [*model.encoder.layers, *model.decoder.layers])
    assert all(layer.cross.recompute_core for layer in model.decoder.layers)
    model.set_recompute("none")
    assert not any(layer.attn.recompute_core for layer in model.encoder.layers)
    with pytest.raises(ValueError, match="not one of"):
        model.set_recompute("some")
    with pytest.raises(ValueError, match="every"):
        model.set_recompute("full", every=0)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_recompute_gives_the_same_loss_and_gradients(dropout: float) -> None:
    cfg = config(hidden_dropout=dropout, attention_dropout=dropout)
    torch.manual_seed(0)
    model = T5Model(cfg)
    b = batch(cfg)
    ref_loss, ref_grads = loss_and_grads(model, b)
    for mode, every in MODES[1:]:
        model.set_recompute(mode, every)
        loss, grads = loss_and_grads(model, b)
        assert loss == ref_loss, (mode, every)
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (mode, every, name)
    if dropout:  # the masks are really drawn: another stream, another loss
        assert loss_and_grads(model, b, seed=1)[0] != ref_loss


def test_recompute_in_pipeline_stages() -> None:
    """An encoder stage and a decoder stage (pp = 2, split 1), chained in one process: set_recompute
    marks the layers one process does (global indices) and the stages' gradients are unchanged."""
    cfg = config(hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(0)
    model = T5Model(cfg)
    enc_stage, dec_stage = (
        T5Stage(model, s, 2, layers) for s, layers in enumerate(t5_stage_layers(cfg, 2, 1))
    )
    b = batch(cfg)

    def grads() -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        memory = enc_stage(b.tokens, b.dec_tokens, b.enc_mask, b.dec_mask)
        logits = dec_stage(memory, b.dec_tokens, b.enc_mask, b.dec_mask)
        nn.functional.cross_entropy(logits.flatten(0, 1), b.labels.clamp(min=0).flatten()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = grads()
    for mode, every in MODES[1:]:
        for stage in (enc_stage, dec_stage):
            stage.set_recompute(mode, every)
        got = grads()
        for name, grad in got.items():
            assert torch.equal(grad, ref[name]), (mode, every, name)
    dec_stage.set_recompute("full", 2)
    assert [layer.recompute for layer in dec_stage.decoder.layers.values()] == [True, False]
    with pytest.raises(ValueError, match="not one of"):
        enc_stage.set_recompute("all")


def held_bytes(model: T5Model, b: T5MicroBatch) -> tuple[int, int]:
    """(bytes live once the loss is computed: what forward keeps for backward, the peak over forward
    and backward), counting every storage created in the step (the weights and their gradients'
    first allocation aside: gradients exist already)."""
    loss_and_grads(model, b)  # the gradients' storage, allocated before the measured step
    with LiveTensorBytes(ignore=[*model.parameters(), *(p.grad for p in model.parameters())]) as live:
        loss = model.loss(b.tokens, b.dec_tokens, b.labels, b.loss_mask, b.enc_mask, b.dec_mask)
        stored = live.current
        # set_to_none=False: backward accumulates into the existing gradients.
        loss.backward()
        peak = live.peak
    return stored, peak


def test_recompute_holds_less_for_backward() -> None:
    """Full recompute keeps each checkpointed layer's inputs only, selective drops the attention
    cores' (B, H, T, S) probabilities and dropout masks; both lower what a step holds at its peak.
    Measured (bytes held after forward): none 726k, selective 423k, full every 2 439k, full 110k
    (the embeddings' and the head's activations and the layers' (B, T, C) inputs)."""
    cfg = config(encoder_seq_length=32, decoder_seq_length=16, num_layers=2, attention_dropout=0.1)
    torch.manual_seed(0)
    model = T5Model(cfg)
    b = batch(cfg)
    measured = {}
    for mode, every in MODES:
        model.set_recompute(mode, every)
        measured[(mode, every)] = held_bytes(model, b)
    (none, none_peak), (sel, sel_peak) = measured[("none", 1)], measured[("selective", 1)]
    (full, full_peak), (half, _) = measured[("full", 1)], measured[("full", 2)]
    assert full < half < none and sel < none
    assert full < 0.25 * none  # only the layers' inputs (B, T, C) and the heads' activations remain
    assert full_peak < none_peak and sel_peak < none_peak


def _tp_rank(rank: int, world: int) -> dict[str, Any]:
    """One tp=2 rank under sequence parallelism with every dropout on: the loss and this rank's
    gradients for each recompute mode, each from the same weights and tracker seed."""
    from megatrain.engine.parallel.mappings import allreduce_sequence_parallel_grads
    from megatrain.engine.parallel.parallelize_t5 import parallelize_t5, t5_lm_loss
    from megatrain.engine.parallel.random import RNGStatesTracker
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.plan.layout import Layout

    cfg = config(hidden_dropout=0.2, attention_dropout=0.2)
    state = ParallelState.build(Layout(tp=2, sequence_parallel=True))
    b = batch(cfg)
    out: dict[str, Any] = {}
    for mode, every in MODES:
        torch.manual_seed(0)
        tracker = RNGStatesTracker.for_tensor_parallel(0, state)
        model = parallelize_t5(T5Model(cfg), state, rng_tracker=tracker)
        model.set_recompute(mode, every)
        logits = model(b.tokens, b.dec_tokens, b.enc_mask, b.dec_mask)  # (B, T, V/tp)
        loss = t5_lm_loss(logits, b.labels, b.loss_mask, state, cfg.real_vocab_size)
        loss.backward()
        allreduce_sequence_parallel_grads(model, state)
        out[f"{mode}/{every}"] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.distributed
def test_recompute_under_tensor_parallel_dropout() -> None:
    """tp = 2 with sequence parallelism: dropout on split tensors draws from the tracker's per-rank
    stream, which the recompute must replay (its checkpoint context) for the gradients to match."""
    from .parallel._launch import run_distributed

    for res in run_distributed(_tp_rank, 2, timeout=120):
        ref_loss, ref_grads = res["none/1"]
        for key, (loss, grads) in res.items():
            assert loss == ref_loss, key
            for name, grad in grads.items():
                assert torch.equal(grad, ref_grads[name]), (key, name)


def _engine_rank(rank: int, world: int, workdir: str) -> dict[str, list[dict[str, Any]]]:
    """Three steps of test_t5_train's T5 job (dropout on) per recompute setting; their metrics."""
    import os
    from pathlib import Path

    from megatrain.engine.train import run
    from megatrain.spec import parse_spec

    from .test_t5_train import _rows, t5_spec

    os.environ["MEGATRAIN_CACHE_DIR"] = str(Path(workdir) / "cache")
    out = {}
    for mode, every in (("none", 1), ("selective", 1), ("full", 2)):
        raw = t5_spec(train_iters=3, eval_interval=100, checkpoint_interval=100)
        raw["model"] |= {"hidden_dropout": 0.1, "attention_dropout": 0.1}
        raw["training"] |= {"recompute": mode, "recompute_every": every}
        folder = Path(workdir) / f"{mode}-{every}"
        run(parse_spec(raw), folder)
        out[f"{mode}/{every}"] = [r for r in _rows(folder) if "loss" in r]
    return out


def test_a_t5_job_trains_with_recompute(tmp_path: Any) -> None:
    """training.recompute through the engine (engine.build's make_trainable): the same losses and
    gradient norms as without it."""
    from .parallel._launch import run_distributed

    runs = run_distributed(_engine_rank, 1, str(tmp_path))[0]
    ref = runs["none/1"]
    assert len(ref) == 3
    for key, rows in runs.items():
        assert [r["loss"] for r in rows] == [r["loss"] for r in ref], key
        assert [r["grad_norm"] for r in rows] == [r["grad_norm"] for r in ref], key
