"""Expert-parallel test pieces: tiny MoE models, a plain-torch one-process reference, and the rank worker
that trains the same model under an (ep × tp × dp × pp) layout with the engine's DataParallel,
distributed optimizer and pipeline.

Both sides run every micro-batch as its own forward (the router's aux loss is per forward) and weight
the aux loss's gradient by the micro-batch's share (set_aux_loss_scale), so they optimise the same
objective. AdamW eps is 1e-6, as in the pipeline tests.

A freshly initialised router scores the experts almost equally (logits ~1e-2 apart), so the fp32
rounding by which a parallel run differs from one process (~1e-7) would flip top-k choices now and
then, and a flipped token moves the loss by ~1e-3. The router weights are therefore scaled up
(ROUTER_SPREAD) on both sides, so choices are decided by margins far above rounding.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatrain.engine.build import RankModel, Trainable, build_model
from megatrain.engine.checkpoint.sharded import save_state
from megatrain.engine.checkpoint.training import model_state, optimizer_state
from megatrain.engine.config import MoEConfig, TransformerConfig
from megatrain.engine.memtrack import LiveTensorBytes, tensors_of
from megatrain.engine.models.gpt import GPTModel, lm_loss
from megatrain.engine.models.moe import MoELayer, moe_layers, set_aux_loss_scale
from megatrain.engine.optimizer import MixedPrecisionOptimizer
from megatrain.engine.parallel import lanes
from megatrain.engine.parallel.data import DataParallel
from megatrain.engine.parallel.expert import (
    AllToAllDispatcher,
    all_to_all,
    gather_experts,
    parallelize_experts,
)
from megatrain.engine.parallel.expert_dedup import dedup_experts
from megatrain.engine.parallel.expert_overlap import overlap_experts
from megatrain.engine.parallel.mappings import is_expert_parallel
from megatrain.engine.parallel.parallelize import full_state_dict, load_full_state_dict
from megatrain.engine.parallel.pipeline import allreduce_tied_embedding_grads, pipeline_full_state_dict
from megatrain.engine.parallel.schedules import PipelineSchedule, pipeline_loss
from megatrain.engine.parallel.state import ParallelState
from megatrain.plan.layout import Layout
from megatrain.spec import parse_spec

MOE = MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=24, aux_loss_coeff=1e-2)
MODELS = {
    # Llama flavour: SwiGLU experts (fc1 is [gate; up]), no biases.
    "llama": TransformerConfig.preset("tiny-llama", moe=MOE),
    # GPT-2 flavour: GELU experts with stacked biases, a tied embedding.
    "gpt2": TransformerConfig.preset("tiny-gpt2", moe=MOE),
    "llama4": TransformerConfig.preset("tiny-llama", num_layers=4, moe=MOE),
}
ROUTER_SPREAD = 30.0
STACK_DIM = 16
"""The `stack` model: Linear -> MoE layer -> Linear on (B, T, 16) features, an MSE loss."""

DEFAULTS: dict[str, Any] = {
    "model": "llama",
    "seed": 1234,
    "steps": 10,
    "global_batch": 8,
    "micro_batch": 2,
    "lr": 1e-2,
    "weight_decay": 0.1,
    "clip_grad": 0.5,  # active in the early steps: the norm must count every expert once
    "eps": 1e-6,
    "tp": 1,
    "dp": 1,
    "pp": 1,
    "ep": 1,
    "schedule": "1f1b",
    "virtual_stages": 1,
    "overlap_chunks": 1,  # parallelism.moe_overlap_chunks
    "ep_ranks_per_node": None,  # parallelism.moe_dispatch nodes, the ep group in nodes of this many
    "lanes": False,  # parallelism.moe_overlap_microbatches (1F1B's steady pairs in lanes)
    "distributed_optimizer": False,
    "bucket_elements": 2000,
    "save_at": None,  # (url, step): save a checkpoint after that many steps
}


def options(**overrides: Any) -> dict[str, Any]:
    unknown = set(overrides) - set(DEFAULTS)
    assert not unknown, unknown
    return {**DEFAULTS, **overrides}


class Stack(nn.Module):
    """A lone MoE layer between two projections (no tensor-parallel layers, so any tp replicates it)."""

    def __init__(self) -> None:
        super().__init__()
        cfg = replace(MODELS["llama"], hidden_size=STACK_DIM)
        self.inp = nn.Linear(STACK_DIM, STACK_DIM)
        self.moe = MoELayer(cfg)
        self.out = nn.Linear(STACK_DIM, STACK_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x)))


def make_model(opts: dict[str, Any]) -> nn.Module:
    torch.manual_seed(opts["seed"])
    return spread_routers(Stack() if opts["model"] == "stack" else GPTModel(MODELS[opts["model"]]))


@torch.no_grad()
def spread_routers(model: nn.Module) -> nn.Module:
    for layer in moe_layers(model):
        layer.router.gate.weight.mul_(ROUTER_SPREAD)
    return model


def make_batch(opts: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step, the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(opts["seed"] * 1000 + step)
    if opts["model"] == "stack":
        x = torch.randn(opts["global_batch"], 8, STACK_DIM, generator=g)
        return x, torch.randn(x.shape, generator=g)
    cfg = MODELS[opts["model"]]
    tokens = torch.randint(0, cfg.vocab_size, (opts["global_batch"], cfg.seq_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(opts: dict[str, Any], out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y) if opts["model"] == "stack" else lm_loss(out, y)


def lr_at(opts: dict[str, Any], step: int) -> float:
    return opts["lr"] * (step + 1) / opts["steps"]


def micro_batches(
    opts: dict[str, Any], step: int, dp_rank: int = 0, dp: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = make_batch(opts, step)
    per_rank, mb = opts["global_batch"] // dp, opts["micro_batch"]
    lo = dp_rank * per_rank
    return [(x[lo + i : lo + i + mb], y[lo + i : lo + i + mb]) for i in range(0, per_rank, mb)]


def _canonical(model: nn.Module) -> dict[str, torch.Tensor]:
    tied = isinstance(model, GPTModel) and model.config.tie_embeddings
    return {
        n: t.detach().clone() for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")
    }


def reference_run(opts: dict[str, Any], stop: int | None = None) -> dict[str, Any]:
    """One process, torch's AdamW and clip_grad_norm_, every micro-batch of the global batch in turn;
    steps [0, stop or opts["steps"])."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: threads only contend with the ranks
    try:
        return _reference_run(opts, opts["steps"] if stop is None else stop)
    finally:
        torch.set_num_threads(threads)


def _reference_run(opts: dict[str, Any], stop: int) -> dict[str, Any]:
    model = make_model(opts)
    params = list(model.parameters())
    adam = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": opts["weight_decay"]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=opts["lr"],
        eps=opts["eps"],
        foreach=True,
    )
    losses, norms = [], []
    for step in range(stop):
        adam.zero_grad()
        batches = micro_batches(opts, step)
        set_aux_loss_scale(model, 1.0 / len(batches))
        total = 0.0
        for x, y in batches:
            loss = loss_of(opts, model(x), y) / len(batches)
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, opts["clip_grad"])))
        for group in adam.param_groups:
            group["lr"] = lr_at(opts, step)
        adam.step()
        losses.append(total)
    return {"losses": losses, "norms": norms, "params": _canonical(model)}


def rank_model(opts: dict[str, Any], state: ParallelState) -> RankModel:
    if opts["model"] == "stack":
        model = parallelize_experts(make_model(opts), state)
        return RankModel(model, [], None, 0, state)
    model = build_model(MODELS[opts["model"]], state, opts["seed"], "cpu")
    spread_routers(model.module)
    if opts["ep_ranks_per_node"] is None:
        overlap_experts(model.module, opts["overlap_chunks"])
    else:
        dedup_experts(model.module, state, opts["ep_ranks_per_node"], opts["overlap_chunks"])
    return model


def trainable(opts: dict[str, Any], state: ParallelState) -> Trainable:
    model = rank_model(opts, state)
    ddp = DataParallel(
        model.module,
        state,
        bucket_elements=opts["bucket_elements"],
        use_distributed_optimizer=opts["distributed_optimizer"],
    )
    opt = MixedPrecisionOptimizer(
        ddp,
        lr=opts["lr"],
        weight_decay=opts["weight_decay"],
        betas=(0.9, 0.999),
        eps=opts["eps"],
        clip_grad=opts["clip_grad"],
    )
    pipeline = None
    if model.chunks:
        cfg = MODELS[opts["model"]]
        shape = (opts["micro_batch"], cfg.seq_length, cfg.hidden_size)
        schedule = opts["schedule"]
        pipeline = PipelineSchedule(model.chunks, state, shape, torch.float32, schedule, lanes=opts["lanes"])
    return Trainable(model, ddp, opt, model.parameter_names(), pipeline, None)


def train_steps(
    opts: dict[str, Any], train: Trainable, start: int, stop: int
) -> tuple[list[float], list[float]]:
    """Steps [start, stop) on this rank; the dp-averaged losses and the grad norms."""
    state, ddp, opt = train.model.state, train.ddp, train.optimizer
    losses, norms = [], []
    for step in range(start, stop):
        batches = micro_batches(opts, step, state.dp_rank, state.dp_size)
        n = len(batches)
        set_aux_loss_scale(ddp, 1.0 / n)
        opt.zero_grad()
        if train.pipeline is not None:
            total = train.pipeline.forward_backward(
                batches,
                lambda logits, mb, n=n: lm_loss(logits, mb.labels) / n,
                scale_loss=opt.scale_loss,
                before_backward=lambda last: setattr(ddp, "is_last_microbatch", last),
            )
            loss = pipeline_loss(total, state)
        else:
            loss = torch.zeros(())
            for i, (x, y) in enumerate(batches):
                with ddp.no_sync() if i < n - 1 else contextlib.nullcontext():
                    part = loss_of(opts, ddp(x), y) / n
                    part.backward()
                loss += part.detach()
        ddp.finish_grad_sync()
        if train.model.chunks:
            allreduce_tied_embedding_grads(train.model.chunks, ddp, state)
        opt.set_lr(lr_at(opts, step))
        norms.append(opt.step().grad_norm)
        if state.dp_group is not None:
            dist.all_reduce(loss, group=state.dp_group)
        losses.append(float(loss) / state.dp_size)
    return losses, norms


def full_params(train: Trainable) -> dict[str, torch.Tensor] | None:
    """The single-device weights (experts gathered over ep) on global rank 0."""
    model, state = train.model, train.model.state
    if model.chunks:
        return pipeline_full_state_dict(model.chunks, state)
    if isinstance(model.module, GPTModel):
        full = full_state_dict(model.module, state)
    else:
        full = {}
        for name, p in model.module.state_dict(keep_vars=True).items():
            full[name] = gather_experts(p.detach(), state) if is_expert_parallel(p) else p.detach().clone()
    return full if state.rank == 0 else None


def ep_worker(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    layout = Layout(
        tp=opts["tp"],
        dp=opts["dp"],
        pp=opts["pp"],
        ep=opts["ep"],
        virtual_stages=opts["virtual_stages"],
        pipeline_schedule=opts["schedule"],
    )
    state = ParallelState.build(layout)
    train = trainable(opts, state)
    expert_bytes = sum(
        p.numel() * p.element_size() for p in train.model.module.parameters() if is_expert_parallel(p)
    )
    save_at = opts["save_at"]
    stop = save_at[1] if save_at else opts["steps"]
    turns = lanes.hand_overs
    losses, norms = train_steps(opts, train, 0, stop)
    if save_at:
        save(train, *save_at)
    params = full_params(train)
    return {"losses": losses, "norms": norms, "params": params, "expert_bytes": expert_bytes,
            "hand_overs": lanes.hand_overs - turns}  # fmt: skip


def save(train: Trainable, url: str, step: int) -> None:
    state = model_state(train.model)
    state.update(optimizer_state(train)[0])
    spec = parse_spec({"name": "ep", "data": {"train": [{"path": "file:///none.jsonl"}]}})
    plain = {
        "consumed_samples": 0,
        "optimizer_steps": train.optimizer.steps,
        "world_size": train.model.state.layout.world_size,
        "layout": train.model.state.layout.as_dict(),
    }
    save_state(url, step, state, plain, spec, distributed=True)


def all_workers(rank: int, world_size: int, runs: list[dict[str, Any] | str]) -> list[dict[str, Any]]:
    """Several layouts in one spawn (each builds its own groups on the same world); "exchange" runs
    exchange_worker."""
    out = []
    for opts in runs:
        out.append(
            exchange_worker(rank, world_size) if opts == "exchange" else ep_worker(rank, world_size, opts)
        )
        dist.barrier()
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max())


def _summed_expert_grads(full: MoELayer, group: Any, rank: int, size: int) -> dict[str, torch.Tensor]:
    """The full layer's expert weight gradients summed over the ep group, at this rank's experts:
    what expert parallelism must give each rank."""
    out = {}
    for name in ("fc1_weight", "fc2_weight"):
        ref = getattr(full.experts, name).grad.clone()
        dist.all_reduce(ref, group=group)
        n = ref.shape[0] // size
        out[name] = ref[rank * n : (rank + 1) * n]
    return out


def _wide_held(state: ParallelState) -> dict[str, float]:
    """Bytes a wider layer's forward leaves held for backward (hidden 64, 8 experts, 512 tokens:
    rows outweigh the chunks' row indices) by each dispatch, whole and in 2 chunks."""
    cfg = TransformerConfig.preset(
        "tiny-llama", hidden_size=64, moe=MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=128)
    )
    x = torch.randn(1, 512, 64, generator=torch.Generator().manual_seed(state.rank), requires_grad=True)
    out = {}
    for how in ("pairs", "overlap", "nodes1", "nodes1_overlap"):
        torch.manual_seed(0)
        layer = parallelize_experts(MoELayer(cfg), state)
        chunks = 2 if how.endswith("overlap") else 1
        if how.startswith("nodes"):
            dedup_experts(layer, state, 1, chunks)
        else:
            overlap_experts(layer, chunks)
        with LiveTensorBytes(tensors_of(layer, x)) as live:
            y = layer(x)
            time.sleep(0.05)  # (gloo's worker thread, as in compare below)
            out[f"wide_{how}_held"] = live.current - y.untyped_storage().nbytes()
        y.sum().backward()
    return out


def exchange_worker(rank: int, world_size: int) -> dict[str, float]:
    """The all-to-all Function and the dispatcher against references built from gathered tensors."""
    layout = Layout(dp=world_size, ep=world_size)
    state = ParallelState.build(layout)
    group, size = state.ep_group, state.ep_size
    errors: dict[str, float] = {}
    # Uneven (some empty) splits, the same table on every rank: splits[s][d] rows from s to d.
    g = torch.Generator().manual_seed(7)
    splits = torch.randint(0, 4, (size, size), generator=g).tolist()
    splits[0][1] = 0
    sent = [torch.randn(sum(splits[s]), 3, generator=g) for s in range(size)]
    upstream = [torch.randn(sum(splits[s][d] for s in range(size)), 3, generator=g) for d in range(size)]
    x = sent[rank].clone().requires_grad_()
    out = all_to_all(x, group, size, [splits[s][rank] for s in range(size)], splits[rank])
    chunks = [list(t.split(splits[s])) for s, t in enumerate(sent)]
    errors["a2a_forward"] = _max_diff(out, torch.cat([chunks[s][rank] for s in range(size)]))
    out.backward(upstream[rank])
    # Row block (me -> d) of my input receives d's upstream gradient for the rows that came from me.
    back = [list(upstream[d].split([splits[s][d] for s in range(size)])) for d in range(size)]
    expected = torch.cat([back[d][rank] for d in range(size)])
    errors["a2a_backward"] = float((x.grad - expected).abs().max())

    # One MoE layer (E=4: two local experts per rank, regrouped by expert) against the full layer on
    # the same tokens; the full layer's expert gradients summed over ranks are what ep gives.
    torch.manual_seed(3)
    full = Stack().moe
    torch.manual_seed(3)
    local = parallelize_experts(Stack(), state).moe  # the same weights, then this rank's experts
    tokens = torch.randn(5, 3, STACK_DIM, generator=torch.Generator().manual_seed(11 + rank))
    weight = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(21 + rank))
    xs = [tokens.clone().requires_grad_() for _ in range(2)]
    y_full, y_ep = full(xs[0]), local(xs[1])
    errors["layer_forward"] = _max_diff(y_full, y_ep)
    (y_full * weight).sum().backward()
    (y_ep * weight).sum().backward()
    errors["layer_input_grad"] = float((xs[0].grad - xs[1].grad).abs().max())
    errors["router_grad"] = float((full.router.gate.weight.grad - local.router.gate.weight.grad).abs().max())
    expert_refs = _summed_expert_grads(full, group, rank, size)
    for name, ref in expert_refs.items():
        errors[f"{name}_grad"] = _max_diff(ref, getattr(local.experts, name).grad)

    def compare(how: str, recompute: bool = False, offload: bool = False) -> None:
        """`local` as its dispatcher now is against the full layer: its output and gradients, and
        the bytes its forward leaves held for backward (beyond the output)."""
        local.zero_grad()
        x = tokens.clone().requires_grad_()
        hooks = torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext()
        calls = []
        counting = local.experts.register_forward_hook(lambda *_: calls.append(1))
        with LiveTensorBytes(tensors_of(local, x)) as live, hooks:
            y = checkpoint(local, x, use_reentrant=False) if recompute else local(x)
            time.sleep(0.05)  # gloo's worker thread lets go of an exchange's buffers after wait()
            errors[f"{how}_held"] = live.current - y.untyped_storage().nbytes()
        errors[f"{how}_layer_forward"] = _max_diff(y_full, y)
        (y * weight).sum().backward()
        counting.remove()
        errors[f"{how}_expert_calls"] = len(calls)  # forward, rerun and in backward
        errors[f"{how}_layer_input_grad"] = _max_diff(xs[0].grad, x.grad)
        errors[f"{how}_router_grad"] = _max_diff(full.router.gate.weight.grad, local.router.gate.weight.grad)
        for name, ref in expert_refs.items():
            got = getattr(local.experts, name).grad  # None where no row met this rank's experts
            errors[f"{how}_{name}_grad"] = _max_diff(ref, torch.zeros_like(ref) if got is None else got)

    # The same layer with the exchange pipelined in 3 token chunks (expert_overlap), plainly and
    # inside a recomputed (non-reentrant checkpoint) region as the engine's full recompute runs it.
    compare("pairs")
    compare("pairs_recompute", recompute=True)
    assert overlap_experts(local, 3) == 1
    compare("overlap")
    compare("overlap_recompute", recompute=True)
    compare("overlap_offload", offload=True)  # other saved-tensor hooks: the experts rerun in backward
    errors["overlap_rows"] = local.dispatcher.rows_sent + local.dispatcher.rows_received
    pairs_sent = local.dispatcher.rows_sent
    # The two-hop dispatch (expert_dedup) with the ep group cut into nodes of every size: each
    # token once per node, then once per rank, sums weighted where the experts are.
    for per_node in [d for d in range(1, size + 1) if size % d == 0]:
        how = f"nodes{per_node}"
        local.dispatcher = AllToAllDispatcher.for_state(MOE.num_experts, state)
        assert dedup_experts(local, state, per_node) == 1
        compare(how)
        errors[f"{how}_rows_saved"] = pairs_sent - local.dispatcher.rows_sent
        errors[f"{how}_off_node"] = local.dispatcher.rows_sent_off_node
        if per_node < size:  # more than one node: hop 1 pipelined in 3 token chunks
            local.dispatcher = AllToAllDispatcher.for_state(MOE.num_experts, state)
            assert dedup_experts(local, state, per_node, chunks=3) == 1
            compare(f"{how}_overlap")
            errors[f"{how}_overlap_off_node"] = local.dispatcher.rows_sent_off_node
            compare(f"{how}_overlap_recompute", recompute=True)
            compare(f"{how}_overlap_offload", offload=True)

    errors.update(_wide_held(state))

    # Every token routed to rank 0's two experts: rank 1's get no rows, yet its backward must still
    # post the reverse exchanges (an empty expert output stays tied to its input), under each way.
    direction = torch.randn(STACK_DIM, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for layer in (full, local):
            layer.router.gate.weight.copy_(torch.stack([direction, direction, -direction, -direction]) * 10)
    noise = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(31 + rank))
    tokens = direction.expand_as(tokens) + 0.01 * noise
    xs = [tokens.clone().requires_grad_()]
    full.zero_grad()
    y_full = full(xs[0])
    (y_full * weight).sum().backward()
    expert_refs = _summed_expert_grads(full, group, rank, size)
    for how, swap in (
        ("starved_pairs", lambda: None),
        ("starved_overlap", lambda: overlap_experts(local, 3)),
        ("starved_nodes1", lambda: dedup_experts(local, state, 1)),
        ("starved_nodes1_overlap", lambda: dedup_experts(local, state, 1, chunks=3)),
    ):
        local.dispatcher = AllToAllDispatcher.for_state(MOE.num_experts, state)
        swap()
        compare(how)
        if how == "starved_pairs":  # rows that reached this rank's experts from the other rank
            errors["starved_received"] = local.dispatcher.rows_received

    # Full weights in (each rank keeps its experts' rows) and out again (gathered over ep).
    model = build_model(MODELS["llama"], state, 5, "cpu").module
    full = {k: torch.randn(v.shape, generator=g) for k, v in full_state_dict(model, state).items()}
    load_full_state_dict(model, full, state)
    mine, n = model.layers[0].mlp.experts.fc2_weight, MOE.num_experts // size
    errors["load_slice"] = _max_diff(mine, full["layers.0.mlp.experts.fc2_weight"][rank * n : (rank + 1) * n])
    errors["round_trip"] = max(_max_diff(t, full[k]) for k, t in full_state_dict(model, state).items())
    return errors
