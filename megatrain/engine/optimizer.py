"""Mixed-precision AdamW over a DataParallel gradient buffer, optionally sharded over dp (ZeRO-1).

Megatron's MixedPrecisionOptimizer / DistributedOptimizer in one class:

- fp32 main parameters: a copy of each model parameter (bf16/fp16), or the parameter itself for fp32.
  Their gradients are views of the fp32 `main_grad` buffer, so nothing is copied per step.
- With `DataParallel(use_distributed_optimizer=True)` this rank keeps main parameters and Adam state
  only for its contiguous shard of each gradient bucket (a parameter straddling a shard boundary is
  updated piecewise by two ranks); after the update the shards are all-gathered into the parameters.
- fp16: the caller multiplies the loss by `loss_scale`; step() unscales, checks for inf/nan on every
  rank (dp and model-parallel groups), skips the step everywhere if any, and lets the
  DynamicLossScaler back off or grow. bf16 and fp32 use no scaling and never skip.
- The gradient norm is global over tp, pp and dp (see `global_grad_norm`), then clipped; an
  expert-parallel parameter (parallel.expert) counts once: its squares are summed over ep too, and its
  state is sharded over edp (DataParallel's expert buckets), not dp.

Per step, in this order:
    optimizer.zero_grad()                                # zeroes the DataParallel buffer
    for i, (x, y) in enumerate(micro_batches):           # every rank, its own micro-batches
        with ddp.no_sync() if i < n - 1 else nullcontext():
            loss = loss_fn(ddp(x), y) / n
            optimizer.scale_loss(loss).backward()
    ddp.finish_grad_sync()
    ... model-parallel gradient all-reduces (sequence-parallel norms over tp, tied embeddings over pp)
    optimizer.set_lr(lr)
    result = optimizer.step()                            # StepResult(grad_norm, skipped, loss_scale)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatrain.engine.config import TrainConfig
from megatrain.engine.parallel.data import DataParallel, OwnedSlice
from megatrain.engine.parallel.mappings import is_expert_parallel
from megatrain.engine.parallel.state import Group, ParallelState


@dataclass(frozen=True)
class StepResult:
    grad_norm: float
    """Global gradient norm before clipping; nan when the step was skipped."""
    skipped: bool
    loss_scale: float | None
    """The fp16 loss scale for the next step (after this step's update); None for bf16/fp32."""


class DynamicLossScaler:
    """Megatron's dynamic loss scale for fp16.

    On inf/nan gradients the step is skipped; after `hysteresis` such steps (not necessarily in a
    row) the scale is multiplied by `backoff_factor` (never below `min_scale`). After
    `growth_interval` clean steps in a row it is multiplied by `growth_factor` and the hysteresis
    budget is restored.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
    ):
        if not (0.0 < backoff_factor < 1.0 < growth_factor):
            raise ValueError("need 0 < backoff_factor < 1 < growth_factor")
        if min_scale <= 0 or initial_scale < min_scale:
            raise ValueError("need 0 < min_scale <= initial_scale")
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.backoff_factor = backoff_factor
        self.growth_factor = growth_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])


def _all_reduce(t: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
    if group is not None:  # None means size 1 here, never WORLD
        dist.all_reduce(t, op=op, group=group)


def _sum_of_squares(
    grads_with_flags: Iterable[tuple[torch.Tensor, bool]], state: ParallelState
) -> torch.Tensor:
    tp_rank = state.tp_rank
    counted = [g for g, tensor_parallel in grads_with_flags if tensor_parallel or tp_rank == 0]
    device = counted[0].device if counted else state.device
    if not counted:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in counted])
    return torch.stack(norms).pow(2).sum()


def global_grad_norm(
    grads_with_flags: Iterable[tuple[torch.Tensor, bool]],
    state: ParallelState,
    *,
    shard_group: Group = None,
    expert_grads_with_flags: Iterable[tuple[torch.Tensor, bool]] = (),
    expert_shard_group: Group = None,
) -> float:
    """L2 norm of the whole model's gradient, computed on every rank.

    Each pair is (grad, tensor_parallel). A tensor-parallel grad is a distinct shard on every tp rank
    and counts on each; a replicated one has the same value on every tp rank and counts on tp rank 0
    only. Squares are summed over the model-parallel group (tp×pp: each pipeline stage holds other
    layers) and, when each rank holds only a shard of the grads (distributed optimizer), over
    `shard_group` (the dp group) too. Expert-parallel grads (each ep rank holds other experts) are
    summed over ep, and over `expert_shard_group` (edp) when sharded, before joining the rest.
    """
    total = _sum_of_squares(grads_with_flags, state)
    _all_reduce(total, shard_group)
    expert = list(expert_grads_with_flags)
    if state.layout.ep > 1:
        # Every rank takes part (the same collectives everywhere), with or without expert grads.
        experts = _sum_of_squares(expert, state).to(total.device)
        _all_reduce(experts, expert_shard_group)
        _all_reduce(experts, state.ep_group)
        total = total + experts
    elif expert:
        total = total + _sum_of_squares(expert, state).to(total.device)
    _all_reduce(total, state.group("mp"))
    return float(total.sqrt())


def clip_grad_norm(
    grads_with_flags: Sequence[tuple[torch.Tensor, bool]],
    max_norm: float,
    state: ParallelState,
    *,
    shard_group: Group = None,
) -> float:
    """Scale every grad in place so the global norm is at most max_norm; returns the norm before.

    Same coefficient as torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), applied only if < 1.
    A non-finite norm is returned as is and nothing is scaled.
    """
    norm = global_grad_norm(grads_with_flags, state, shard_group=shard_group)
    if max_norm > 0 and math.isfinite(norm):
        coeff = max_norm / (norm + 1e-6)
        if coeff < 1.0:
            torch._foreach_mul_([g for g, _ in grads_with_flags], coeff)
    return norm


class MixedPrecisionOptimizer:
    """AdamW on fp32 main parameters built from `ddp`'s buffer; sharded with the distributed optimizer.

    The learning rate is set by the caller every step (`set_lr`). Weight decay applies to ≥2-D
    parameters only (biases and norm weights get none), as in Megatron.
    """

    def __init__(
        self,
        ddp: DataParallel,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        loss_scaler: DynamicLossScaler | None = None,
    ):
        self.ddp = ddp
        self.state: ParallelState = ddp.state
        self.distributed = ddp.use_distributed_optimizer
        self.clip_grad = clip_grad
        self.scaler = loss_scaler
        self.steps = 0
        """Optimizer steps taken (skipped ones excluded): Adam's bias-correction step."""
        # fp16 gradients must be unscaled anyway, and fp32 main params are what AdamW should update.
        slices = ddp.owned_slices()
        self._slices: list[OwnedSlice] = []
        self._mains: list[torch.Tensor] = []
        self._aliased: list[bool] = []
        decay: list[torch.Tensor] = []
        no_decay: list[torch.Tensor] = []
        for sl in sorted(slices, key=lambda s: s.param.ndim < 2):  # decay group first, stable order
            main, aliased = self._make_main(sl)
            self._slices.append(sl)
            self._mains.append(main)
            self._aliased.append(aliased)
            (decay if sl.param.ndim >= 2 else no_decay).append(main)
        device = ddp.grad_buffer.device
        # Fused AdamW: one pass per tensor instead of foreach's dozen; on CPU it measured 11x faster
        # than foreach (benchmarks/engine_cpu.py's Llama shape, torch 2.13).
        impl = {"fused": True} if device.type in ("cuda", "cpu") else {"foreach": True}
        # Both groups always exist (possibly empty: a dp rank may own no 1-D parameter), so
        # param-group indices are the same on every rank.
        self.adam = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr,
            betas=betas,
            eps=eps,
            **impl,
        )

    def _make_main(self, sl: OwnedSlice) -> tuple[torch.Tensor, bool]:
        p = sl.param.detach()  # shares storage with the model parameter
        view = p if (sl.whole and not self.distributed) else p.reshape(-1)[sl.start : sl.end]
        if p.dtype == torch.float32:
            return view, True  # fp32: update the model parameter in place, no copy
        return view.float(), False  # a copy already (16-bit to fp32): no second one, no transient

    # --- per-step API --------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 unless fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler is not None else loss

    def set_lr(self, lr: float) -> None:
        for group in self.adam.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.ddp.zero_grad()
        for m in self._mains:
            m.grad = None

    def _main_grads(self) -> list[torch.Tensor]:
        grads = []
        for sl, main in zip(self._slices, self._mains, strict=True):
            g = sl.param.main_grad.reshape(-1)[sl.start : sl.end].view(main.shape)  # type: ignore[attr-defined]
            # A view of the fp32 buffer: unscaling and clipping act on it in place, no copy.
            main.grad = g if g.dtype == torch.float32 else g.float()
            grads.append(main.grad)
        return grads

    def _shard_group(self) -> Group:
        return self.ddp.dp_group if self.distributed else None

    @torch.no_grad()
    def step(self) -> StepResult:
        """Unscale and check (fp16), clip, AdamW, write back (and all-gather) the model parameters."""
        grads = self._main_grads()
        try:
            if self.scaler is not None:
                found_inf = torch.zeros(1, dtype=torch.float32, device=self.ddp.grad_buffer.device)
                if grads:
                    inv_scale = torch.full((1,), 1.0 / self.scaler.scale, device=found_inf.device)
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
                # Every rank must agree: with the distributed optimizer each sees only its shard,
                # and model-parallel ranks see different parameters.
                _all_reduce(found_inf, self.ddp.dp_group, dist.ReduceOp.MAX)
                _all_reduce(found_inf, self.state.group("mp"), dist.ReduceOp.MAX)
                skipped = bool(found_inf.item() > 0)
                self.scaler.update(skipped)
                if skipped:
                    return StepResult(math.nan, True, self.scaler.scale)
            flags: dict[bool, list[tuple[torch.Tensor, bool]]] = {False: [], True: []}
            for g, sl in zip(grads, self._slices, strict=True):
                # A pipeline stage's copy of a weight another stage owns (Megatron's `shared`).
                if not getattr(sl.param, "shared", False):
                    tensor_parallel = bool(getattr(sl.param, "tensor_parallel", False))
                    flags[is_expert_parallel(sl.param)].append((g, tensor_parallel))
            norm = global_grad_norm(
                flags[False],
                self.state,
                shard_group=self._shard_group(),
                expert_grads_with_flags=flags[True],
                expert_shard_group=self.ddp.edp_group if self.distributed else None,
            )
            if self.clip_grad > 0 and math.isfinite(norm):
                coeff = self.clip_grad / (norm + 1e-6)
                if coeff < 1.0 and grads:
                    torch._foreach_mul_(grads, coeff)
            self.adam.step()
            self.steps += 1
        finally:
            for m in self._mains:
                m.grad = None
        self._copy_mains_to_model()
        return StepResult(norm, False, self.scaler.scale if self.scaler is not None else None)

    def _copy_mains_to_model(self) -> None:
        for sl, main, aliased in zip(self._slices, self._mains, self._aliased, strict=True):
            if not aliased:
                sl.param.detach().reshape(-1)[sl.start : sl.end].copy_(main.reshape(-1))
        self.ddp.gather_params()

    def state_bytes(self) -> int:
        """Bytes this rank's optimizer holds: fp32 main weights that are copies (not aliases of the
        model's own fp32 parameters) and Adam's moments (allocated at the first step)."""
        copies = [m for m, aliased in zip(self._mains, self._aliased, strict=True) if not aliased]
        moments = [
            t for st in self.adam.state.values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")
        ]
        return sum(t.numel() * t.element_size() for t in copies + moments)

    # --- checkpoint state ----------------------------------------------------------------------------

    @property
    def mains_alias_model(self) -> bool:
        """fp32 training: the main weights are the model's own parameters (no separate copy)."""
        return all(self._aliased)

    def main_shards(self) -> list[tuple[OwnedSlice, torch.Tensor, dict[str, torch.Tensor]]]:
        """Per owned slice: the slice, its fp32 main weights as a flat view, and Adam's moments as flat
        views (zeros before the first step). What a sharded checkpoint writes: nothing is gathered."""
        out = []
        for sl, main in zip(self._slices, self._mains, strict=True):
            st = self.adam.state.get(main, {})
            moments = {
                k: st[k].reshape(-1)
                if k in st
                else torch.zeros(main.numel(), dtype=torch.float32, device=main.device)
                for k in ("exp_avg", "exp_avg_sq")
            }
            out.append((sl, main.reshape(-1), moments))
        return out

    @torch.no_grad()
    def load_main_shards(self, moments: list[dict[str, torch.Tensor]], steps: int) -> None:
        """After main_shards' main views were filled in place: Adam's moments (per slice, in
        main_shards' order) and step count, then the model weights from the mains (collective over dp,
        as after a step), so every copy of a weight agrees with the fp32 master."""
        self.steps = int(steps)
        adam_sd = self.adam.state_dict()
        adam_sd["state"] = {}
        if self.steps > 0:
            for index, (main, m) in enumerate(zip(self._mains, moments, strict=True)):
                adam_sd["state"][index] = {
                    "step": torch.tensor(float(self.steps)),
                    "exp_avg": m["exp_avg"].view(main.shape).clone(),
                    "exp_avg_sq": m["exp_avg_sq"].view(main.shape).clone(),
                }
        self.adam.load_state_dict(adam_sd)  # torch places and casts each state like its parameter
        self._copy_mains_to_model()

    @torch.no_grad()
    def reload_mains_from_model(self) -> None:
        """Refresh the fp32 mains from the model weights (after loading weights only), fresh moments."""
        for sl, main, aliased in zip(self._slices, self._mains, self._aliased, strict=True):
            if not aliased:
                main.copy_(sl.param.detach().reshape(-1)[sl.start : sl.end].view(main.shape))
        self.adam.state.clear()
        self.steps = 0

    @torch.no_grad()
    def full_state_dict(self, names: dict[nn.Parameter, str]) -> dict[str, Any]:
        """Full fp32 main params and Adam moments per parameter name (collective over dp).

        {"params": {name: {"param", "exp_avg", "exp_avg_sq"}}, "steps": int, "loss_scaler": dict | None}
        Every tensor has the parameter's shape on this rank (tensor-parallel shards stay sharded: the
        caller gathers those over tp). Independent of dp and of the bucket layout.
        """
        ddp = self.ddp
        flats = {
            k: torch.zeros(ddp.numel, dtype=torch.float32, device=ddp.grad_buffer.device)
            for k in ("param", "exp_avg", "exp_avg_sq")
        }
        for sl, main in zip(self._slices, self._mains, strict=True):
            n = sl.end - sl.start
            flats["param"][sl.offset : sl.offset + n].copy_(main.reshape(-1))
            st = self.adam.state.get(main, {})
            for k in ("exp_avg", "exp_avg_sq"):
                if k in st:
                    flats[k][sl.offset : sl.offset + n].copy_(st[k].reshape(-1))
        for flat in flats.values():
            ddp.gather_shards(flat)
        params = {}
        for p in ddp.params:
            lo = ddp.offset(p)
            params[self._name(names, p)] = {
                k: flat[lo : lo + p.numel()].view(p.shape).clone() for k, flat in flats.items()
            }
        return {
            "params": params,
            "steps": self.steps,
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict[str, Any], names: dict[nn.Parameter, str]) -> None:
        """Inverse of full_state_dict, for any dp degree and bucket layout: each rank takes its slices."""
        entries = sd["params"]
        for p in self.ddp.params:
            name = self._name(names, p)
            if name not in entries:
                raise KeyError(f"optimizer state has no parameter {name!r}")
            if tuple(entries[name]["param"].shape) != tuple(p.shape):
                shape = tuple(entries[name]["param"].shape)
                raise ValueError(f"{name}: checkpoint shape {shape} != model {tuple(p.shape)}")
            p.detach().copy_(entries[name]["param"])  # every rank holds the full parameter
        self.steps = int(sd["steps"])
        adam_sd = self.adam.state_dict()
        adam_sd["state"] = {}
        for index, (sl, main) in enumerate(zip(self._slices, self._mains, strict=True)):
            entry = entries[self._name(names, sl.param)]
            piece = {k: entry[k].reshape(-1)[sl.start : sl.end].reshape(main.shape) for k in entry}
            main.copy_(piece["param"])
            if self.steps > 0:
                adam_sd["state"][index] = {
                    "step": torch.tensor(float(self.steps)),
                    "exp_avg": piece["exp_avg"].clone(),
                    "exp_avg_sq": piece["exp_avg_sq"].clone(),
                }
        # torch places and casts each state tensor (and `step`, for fused) like its parameter.
        self.adam.load_state_dict(adam_sd)
        if self.scaler is not None and sd.get("loss_scaler") is not None:
            self.scaler.load_state_dict(sd["loss_scaler"])

    @staticmethod
    def _name(names: dict[nn.Parameter, str], p: nn.Parameter) -> str:
        try:
            return names[p]
        except KeyError:
            raise KeyError(f"no name given for a parameter of shape {tuple(p.shape)}") from None


def build_optimizer(ddp: DataParallel, cfg: TrainConfig) -> MixedPrecisionOptimizer:
    """The optimizer a TrainConfig asks for (a DynamicLossScaler for fp16)."""
    scaler = None
    if cfg.precision == "fp16":
        scaler = DynamicLossScaler(
            initial_scale=cfg.initial_loss_scale,
            min_scale=cfg.min_loss_scale,
            growth_interval=cfg.loss_scale_window,
            hysteresis=cfg.hysteresis,
        )
    return MixedPrecisionOptimizer(
        ddp,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        loss_scaler=scaler,
    )


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for the optimizer step that produces `step` (1-based): warmup, then decay."""
    if cfg.warmup_iters and step <= cfg.warmup_iters:
        return cfg.lr * step / cfg.warmup_iters
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_iters) / max(1, cfg.train_iters - cfg.warmup_iters))
    if cfg.lr_schedule == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr - (cfg.lr - cfg.min_lr) * progress
