"""Shared pieces of the tensor-parallel tests: tiny configs, data, building and training a model.

RTOL / ATOL: see test_parallelize.py's docstring.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.parallel.mappings import allreduce_sequence_parallel_grads
from megatrain.engine.parallel.parallelize import parallel_lm_loss, parallelize_model
from megatrain.engine.parallel.random import RNGStatesTracker
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout

SEED = 1234
STEPS = 10
RTOL, ATOL = 1e-4, 1e-5  # see test_parallelize.py


def make_config(flavour: str, **overrides: object) -> TransformerConfig:
    if flavour == "gpt2":
        cfg = TransformerConfig.preset("tiny-gpt2")
    else:
        cfg = TransformerConfig.preset(
            "tiny-llama", hidden_size=64, num_attention_heads=8, num_query_groups=4
        )
    return replace(cfg, **overrides)


def batches(cfg: TransformerConfig, steps: int, batch: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Own generator: data never consumes the default stream that init and dropout use. Sequences follow
    # a fixed successor rule (next = 5·tok + 3 mod V) so that 10 steps visibly lower the loss.
    gen = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        tok = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
        seq = [tok]
        for _ in range(cfg.seq_length):
            seq.append((5 * seq[-1] + 3) % cfg.vocab_size)
        seq = torch.cat(seq, dim=1)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def build(
    cfg: TransformerConfig, state: ParallelState, recompute: tuple[str, int] = ("none", 1)
) -> tuple[GPTModel, RNGStatesTracker | None]:
    torch.manual_seed(SEED)
    model = GPTModel(cfg)  # the full model, identical on every rank, then sliced
    tracker = RNGStatesTracker.for_tensor_parallel(SEED, state) if state.tp_size > 1 else None
    model = parallelize_model(model, state, rng_tracker=tracker)
    model.set_recompute(*recompute)
    return model, tracker


def train(cfg: TransformerConfig, state: ParallelState, steps: int = STEPS) -> tuple[list[float], GPTModel]:
    model, _ = build(cfg, state)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.1)
    losses = []
    for x, y in batches(cfg, steps):
        loss = parallel_lm_loss(model(x), y, state)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        allreduce_sequence_parallel_grads(model, state)
        opt.step()
        losses.append(loss.item())
    return losses, model


def tp_state(tp: int, sp: bool = False) -> ParallelState:
    return ParallelState.build(Layout(tp=tp, sequence_parallel=sp))


def fake_state(tp: int, rank: int, sp: bool = False) -> ParallelState:
    """A tp layout's state for one rank without process groups: only for code that slices, never
    for a collective."""
    groups = {d: None for d in ("tp", "cp", "dp", "pp", "mp")}
    return ParallelState(Layout(tp=tp, sequence_parallel=sp), rank, torch.device("cpu"), groups)
