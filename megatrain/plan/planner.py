"""The layout planner: the fastest layout of a spec on a pool that fits its devices' memory.

`plan(spec, pool, devices)` enumerates tp (divisors of the node's devices, so tp stays inside a
node), cp (powers of two leaving at least MIN_CP_CHUNK tokens of a sequence per rank), pp, dp
(filling the devices), ep for an MoE model (divisors of its experts that divide dp·cp), the pipeline
schedule (1F1B over 1..MAX_VIRTUAL_STAGES chunks per stage; zb-h1 and zbv, per
megatrain.plan.zero_bubble), micro-batch size, recompute, the distributed optimizer, sequence
parallelism and, for an MoE model, how its all-to-alls run (megatrain.plan.moe_exchange); drops
every candidate that breaks a layout rule (megatrain.plan.layout) or cannot fit
(megatrain.plan.memory, with `fits`' headroom); predicts the rest's step time (megatrain.plan.cost)
and returns the fastest, its runners-up and the rejected ones with their reasons. A spec with an
explicit `parallelism` gets the prediction for its layout.

BERT is planned as GPT is. T5 gets no cp, no virtual stages and no zero-bubble schedule, and, with
pp > 1, the split of its encoder and decoder layers over the stages that balances their time
(megatrain.plan.t5_cost.t5_pipeline_layers), written into the layout's pipeline_layers.

Fast by pruning, not by sampling: a model-state lower bound per (tp, cp, pp, ep, distributed
optimizer) rejects whole families before any activation estimate, a bound of the first stage's
activations (and a zero-bubble schedule's last stage, which holds the most) single candidates; the
survivors are scored by the cheap cost model and only then, fastest first, given the full memory
estimate until enough fit; memory grows with the micro-batch size and shrinks with recompute, so
one miss rules out the bigger batches of its family without estimating them.

What it answers (Choice, Plan, Rejection, the JSON) lives in megatrain.plan.result.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from megatrain.plan.bounds import layer_state_bytes, model_state_floor, saved_per_token
from megatrain.plan.cost import ENGINE_OVERLAPS, Overlaps, StepSettings, StepTime, predict_step
from megatrain.plan.fp8 import fp8_width_problems
from megatrain.plan.layout import (
    Layout,
    batch_problems,
    context_problems,
    expert_problems,
    model_problems,
    pairs_whole,
    resolve_layout,
)
from megatrain.plan.memory import GiB, MemoryEstimate, chunks_in_flight, fits, from_spec, planned_precision
from megatrain.plan.moe_exchange import exchange_options
from megatrain.plan.pool import PoolSpec
from megatrain.plan.result import (
    MAX_REJECTED_SHOWN,
    Choice,
    Plan,
    PlanError,
    Rejection,
    memory_message,
    nothing_fits,
    predicted_dict,
)
from megatrain.plan.shapes import BYTE_TOKENIZER_VOCAB, ModelShape, param_counts, shape_of_spec
from megatrain.plan.stacks import family_layout_problems, stack_layers_on_stage
from megatrain.plan.stages import balanced_layers, divisors, layers_on_stage, moe_layers_on_stage
from megatrain.plan.t5_cost import t5_pipeline_layers
from megatrain.plan.zero_bubble import (
    SPLIT_SCHEDULES,
    deferred_per_layer,
    last_stage_floor,
    stage_ordered,
    zero_bubble_pipelines,
)
from megatrain.spec import JobSpec, ParallelismSpec, SpecError

HEADROOM = 0.9
"""Plan to use at most this fraction of a device's memory (the allocator and kernels need the rest)."""
RECOMPUTE_ORDER = ("none", "selective", "full")
"""Least memory last: a candidate that does not fit rules out the ones before it (same batch)."""
MAX_VIRTUAL_STAGES = 8
MIN_CP_CHUNK = 4096
"""Tokens of a sequence per context-parallel rank below which cp is not tried: its GEMMs shrink and
its ring hops grow relative to block attention, while a shorter sequence's activations rarely
need splitting (Megatron uses cp from 8K-token sequences up)."""
MAX_RUNNERS_UP = 5


class _Search:
    """The state of one planning call: the spec's fixed facts and what has been rejected."""

    def __init__(self, spec: JobSpec, pool: PoolSpec, devices: int, vocab: int, overlaps: Overlaps):
        self.spec, self.pool, self.devices, self.vocab, self.overlaps = spec, pool, devices, vocab, overlaps
        self.model: ModelShape = shape_of_spec(spec, vocab)
        self.accelerator = "cpu" if pool.is_cpu else pool.accelerator
        self.precision = planned_precision(spec.training.precision, self.accelerator)
        self.budget = HEADROOM * pool.device_memory_bytes
        self.rejected: list[Rejection] = []
        self.counts: Counter[str] = Counter()
        self.considered = 0
        self._pipelines: dict[int, list[tuple[str, int, tuple[int, ...] | None]]] = {}

    @property
    def fixed_micro_batch(self) -> int | None:
        """training.micro_batch_size as written (kept), or None for auto (the planner picks it)."""
        mbs = self.spec.training.micro_batch_size
        return mbs if isinstance(mbs, int) else None

    def reject(self, code: str, message: str, choice: Choice | None = None, **numbers: Any) -> None:
        self.counts[code] += 1
        if len(self.rejected) < 4 * MAX_REJECTED_SHOWN:
            self.rejected.append(Rejection(code, message, choice.as_dict() if choice else None, numbers))

    def settings(self, c: Choice) -> StepSettings:
        par = self.spec.parallelism if isinstance(self.spec.parallelism, ParallelismSpec) else None
        return StepSettings(
            micro_batch_size=c.micro_batch_size,
            global_batch_size=self.spec.training.global_batch_size,
            recompute=c.recompute,
            recompute_every=self.spec.training.recompute_every if par else 1,
            distributed_optimizer=c.distributed_optimizer,
            precision=self.precision,
            overlap_grad_reduce=par.overlap_grad_reduce if par else True,
            grad_bucket_elements=par.grad_bucket_elements if par else 40_000_000,
            moe_overlap_chunks=c.moe_overlap_chunks,
            moe_dispatch=c.moe_dispatch,
            moe_overlap_microbatches=c.moe_overlap_microbatches,
            overlaps=self.overlaps,
        )

    def memory(self, c: Choice) -> MemoryEstimate:
        lay = c.layout
        return from_spec(
            self.spec,
            lay,
            tokenizer_vocab=self.vocab,
            accelerator=self.accelerator,
            micro_batch_size=c.micro_batch_size,
            num_microbatches=lay.micro_batches(self.spec.training.global_batch_size, c.micro_batch_size),
            recompute=c.recompute,
            recompute_every=self.settings(c).recompute_every,
            distributed_optimizer=c.distributed_optimizer,
            device="cpu" if self.pool.is_cpu else "cuda",
            microbatch_lanes=c.moe_overlap_microbatches,
        )

    def memory_rejection(self, c: Choice, est: MemoryEstimate) -> None:
        message, needed = memory_message(est, self.budget, self.pool.device_memory_bytes, HEADROOM)
        self.reject("memory", message, c, memory_per_gpu_bytes=needed, budget_bytes=int(self.budget))

    # -- enumeration ---------------------------------------------------------------------------

    def model_state_floor(self, tp: int, pp: int, dp: int, dist_opt: bool, cp: int = 1, ep: int = 1) -> int:
        return model_state_floor(self.model, self.precision, tp, pp, dp * cp if dist_opt else 1, ep)

    def cp_options(self, tp: int) -> list[int]:
        """1, and the powers of two that split every sequence into 2·cp chunks of at least
        MIN_CP_CHUNK/2 tokens and divide the devices left by tp; the rest rejected with why."""
        s, out = self.model.seq_length, [1]
        m = self.spec.model
        cp = 2
        while tp * cp <= self.devices:
            if (self.devices // tp) % cp == 0:
                lay = Layout(tp=tp, cp=cp)
                problems = model_problems(lay, seq_length=s, model="model.", par="")
                # Ring attention runs no dropout, only its own attention blocks, and no T5.
                unsupported = family_layout_problems(m, lay) or context_problems(
                    lay, m.attention_dropout, m.attention_backend
                )
                if problems:
                    self.reject("divisibility", problems[0]["message"], cp=cp)
                elif unsupported:
                    self.reject("cp_unsupported", unsupported[0]["message"], cp=cp)
                elif s // cp < MIN_CP_CHUNK:
                    self.reject(
                        "cp_chunk",
                        f"cp={cp} would leave {s // cp} tokens of each {s}-token sequence per rank, under "
                        f"{MIN_CP_CHUNK} (context parallelism pays off only for long sequences)",
                        cp=cp,
                    )
                else:
                    out.append(cp)
            cp *= 2
        return out

    def ep_options(self, tp: int, cp: int, pp: int, dp: int) -> list[int]:
        """1 for a dense model; else the divisors of dp·cp that divide the experts (the rest rejected),
        keeping the expert-parallel group inside a node when one that does can hold the model state
        (its all-to-alls then stay on NVLink); wider groups only when none can."""
        experts = self.model.moe.num_experts if self.model.moe is not None else 0
        if not experts:
            return [1]
        valid = []
        for ep in divisors(dp * cp):
            if ep > experts:
                break
            problems = expert_problems(Layout(dp=dp, cp=cp, ep=ep), experts)
            if problems:
                self.reject("divisibility", problems[0]["message"], ep=ep, dp=dp, cp=cp)
                continue
            valid.append(ep)
        node = self.pool.devices_per_node
        inside = [ep for ep in valid if ep * tp * cp <= node]
        fits_inside = [ep for ep in inside if self.model_state_floor(tp, pp, dp, True, cp, ep) <= self.budget]
        if not fits_inside:
            return valid
        for ep in valid:
            if ep not in inside:
                self.reject(
                    "ep_exceeds_node",
                    f"ep={ep} would spread each expert-parallel group over {ep * tp * cp // node} nodes "
                    f"while ep={max(fits_inside)} fits inside one (tp={tp} cp={cp} pp={pp} dp={dp})",
                    ep=ep,
                )
        return inside

    def families(self) -> list[tuple[int, int, int, int]]:
        """(tp, cp, pp, dp) that multiply to the devices and pass the model's divisibility rules."""
        m, out = self.model, []
        for tp in divisors(self.devices):
            if tp > self.pool.devices_per_node or self.pool.devices_per_node % tp:
                self.reject(
                    "tp_exceeds_node",
                    f"tp={tp} does not divide the {self.pool.devices_per_node} devices of a node "
                    "(tensor parallelism stays inside a node)",
                )
                continue
            problems = model_problems(
                Layout(tp=tp),
                num_attention_heads=m.num_attention_heads,
                num_query_groups=m.num_query_groups,
                ffn_hidden_size=m.ffn_hidden_size,
                vocab_size=m.vocab_size,
                moe_ffn_hidden_size=m.moe.ffn_hidden_size if m.moe else None,
                shared_expert_ffn_hidden_size=m.moe.shared_expert_ffn_hidden_size if m.moe else None,
                model="model.",
                par="",
            )
            problems = problems or fp8_width_problems(self.spec, tp)
            if problems:
                self.reject("divisibility", problems[0]["message"], tp=tp)
                continue
            for cp in self.cp_options(tp):
                for pp in divisors(self.devices // (tp * cp)):
                    if pp > m.total_layers:  # (uneven splits are planned: see balanced_layers)
                        dec = f" + {m.num_decoder_layers} decoder layers" if m.num_decoder_layers else ""
                        self.reject("divisibility", f"pp={pp} exceeds model.num_layers={m.num_layers}{dec}")
                        continue
                    dp = self.devices // (tp * cp * pp)
                    gbs, mbs = self.spec.training.global_batch_size, self.fixed_micro_batch
                    if batch_problems(Layout(dp=dp), gbs, mbs or 1):
                        by = f"micro_batch_size×dp={mbs}×{dp}" if mbs else f"dp={dp}"
                        self.reject(
                            "divisibility",
                            f"training.global_batch_size={gbs} is not divisible by {by} "
                            f"(tp={tp}, cp={cp}, pp={pp})",
                        )
                        continue
                    out.append((tp, cp, pp, dp))
        return out

    def choices(self, tp: int, cp: int, pp: int, dp: int) -> list[Choice]:
        out = []
        for ep in self.ep_options(tp, cp, pp, dp):
            for dist_opt in (True, False) if dp * cp > 1 else (False,):
                out += self._choices(tp, cp, pp, dp, ep, dist_opt)
        return out

    def _choices(self, tp: int, cp: int, pp: int, dp: int, ep: int, dist_opt: bool) -> list[Choice]:
        tr, m = self.spec.training, self.model
        out: list[Choice] = []
        per_rank = tr.global_batch_size // dp
        floor = self.model_state_floor(tp, pp, dp, dist_opt, cp, ep)
        if floor > self.budget:
            self.reject(
                "model_state",
                f"tp={tp} cp={cp} pp={pp} dp={dp} ep={ep} distributed_optimizer={dist_opt}: the weights, "
                f"gradients and optimizer state alone need {floor / GiB:,.2f} GiB per device, over the "
                f"{self.budget / GiB:,.2f} GiB budget",
                memory_per_gpu_bytes=floor,
            )
            return out
        every = self.settings(Choice(Layout(), 1, "full", dist_opt)).recompute_every
        sp_lay = Layout(tp=tp, cp=cp, sequence_parallel=True)
        sp_ok = tp > 1 and not model_problems(sp_lay, seq_length=m.seq_length)
        sp_ok = sp_ok and not family_layout_problems(self.spec.model, sp_lay)
        sps = (True, False) if sp_ok else (False,)
        saved = {sp: saved_per_token(m, self.precision, tp, sp) for sp in sps}
        state = layer_state_bytes(m, self.precision, tp, dp * cp if dist_opt else 1, ep)
        deferred = {sp: deferred_per_layer(m, self.precision, tp, sp) for sp in sps}
        # The spec's micro-batch size when it gives one (families checked it divides per_rank).
        auto = [n for n in divisors(per_rank) if pairs_whole(self.spec, n)]
        for mbs in [self.fixed_micro_batch] if self.fixed_micro_batch else auto:
            n_micro = per_rank // mbs
            for schedule, v, split in self.pipelines(pp):
                if v > 1 and n_micro % pp and schedule != "zbv":
                    continue  # interleaving needs micro-batches in groups of pp (batch_problems)
                # What the first stage keeps for its micro-batches in flight: a lower bound of its
                # activations (megatrain.plan.memory), so hopeless candidates are never scored.
                tokens = chunks_in_flight(schedule, pp, 0, n_micro, v) / v * mbs * m.seq_length / cp
                staged = stage_ordered(split, pp, schedule)
                n = layers_on_stage(m.num_layers, pp, 0, staged)
                n_moe = moe_layers_on_stage(m, pp, 0, staged, v)
                for sp in sps:
                    if m.family == "t5":  # encoder stages, then decoder stages; the bound: the encoder's
                        split = t5_pipeline_layers(m, self.pool, self.precision, tp=tp, pp=pp, sp=sp,
                                                   micro_batch_size=mbs)  # fmt: skip
                        n = stack_layers_on_stage(m, pp, 0, split)[0]
                    lay = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, virtual_stages=v, sequence_parallel=sp,
                                 pipeline_schedule=schedule, pipeline_layers=split)  # fmt: skip
                    for rc in RECOMPUTE_ORDER:
                        per_token = saved[sp][rc]
                        kept = per_token[0] * -(-n // every) if rc == "full" else (
                            per_token[0] * (n - n_moe) + per_token[1] * n_moe)  # fmt: skip
                        bound = tokens * kept
                        if schedule in SPLIT_SCHEDULES:  # their last stage holds the most
                            bound = max(bound, last_stage_floor(
                                m, schedule, pp, v, n_micro, staged, tokens=mbs * m.seq_length / cp,
                                kept=per_token, deferred=deferred[sp], state=state,
                                full_every=every if rc == "full" else None,
                            ))  # fmt: skip
                        if bound > self.budget:
                            self.counts["memory"] += 1
                            continue
                        out.append(Choice(lay, mbs, rc, dist_opt))
        return out

    def pipelines(self, pp: int) -> list[tuple[str, int, tuple[int, ...] | None]]:
        """(schedule, virtual stages, pipeline_layers) tried at pp: 1F1B over 1..MAX_VIRTUAL_STAGES
        chunks per stage (one for T5), and zb-h1 and zbv where the layout rules allow them."""
        m = self.model
        if pp not in self._pipelines:
            vs = [v for v in range(1, MAX_VIRTUAL_STAGES + 1) if pp * v <= m.num_layers] if pp > 1 else [1]
            vs = [1] if m.family == "t5" else vs  # (no interleaved schedule for T5: its split comes later)
            out = [("1f1b", v, balanced_layers(m.num_layers, pp, v)) for v in vs]
            self._pipelines[pp] = out + zero_bubble_pipelines(self.spec.model, m, pp)
        return self._pipelines[pp]

    def search(self) -> Plan:
        scored: list[tuple[float, int, Choice, StepTime]] = []
        for tp, cp, pp, dp in self.families():
            for c in self.choices(tp, cp, pp, dp):
                for option, t in exchange_options(self, c):
                    scored.append((t.step_time_s, len(scored), option, t))
        self.considered = len(scored) + sum(self.counts.values())
        scored.sort(key=lambda x: (x[0], x[1]))
        # Families whose smallest failing micro-batch is known: (layout, lanes, dist_opt, recompute) -> mbs.
        too_big: dict[tuple[Layout, bool, bool, str], int] = {}
        fitting: list[tuple[Choice, StepTime, MemoryEstimate]] = []
        best_miss: tuple[Choice, MemoryEstimate] | None = None
        for _, _, c, t in scored:
            key_rc = RECOMPUTE_ORDER.index(c.recompute)
            known = [
                too_big.get((c.layout, c.moe_overlap_microbatches, c.distributed_optimizer, rc))
                for rc in RECOMPUTE_ORDER[key_rc:]  # less recompute than a miss can only need more
            ]
            if any(b is not None and c.micro_batch_size >= b for b in known):
                self.counts["memory"] += 1
                continue
            est = self.memory(c)
            if fits(est, self.pool.device_memory_bytes, HEADROOM):
                fitting.append((c, t, est))
                if len(fitting) > MAX_RUNNERS_UP:
                    break
                continue
            self.memory_rejection(c, est)
            k = (c.layout, c.moe_overlap_microbatches, c.distributed_optimizer, c.recompute)
            too_big[k] = min(too_big.get(k, c.micro_batch_size), c.micro_batch_size)
            if best_miss is None or est.total_bytes < best_miss[1].total_bytes:
                best_miss = (c, est)
        if not fitting:
            raise nothing_fits(
                self.rejected,
                best_miss,
                self.devices,
                self.pool.device_memory_bytes,
                self.budget,
                bool(self.fixed_micro_batch),
            )
        (c, t, est), runners = fitting[0], fitting[1:]
        return Plan(
            choice=c,
            time=t,
            memory=est,
            devices=self.devices,
            pool=self.pool.name,
            precision=self.precision,
            runners_up=runners,
            rejected=self.rejected,
            rejected_counts=dict(self.counts),
            considered=self.considered,
            parameters=param_counts(self.model),
        )


def _vocab(spec: JobSpec, tokenizer_vocab: int | None) -> int:
    if tokenizer_vocab is not None:
        return tokenizer_vocab
    if spec.model.vocab_size is None and spec.data.tokenizer.type != "byte":
        why = "model.vocab_size is needed to plan with a non-byte tokenizer (the planner does not read"
        raise PlanError([{"field": "model.vocab_size", "message": f"{why} tokenizer files)"}])
    return spec.model.vocab_size or BYTE_TOKENIZER_VOCAB


def plan(
    spec: JobSpec, pool: PoolSpec, devices: int | None = None, *, tokenizer_vocab: int | None = None,
    overlaps: Overlaps = ENGINE_OVERLAPS,
) -> Plan:  # fmt: skip
    """The fastest layout of `spec` on `devices` of `pool` (default: resources.devices, else the
    whole pool) that fits its devices; an explicit `parallelism` is predicted as given. `overlaps`:
    what the stack hides beyond the engine (MEGATRON_OVERLAPS for Megatron-Core's published runs).

    Raises PlanError (a SpecError: field-named problems) when nothing can run, naming why."""
    vocab = _vocab(spec, tokenizer_vocab)
    wanted = devices or spec.resources.devices
    layout = None
    if isinstance(spec.parallelism, ParallelismSpec):
        try:
            layout = resolve_layout(spec, wanted or pool.total_devices)
        except SpecError as exc:
            raise PlanError(exc.errors) from None
        if wanted is not None and layout.world_size != wanted:
            why = f"tp×pp×cp×dp={layout.world_size} processes, but {wanted} devices were asked for"
            raise PlanError([{"field": "parallelism", "message": why}])
        wanted = layout.world_size
    n = wanted or pool.total_devices
    if n > pool.total_devices:
        why = f"{n} devices exceed the {pool.nodes}×{pool.devices_per_node}={pool.total_devices} of pool"
        why += f" {pool.name!r}"
        raise PlanError([{"field": "resources.devices", "message": why}])
    search = _Search(spec, pool, n, vocab, overlaps)
    return _explicit(search, layout) if layout is not None else search.search()


def _explicit(search: _Search, layout: Layout) -> Plan:
    spec, pool = search.spec, search.pool
    par = spec.parallelism
    assert isinstance(par, ParallelismSpec)
    if pool.devices_per_node % layout.tp:
        raise PlanError(
            [
                {
                    "field": "parallelism.tp",
                    "message": f"parallelism.tp={layout.tp} does not divide the {pool.devices_per_node} "
                    f"devices of a node in pool {pool.name!r} (tensor parallelism stays inside a node)",
                }
            ]
        )
    dist_opt = par.distributed_optimizer and layout.dp * layout.cp > 1
    tr = spec.training
    # The spec's micro-batch size, or (auto) every one the batch rules allow on this layout.
    sizes = [search.fixed_micro_batch] if search.fixed_micro_batch else [
        n for n in divisors(tr.global_batch_size // layout.dp)
        if not batch_problems(layout, tr.global_batch_size, n) and pairs_whole(spec, n)
    ]  # fmt: skip
    best: tuple[Choice, StepTime, MemoryEstimate] | None = None
    for n in sizes:
        c = Choice(layout, n, tr.recompute, dist_opt, par.moe_overlap_chunks, par.moe_dispatch,
                   par.moe_overlap_microbatches and layout.ep > 1)  # fmt: skip
        est = search.memory(c)
        if not fits(est, pool.device_memory_bytes, HEADROOM):
            search.memory_rejection(c, est)
            break  # a bigger micro-batch needs more
        t = predict_step(search.model, layout, search.settings(c), pool)
        if best is None or t.step_time_s < best[1].step_time_s:
            best = (c, t, est)
    if best is None:
        message = f"layout {layout.describe()} {search.rejected[-1].message}"
        raise PlanError([{"field": "parallelism", "message": message}])
    c, t, est = best
    return Plan(c, t, est, search.devices, pool.name, search.precision, explicit=True,
                parameters=param_counts(search.model))  # fmt: skip


__all__ = [
    "Choice",
    "Plan",
    "PlanError",
    "Rejection",
    "balanced_layers",
    "divisors",
    "plan",
    "predicted_dict",
]
