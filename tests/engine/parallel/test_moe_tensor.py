"""parallel.moe_tensor on one MoE layer, GELU with biases (fc2's bias taken 1/tp on each rank) and a
shared expert, with and without sequence parallelism: output and every gradient (shards gathered,
replicated gradients summed over tp) equal one process's, aux and z losses included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatrain.engine.config import MoEConfig, TransformerConfig
from megatrain.engine.models.moe import MoELayer

from ._launch import run_distributed

CFG = TransformerConfig.preset(
    "tiny-gpt2",
    moe=MoEConfig(
        num_experts=4,
        router_topk=2,
        ffn_hidden_size=16,
        shared_expert_ffn_hidden_size=8,
        aux_loss_coeff=0.1,
        z_loss_coeff=0.01,
        capacity_factor=1.5,
    ),
)


def single() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The layer on one process: output, parameter gradients and the input's gradient."""
    torch.manual_seed(0)
    layer = MoELayer(CFG)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = layer(x)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * upstream).sum().backward()
    assert x.grad is not None
    return y.detach(), {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}, x.grad


def _rank(rank: int, world: int) -> dict[str, Any]:
    from megatrain.engine.parallel.mappings import (
        allreduce_sequence_parallel_grads,
        gather_shards,
        is_tensor_parallel,
        scatter_to_sequence,
    )
    from megatrain.engine.parallel.moe_tensor import parallelize_moe_layer
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.plan.layout import Layout

    out: dict[str, Any] = {}
    for sp in (False, True):
        state = ParallelState.build(Layout(tp=world, sequence_parallel=sp))
        torch.manual_seed(0)
        layer = MoELayer(CFG)
        parallelize_moe_layer(layer, state, swiglu=False)
        full_x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
        x = full_x.clone().requires_grad_()
        inp = scatter_to_sequence(x, state.tp_group, world) if sp else x  # (B, T/tp, C) under sp
        y = layer(inp)
        upstream = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
        if sp:
            upstream = upstream.chunk(world, dim=1)[rank]
        (y * upstream).sum().backward()
        allreduce_sequence_parallel_grads(layer, state)
        grads = {}
        for n, p in layer.named_parameters():
            g = p.grad
            if is_tensor_parallel(p):
                g = gather_shards(g, p.partition_dim, p.partition_stride, state.tp_group, world)
            grads[n] = g
        if sp:  # every rank's sequence shard of the output, in order
            y = torch.cat(list(_gather(y, state).unbind(0)), dim=1)
        out["sp" if sp else "tp"] = {"y": y.detach(), "grads": grads, "x_grad": x.grad}
    return out


def _gather(y: torch.Tensor, state: Any) -> torch.Tensor:
    parts = [torch.empty_like(y) for _ in range(state.tp_size)]
    torch.distributed.all_gather(parts, y.detach().contiguous(), group=state.tp_group)
    return torch.stack(parts)


@pytest.mark.distributed
def test_tensor_parallel_moe_layer_matches_one_process() -> None:
    y_ref, grads_ref, x_grad_ref = single()
    assert {"experts.fc2_bias", "router.gate.weight", "shared_expert.fc2.bias"} <= set(grads_ref)
    results = run_distributed(_rank, 2)
    for rank, res in enumerate(results):
        for mode in ("tp", "sp"):
            got = res[mode]
            torch.testing.assert_close(got["y"], y_ref, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {mode}")
            torch.testing.assert_close(got["x_grad"], x_grad_ref, rtol=1e-5, atol=1e-6)
            assert got["grads"].keys() == grads_ref.keys()
            for n, g in grads_ref.items():
                torch.testing.assert_close(got["grads"][n], g, rtol=1e-5, atol=1e-6, msg=f"{rank} {mode} {n}")
