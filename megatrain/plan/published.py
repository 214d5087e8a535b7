"""Published training runs, with their sources: what the GPU cost constants are fitted on and
checked against (megatrain.plan.cost_constants, BENCHMARKS.md "Planner calibrated on published
runs"). Each run is the model, the GPUs, the layout and the throughput its authors reported;
`held_out` runs are not used by the fit, only to check it.

What a source leaves unsaid (virtual pipeline stages, micro-batch size, recompute) is the choice
the planner would make for the published tp/pp/dp/cp/ep: the fastest that fits (predict). What a
run overlapped is its stack's (cost.Overlaps): Megatron-Core's flags where its authors list them.
Throughput is compared per GPU in tokens/s; a source's TFLOP/s are converted with our FLOPs per
token (megatrain.plan.flops: for these models the same formula as Megatron-LM's
num_floating_point_operations), so the comparison does not depend on how FLOPs are counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain.plan.cost import (
    MEGATRON_OVERLAPS,
    CostConstants,
    Overlaps,
    StepSettings,
    StepTime,
    predict_step,
)
from megatrain.plan.flops import flops_per_token
from megatrain.plan.planner import Choice, Plan, PlanError, balanced_layers, plan
from megatrain.plan.pool import PoolSpec
from megatrain.plan.shapes import ModelShape, shape_of_spec
from megatrain.spec import JobSpec, parse_spec

MEGATRON_README = (
    "Megatron-LM README, 'Training Speed and Scalability', images/model_table.png (NVIDIA/Megatron-LM "
    "f2e5db4, 2024-07-15): GPT, vocabulary 131,072, sequence 4,096, H100, --overlap-grad-reduce "
    "--overlap-param-gather --tp-comm-overlap"
)
MEGATRON_STRONG = (
    "Megatron-LM README (f2e5db4), same section: the 177B GPT strong-scaled from 96 to 4,608 H100 at "
    "1,152 sequences per batch, MFU 47% -> 42%; the layout is not given: the weak-scaling table's "
    "177B tp=8 pp=6 is assumed"
)
LLAMA3 = "Dubey et al. 2024, 'The Llama 3 Herd of Models', table 4 (H100, bf16)"
MIXTRAL = (
    "Megatron-LM megatron/core/transformer/moe/README.md (0b981f9, 2024-08-02): 438 TFLOP/s bf16 "
    "(MCore v0.8) and its 'Reference Best Parallel Mapping' (MCore v0.8) on 64 H100"
)
BRIDGE = "Megatron-Bridge docs/performance-summary-archive.md, 25.11 NeMo container, DGX-H100, FP8-CS"


def _gpt(heads: int, hidden: int, layers: int) -> dict[str, Any]:
    """Megatron-LM's weak-scaling GPT: MHA, 4h GELU MLP, untied embeddings (1.7B = 24 layers of
    12h² + 2 × 131,072 × 2,048)."""
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "num_query_groups": heads, "ffn_hidden_size": 4 * hidden, "activation": "gelu",
            "seq_length": 4096, "vocab_size": 131072, "tie_embeddings": False}  # fmt: skip


LLAMA3_70B = {"num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "num_query_groups": 8,
              "ffn_hidden_size": 28672, "seq_length": 8192, "vocab_size": 128256}  # fmt: skip
LLAMA3_405B = {"num_layers": 126, "hidden_size": 16384, "num_attention_heads": 128, "num_query_groups": 8,
               "ffn_hidden_size": 53248, "seq_length": 8192, "vocab_size": 128256}  # fmt: skip
MIXTRAL_8X7B = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_query_groups": 8,
                "ffn_hidden_size": 14336, "seq_length": 4096, "vocab_size": 32000,
                "moe": {"num_experts": 8, "router_topk": 2}}  # fmt: skip


@dataclass(frozen=True)
class PublishedRun:
    """One published run: what was trained where, with which layout, at what throughput."""

    name: str
    source: str
    model: dict[str, Any]
    """model fields of a JobSpec (arch llama)."""
    gpus: int
    global_batch: int
    """Sequences per step."""
    parallelism: dict[str, int]
    """What the source gives of tp, pp, dp, cp, ep, virtual_stages."""
    tflops: float | None = None
    """Reported model TFLOP/s per GPU (converted to tokens/s with our FLOPs per token)."""
    tokens_per_gpu: float | None = None
    """Reported tokens/s per GPU, where the source gives them."""
    held_out: bool = False
    precision: str = "bf16"
    micro_batch_size: int | None = None
    """As published; None: the fastest of 1, 2, 4 that fits."""
    overlaps: Overlaps = MEGATRON_OVERLAPS

    @property
    def published_tokens_per_gpu(self) -> float:
        if self.tokens_per_gpu is not None:
            return self.tokens_per_gpu
        assert self.tflops is not None
        shape = shape_of_spec(spec_of(self), self.model["vocab_size"])
        return self.tflops * 1e12 / flops_per_token(shape, shape.seq_length)


def _weak(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, batch: int, tflops: float,
          held_out: bool = False) -> PublishedRun:  # fmt: skip
    """A row of Megatron-LM's weak-scaling table: data parallelism 48 throughout."""
    par = {"tp": tp, "pp": pp, "dp": 48}
    return PublishedRun(f"GPT {size}", MEGATRON_README, _gpt(heads, hidden, layers), tp * pp * 48, batch, par,
                        tflops, held_out=held_out)  # fmt: skip


META = Overlaps(param_gather=True)
"""Llama 3's stack: FSDP-style sharding whose parameter gathers are prefetched; the paper says
nothing of tensor-parallel overlap."""

RUNS: tuple[PublishedRun, ...] = (
    # Megatron-LM's weak scaling: every other size trains the fit, the rest are held out.
    _weak("1.7B", 16, 2048, 24, 1, 1, 192, 408.8),
    _weak("7.1B", 32, 4096, 30, 2, 1, 192, 465.9, held_out=True),
    _weak("16B", 48, 6144, 32, 4, 1, 192, 489.1),
    _weak("32B", 56, 7168, 48, 8, 1, 192, 459.6, held_out=True),
    _weak("70B", 64, 8192, 84, 8, 2, 384, 419.7),
    _weak("119B", 80, 10240, 92, 8, 4, 768, 420.5, held_out=True),
    _weak("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
    _weak("314B", 128, 16384, 96, 8, 8, 1536, 474.4, held_out=True),
    _weak("462B", 144, 18432, 112, 8, 16, 3072, 459.9),
    # The 177B strong-scaled: only the end points' MFU (of 989 TFLOP/s) is given.
    PublishedRun("GPT 177B strong", MEGATRON_STRONG, _gpt(96, 12288, 96), 96, 1152,
                 {"tp": 8, "pp": 6, "dp": 2}, 0.47 * 989, held_out=True),
    PublishedRun("GPT 177B strong", MEGATRON_STRONG, _gpt(96, 12288, 96), 4608, 1152,
                 {"tp": 8, "pp": 6, "dp": 96}, 0.42 * 989, held_out=True),
    # Llama 3 405B, 16M tokens per batch.
    PublishedRun("Llama 3 405B", LLAMA3, LLAMA3_405B, 8192, 2048, {"tp": 8, "pp": 16, "dp": 64}, 430.0,
                 held_out=True, micro_batch_size=1, overlaps=META),
    PublishedRun("Llama 3 405B", LLAMA3, LLAMA3_405B, 16384, 2048, {"tp": 8, "pp": 16, "dp": 128}, 400.0,
                 held_out=True, micro_batch_size=1, overlaps=META),
    PublishedRun("Llama 3 405B, 131K", LLAMA3, {**LLAMA3_405B, "seq_length": 131072}, 16384, 128,
                 {"tp": 8, "pp": 16, "dp": 8, "cp": 16}, 380.0, held_out=True, micro_batch_size=1,
                 overlaps=META),
    PublishedRun("Mixtral 8x7B", MIXTRAL, MIXTRAL_8X7B, 64, 256,
                 {"tp": 1, "pp": 4, "dp": 16, "ep": 8, "virtual_stages": 8}, 438.0, held_out=True,
                 micro_batch_size=1),
    # FP8 (Transformer Engine, current scaling): outside the bf16 fit.
    PublishedRun("Llama 3 70B fp8", BRIDGE, LLAMA3_70B, 64, 128,
                 {"tp": 4, "pp": 8, "dp": 2, "virtual_stages": 5}, tokens_per_gpu=1602.0, held_out=True,
                 precision="fp8", micro_batch_size=1),
    PublishedRun("Llama 3.1 405B fp8", BRIDGE, LLAMA3_405B, 1024, 512,
                 {"tp": 8, "pp": 8, "dp": 8, "cp": 2, "virtual_stages": 8}, tokens_per_gpu=292.0,
                 held_out=True, precision="fp8", micro_batch_size=1),
)  # fmt: skip


def h100_pool(gpus: int) -> PoolSpec:
    """DGX H100 nodes: 8 GPUs on NVLink 4 (450 GB/s a direction), a 400 Gb/s NIC per GPU."""
    return PoolSpec(name="h100", accelerator="NVIDIA H100 80GB HBM3", device_memory_bytes=80 << 30,
                    peak_tflops={"bf16": 989.0, "fp8": 1979.0, "fp32": 67.0}, devices_per_node=8,
                    nodes=-(-gpus // 8), intra_node_bandwidth_gbps=450.0,
                    inter_node_bandwidth_gbps=50.0)  # fmt: skip


def spec_of(run: PublishedRun, parallelism: dict[str, Any] | None = None, **training: Any) -> JobSpec:
    """The run as a JobSpec: auto parallelism, or `parallelism` (sequence parallel with tp)."""
    raw: dict[str, Any] = {
        "name": "published",
        "model": {"arch": "llama", **run.model},
        "data": {"train": [{"dataset": "corpus"}]},
        "training": {"global_batch_size": run.global_batch, "precision": run.precision,
                     "micro_batch_size": run.micro_batch_size or "auto", **training},
        "resources": {"devices": run.gpus},
    }  # fmt: skip
    if parallelism is not None:
        raw["parallelism"] = {**parallelism, "sequence_parallel": parallelism["tp"] > 1}
    return parse_spec(raw)


@dataclass(frozen=True)
class Prediction:
    """The predicted step of a run's layout, and the choices the source left open."""

    time: StepTime
    choice: Choice
    """The published layout with the virtual stages, micro-batch size and recompute predicted."""
    tokens_per_gpu: float
    error: float
    """predicted / published - 1."""

    @property
    def layout(self) -> str:
        c = self.choice
        return f"{c.layout.describe()} v={c.layout.virtual_stages} mbs={c.micro_batch_size} {c.recompute}"


_FITTING: dict[str, tuple[tuple[ModelShape, Plan], ...]] = {}


def _fitting(run: PublishedRun) -> tuple[tuple[ModelShape, Plan], ...]:
    """Every (virtual stages, micro-batch size) of the published layout with the least recompute
    that fits, as explicit plans (memory does not depend on the cost constants: kept per run)."""
    if repr(run) in _FITTING:
        return _FITTING[repr(run)]
    par, pp = run.parallelism, run.parallelism["pp"]
    layers = run.model["num_layers"]
    stages = range(1, layers // pp + 1) if pp > 1 else [1]
    if "virtual_stages" in par:
        stages = [par["virtual_stages"]]
    sizes = [run.micro_batch_size] if run.micro_batch_size else [1, 2, 4]
    out = []
    for v in stages:
        split = balanced_layers(layers, pp, v) if pp > 1 else None
        layout = {**par, "virtual_stages": v, "pipeline_layers": list(split) if split else None}
        for mbs in sizes:
            for recompute in ("none", "selective", "full"):
                spec = spec_of(run, layout, recompute=recompute, micro_batch_size=mbs)
                try:
                    result = plan(spec, h100_pool(run.gpus), overlaps=run.overlaps)
                except PlanError:
                    continue
                out.append((shape_of_spec(spec, run.model["vocab_size"]), result))
                break
    _FITTING[repr(run)] = tuple(out)
    return _FITTING[repr(run)]


def predict(run: PublishedRun, constants: CostConstants | None = None) -> Prediction:
    """The published layout's fastest prediction over what the source leaves open."""
    best: tuple[StepTime, Plan] | None = None
    for shape, result in _fitting(run):
        c = result.choice
        settings = StepSettings(micro_batch_size=c.micro_batch_size, global_batch_size=run.global_batch,
                                recompute=c.recompute, distributed_optimizer=c.distributed_optimizer,
                                precision=run.precision, overlaps=run.overlaps)  # fmt: skip
        t = predict_step(shape, c.layout, settings, h100_pool(run.gpus), constants)
        if best is None or t.step_time_s < best[0].step_time_s:
            best = (t, result)
    if best is None:
        why = f"{run.name}: the published layout does not fit"
        raise PlanError([{"field": "parallelism", "message": why}])
    t, result = best
    tokens = t.tokens_per_s / run.gpus
    return Prediction(t, result.choice, tokens, tokens / run.published_tokens_per_gpu - 1)


def plan_auto(run: PublishedRun) -> Plan:
    """`parallelism: auto` for the run's model, batch and GPUs, on the run's stack."""
    return plan(spec_of(run), h100_pool(run.gpus), overlaps=run.overlaps)


__all__ = ["RUNS", "PublishedRun", "Prediction", "h100_pool", "plan_auto", "predict", "spec_of"]
