"""LoRA (Hu et al. 2021): a frozen base linear W plus a trained low-rank update, y = x Wᵀ + s·(x Aᵀ) Bᵀ.

A is (r, in), B (out, r), s = alpha / r (alpha / √r with rsLoRA); B starts at zero, so a run starts
from the base model exactly, and A from PEFT's default (kaiming-uniform, bound 1/√in). Adapters are
attached to the canonical linears (`qkv`, `proj`, `fc1`, `fc2` of every layer) after tensor
parallelism has replaced them, on the meta device, and are materialised with the rest of the rank's
shards (their initial values, like every parameter's, are a pure function of seed and name: any
layout starts from the same adapter). Everything else is frozen: no gradient, no gradient buffer,
no optimizer state.

Under tensor parallelism each adapter is split like its base weight, so the base's own collectives
carry it and no activation of the base's width is communicated again:

- column-parallel base (W split over its output rows): B is split the same way, A is replicated.
  The update is added on the same (copied) input as the base, so its input gradient joins the
  base's in the one reduction Megatron already does. With sequence parallelism the input is a
  sequence shard: the adapter multiplies the shard by A and all-gathers the rank-r product (r/in of
  the base's gather), reduce-scattering its gradient back.
- row-parallel base (W split over its input columns): A is split the same way, B is replicated. The
  update joins the base's partial sums before their all-reduce (or reduce-scatter).

The replicated factor then sees only part of the gradient on each tp rank (the other tokens, or the
other output rows' contributions): it is flagged like a sequence-parallel norm weight, and its
gradient is summed over tp once per step (parallel.mappings.allreduce_sequence_parallel_grads).

An MoE layer's shared expert is a dense MLP: its fc1 and fc2 are targets like the dense MLP's. Its
routed experts (target `experts`) get an adapter per expert on each stacked weight (ExpertLoRA):
PEFT's adapters on transformers' stacked expert tensors (`target_parameters`), one over an expert's
[gate; up] rows, with no dropout. They are split as their weights are: over ep by expert, over tp
like fc1 (column: B split) and fc2 (row: A split).
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from megatrain import kernels
from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.parallel.mappings import (
    gather_from_sequence,
    mark_sequence_parallel,
    mark_tensor_parallel,
    shard_tensor,
)
from megatrain.engine.parallel.random import MODEL_PARALLEL, RNGStatesTracker, TrackedDropout
from megatrain.engine.parallel.state import ParallelState

TARGETS = ("qkv", "proj", "fc1", "fc2", "experts")
"""What an adapter may sit on, by canonical name: attn.qkv, attn.proj, mlp.fc1 and mlp.fc2 (the dense
MLP's or the shared expert's), and an MoE layer's routed experts (both stacked weights)."""


class LoRA(nn.Module):
    """The adapter of one linear: A (parts·r, in shard), B (out shard, r), and its dropout.

    A fused linear whose Hugging Face twin is several linears (Llama's q/k/v in our qkv, gate/up in
    a gated fc1) has one adapter per part, as PEFT puts one on each: A stacks the parts' A's, and
    output row o takes its update from its own part's r columns only (`part_of_row`). So training
    here is PEFT's training, and an adapter exports to PEFT's names exactly."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        cfg: LoRAConfig,
        dropout: nn.Module,
        part_of_row: torch.Tensor | None = None,
    ):
        super().__init__()
        self.parts = 1 if part_of_row is None else int(part_of_row.max()) + 1
        self.A = nn.Parameter(torch.empty(self.parts * cfg.rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, cfg.rank))
        self.scale = cfg.scale
        self.dropout = dropout
        # (out shard, parts) one-hot on the CPU; not a buffer (the meta build materialises
        # parameters only), moved to the input's device on first use.
        self._onehot = None if part_of_row is None else F.one_hot(part_of_row, self.parts)
        self.gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Sequence parallelism on a column-parallel base: all-gathers x Aᵀ along the sequence."""
        self.enabled = True
        """False: the linear runs as its base alone (adapters_disabled: DPO's reference model)."""

    def expanded_B(self) -> torch.Tensor:
        """B as (out, parts·r): row o's r values in its part's columns, zeros elsewhere."""
        if self._onehot is None:
            return self.B
        if self._onehot.device != self.B.device or self._onehot.dtype != self.B.dtype:
            self._onehot = self._onehot.to(self.B.device, self.B.dtype)
        return expand_B(self.B, self._onehot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = kernels.get("linear", x.device.type)
        u = linear(self.dropout(x), self.A)  # (.., parts·r)
        if self.gather is not None:
            u = self.gather(u)
        return linear(u, self.expanded_B()) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.B.shape[1]}, parts={self.parts}, scale={self.scale:g}"


def expand_B(b: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    """B (out, r) and its rows' parts one-hot (out, parts) -> (out, parts·r)."""
    return (onehot[:, :, None] * b[:, None, :]).flatten(1)


class ExpertLoRA(nn.Module):
    """The adapters of E stacked experts (GroupedExperts' fc1_weight (E, W, C) and fc2_weight
    (E, C, F)): fc1_A (E, r, C), fc1_B (E, W, r), fc2_A (E, r, F), fc2_B (E, C, r); expert e's fc1
    is W_e + scale·B_e·A_e, likewise fc2. GroupedExperts runs them (kernels.grouped_mlp_lora)."""

    def __init__(self, fc1_shape: torch.Size, fc2_shape: torch.Size, cfg: LoRAConfig):
        super().__init__()
        (e, w, c), (_, _, f), r = fc1_shape, fc2_shape, cfg.rank
        self.fc1_A = nn.Parameter(torch.empty(e, r, c))
        self.fc1_B = nn.Parameter(torch.empty(e, w, r))
        self.fc2_A = nn.Parameter(torch.empty(e, r, f))
        self.fc2_B = nn.Parameter(torch.empty(e, c, r))
        self.scale = cfg.scale
        self.enabled = True

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.fc1_A, self.fc1_B, self.fc2_A, self.fc2_B

    def extra_repr(self) -> str:
        return f"experts={self.fc1_A.shape[0]}, rank={self.fc1_A.shape[1]}, scale={self.scale:g}"


EXPERT_WEIGHT_ADAPTERS = {"fc1_weight": "fc1", "fc2_weight": "fc2"}
"""A stacked expert weight -> its adapters' prefix in ExpertLoRA (`experts.lora.fc1_A`, ...)."""


def adapted_target(weight_name: str, cfg: LoRAConfig) -> str | None:
    """The target a canonical weight's adapter sits on ("layers.3.attn.qkv.weight" -> "qkv",
    "layers.1.mlp.shared_expert.fc1.weight" -> "fc1", "layers.1.mlp.experts.fc2_weight" -> "experts"),
    if any."""
    parts = weight_name.split(".")
    if len(parts) < 5 or parts[0] != "layers":
        return None
    if len(parts) == 5 and parts[2:4] == ["mlp", "experts"] and parts[4] in EXPERT_WEIGHT_ADAPTERS:
        return "experts" if "experts" in cfg.targets else None
    inner = parts[2:-2] in (["attn"], ["mlp"], ["mlp", "shared_expert"])
    if inner and parts[-1] == "weight" and parts[-2] in cfg.targets and parts[-2] != "experts":
        return parts[-2]
    return None


@torch.no_grad()
def merged_weight(
    weight_name: str,
    weight: torch.Tensor,
    get_tensor: Callable[[str], torch.Tensor],
    mcfg: TransformerConfig,
    cfg: LoRAConfig,
) -> torch.Tensor:
    """A full base weight with its adapter folded in, W + scale·B̃·A (PEFT's merge_and_unload), in
    fp32 and returned in the weight's dtype; any other tensor as it is. get_tensor(name) reads the
    full adapter tensors."""
    target = adapted_target(weight_name, cfg)
    if target is None:
        return weight
    w = weight.float()
    if target == "experts":
        base, stacked = weight_name.rsplit(".", 1)
        prefix = f"{base}.lora.{EXPERT_WEIGHT_ADAPTERS[stacked]}"
        a, b = get_tensor(prefix + "_A").float(), get_tensor(prefix + "_B").float()
        if a.shape != (w.shape[0], cfg.rank, w.shape[2]) or b.shape != (*w.shape[:2], cfg.rank):
            raise ValueError(
                f"{prefix}: adapters A {tuple(a.shape)}, B {tuple(b.shape)} do not fit stacked "
                f"experts of {tuple(w.shape)} with rank {cfg.rank}"
            )
        return (w + cfg.scale * torch.bmm(b, a)).to(weight.dtype)
    base = weight_name.removesuffix(".weight")
    a, b = get_tensor(base + ".lora.A").float(), get_tensor(base + ".lora.B").float()
    part = part_of_rows(target, mcfg, ffn=w.shape[0] // 2)
    n = 1 if part is None else int(part.max()) + 1
    if a.shape != (n * cfg.rank, w.shape[1]) or b.shape != (w.shape[0], cfg.rank):
        raise ValueError(
            f"{base}: adapters A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a weight of "
            f"{tuple(w.shape)} with rank {cfg.rank} over {n} part(s)"
        )
    if part is None:
        return (w + cfg.scale * (b @ a)).to(weight.dtype)
    # Row o of the update uses only its part's r rows of A: part by part, no (out, parts·r) B̃.
    delta = torch.empty_like(w)
    for p, a_p in enumerate(a.chunk(n)):
        rows = part == p
        delta[rows] = b[rows] @ a_p
    return (w + cfg.scale * delta).to(weight.dtype)


def part_of_rows(target: str, mcfg: TransformerConfig, ffn: int | None = None) -> torch.Tensor | None:
    """Which Hugging Face linear each canonical output row of a fused target belongs to: qkv's
    q/k/v (group by group: H/G query heads, then the group's key and value), a gated fc1's
    gate/up (each `ffn` rows: the dense MLP's width unless given, a shared expert's). None where
    the Hugging Face twin is one linear too (GPT-2's c_attn, proj, fc2)."""
    if target == "qkv" and mcfg.position_embedding != "learned":
        per_group = mcfg.num_attention_heads // mcfg.num_query_groups
        group = torch.tensor([0] * per_group + [1, 2]).repeat_interleave(mcfg.head_dim)
        return group.repeat(mcfg.num_query_groups)
    if target == "fc1" and mcfg.gated_mlp:
        return torch.tensor([0, 1]).repeat_interleave(ffn or mcfg.ffn_hidden_size)
    return None


def lora_targets(model: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[str, nn.Module]]:
    """(canonical name, linear) of every linear an adapter goes on: attention's, the dense MLP's and
    the shared experts' linears named in `targets` (the routed experts: attach_lora)."""
    for name, mod in model.named_modules():
        parts = name.split(".")
        linear = parts[-1] in targets and parts[-1] != "experts"
        if len(parts) >= 2 and linear and parts[-2] in ("attn", "mlp", "shared_expert"):
            yield name, mod


def attach_lora(
    model: nn.Module,
    cfg: LoRAConfig,
    mcfg: TransformerConfig,
    state: ParallelState,
    tracker: RNGStatesTracker | None,
) -> int:
    """Freeze `model` and give each target linear (single-device, column- or row-parallel) a `lora`
    adapter split like its weight; returns how many were attached. Call on the meta device, after
    tensor parallelism, before the pipeline split (names are canonical here)."""
    from megatrain.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear

    for p in model.parameters():
        p.requires_grad_(False)
    tp = state.tp_size > 1
    count = 0
    for name, linear in list(lora_targets(model, cfg.targets)):
        weight = linear.weight
        out_local, in_local = weight.shape
        stride = getattr(weight, "partition_stride", 1)
        ffn = mcfg.moe.shared_expert_ffn_hidden_size if ".shared_expert." in name and mcfg.moe else None
        parts = part_of_rows(name.rsplit(".", 1)[-1], mcfg, ffn)
        if parts is not None and isinstance(linear, ColumnParallelLinear):
            parts = shard_tensor(parts, 0, state.tp_rank, state.tp_size, stride)
        # Per-rank dropout masks where tp ranks hold different inputs (a row-parallel base's feature
        # slice, a sequence shard); the same mask where they hold the same input.
        split_input = isinstance(linear, RowParallelLinear) or getattr(linear, "sequence_parallel", False)
        drop: nn.Module = nn.Dropout(cfg.dropout)
        if tp and tracker is not None and split_input:
            drop = TrackedDropout(cfg.dropout, tracker, MODEL_PARALLEL)
        with torch.device(weight.device):
            lora = LoRA(in_local, out_local, cfg, drop, parts)
        if isinstance(linear, ColumnParallelLinear):
            mark_tensor_parallel(lora.B, 0, stride)
            if tp:
                mark_sequence_parallel(lora.A)
            if linear.sequence_parallel and tp:
                group, size = linear.tp_group, linear.tp_size
                lora.gather = lambda u, g=group, n=size: gather_from_sequence(u, g, n)
        elif isinstance(linear, RowParallelLinear):
            mark_tensor_parallel(lora.A, 1)
            if tp:
                mark_sequence_parallel(lora.B)
        elif tp:
            raise ValueError(f"{name}: a LoRA target that tensor parallelism did not split")
        linear.lora = lora
        count += 1
    if "experts" in cfg.targets:
        count += _attach_expert_lora(model, cfg, state)
    if count == 0:
        raise ValueError(f"LoRA: the model has none of the target linears {', '.join(cfg.targets)}")
    return count


def _attach_expert_lora(model: nn.Module, cfg: LoRAConfig, state: ParallelState) -> int:
    """An ExpertLoRA on every MoE layer's routed experts, split over tp like their weights (fc1 rows
    with its stride, fc2 columns; expert parallelism then keeps this rank's experts of both)."""
    from megatrain.engine.models.moe import moe_layers

    count = 0
    for layer in moe_layers(model):
        experts = layer.experts
        w1, w2 = experts.fc1_weight, experts.fc2_weight
        with torch.device(w1.device):
            lora = ExpertLoRA(w1.shape, w2.shape, cfg)
        if state.tp_size > 1:
            mark_tensor_parallel(lora.fc1_B, 1, getattr(w1, "partition_stride", 1))
            mark_tensor_parallel(lora.fc2_A, 2)
            mark_sequence_parallel(lora.fc1_A)  # replicated: each tp rank sees part of its gradient
            mark_sequence_parallel(lora.fc2_B)
        experts.lora = lora
        count += 1
    return count


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """The base model without its adapters, for the duration: the reference model of preference
    training under LoRA, with no second copy of the weights."""
    adapters = [m for m in module.modules() if isinstance(m, LoRA | ExpertLoRA)]
    for m in adapters:
        m.enabled = False
    try:
        yield
    finally:
        for m in adapters:
            m.enabled = True


NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
"""QLoRA's NF4 blocks (torchao's and bitsandbytes' defaults): one absmax scale per 64 weights, the
scales themselves quantised to int8 per 256 blocks."""
QUANTIZED = re.compile(r"layers\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)\.weight")
"""The base weights QLoRA holds in NF4: every dense layer's linears (norms, embeddings, the LM head,
MoE experts and routers stay in the training dtype)."""


def quantize_nf4(name: str, weight: torch.Tensor) -> torch.Tensor:
    """A frozen base weight in NF4 (dequantised per GEMM by torchao's F.linear override), where it
    is one of QUANTIZED and its shard's size is whole scaler blocks (16,384 weights); as it is
    otherwise. The shard is quantised on its own: layouts differ within NF4's rounding."""
    if not QUANTIZED.fullmatch(name) or weight.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK):
        return weight
    from torchao.quantization import NF4Tensor

    return NF4Tensor.from_tensor(weight, NF4_BLOCK, NF4_SCALER_BLOCK)


def is_lora_name(name: str) -> bool:
    return ".lora." in name


def lora_init_rule(name: str, in_features: int) -> tuple[str, float]:
    """PEFT's defaults: A kaiming-uniform with a=√5 (uniform in ±1/√in), B zeros."""
    if name.endswith(("lora.A", "_A")):
        return "uniform", 1.0 / math.sqrt(in_features)
    return "zeros", 0.0


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts of this rank's module."""
    params = list({id(p): p for p in model.parameters()}.values())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
