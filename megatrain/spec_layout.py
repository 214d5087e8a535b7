"""A spec's parallel layout (`parallelism`) and what it asks of the cluster (`resources`), apart from
spec.py to keep it short. The rules between these fields and the model (tp divides the heads, ep the
experts) live in megatrain.plan.layout (`resolve_layout`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from megatrain.spec_base import NAME_PATTERN, Strict


class ParallelismSpec(Strict):
    tp: int = Field(1, ge=1, le=1024)
    """Tensor-parallel degree."""
    pp: int = Field(1, ge=1, le=1024)
    """Pipeline-parallel degree."""
    dp: int | Literal["auto"] = "auto"
    """Data-parallel degree; auto fills resources.devices (or 1)."""
    cp: int = Field(1, ge=1, le=1024)
    """Context-parallel degree: each sequence split over cp ranks (two mirrored chunks each, for a
    balanced causal load), attention run as a ring; needs model.seq_length divisible by 2·cp (2·cp·tp
    with sequence_parallel) and model.attention_dropout 0."""
    ep: int = Field(1, ge=1, le=1024)
    """Expert-parallel degree: model.moe's experts split over ep ranks carved from dp×cp, tokens
    exchanged by all-to-all; must divide dp×cp and model.moe.num_experts."""
    virtual_stages: int = Field(1, ge=1, le=64)
    """Model chunks per pipeline stage (interleaved 1F1B); > 1 needs pp > 1 and micro-batches per
    step divisible by pp."""
    pipeline_layers: list[Annotated[int, Field(ge=0)]] | None = None
    """Explicit layers per model chunk (pp × virtual_stages entries, chunk v·pp + stage), summing to
    model.num_layers; default an even split, which needs num_layers divisible by pp × virtual_stages."""
    pipeline_split_rank: int | None = Field(None, ge=1, le=1023)
    """model.arch t5: the first decoder stage (Megatron's pipeline_model_parallel_split_rank): the
    encoder's layers spread over stages [0, split), the decoder's over [split, pp). None: where
    pipeline_layers (encoder stages first), else an even split of all the layers, puts the
    boundary: pp // 2 for an encoder and decoder of equal depth."""
    pipeline_schedule: Literal["1f1b", "all_forward_all_backward", "zb-h1", "zbv"] = "1f1b"
    """1f1b (interleaved when virtual_stages > 1) keeps at most pp micro-batches in flight;
    all_forward_all_backward (GPipe) keeps all of them. The zero-bubble schedules split each
    backward into the input gradient and the weight gradients, which fill 1F1B's idle slots
    (Qi et al. 2023), holding at most pp micro-batches on every stage: zb-h1 (one chunk per stage;
    a third of 1F1B's bubble) and zbv (virtual_stages 2 laid out in a V; bubble near zero)."""
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    """Shard fp32 main weights and Adam states over dp (ZeRO-1); gradients are reduce-scattered."""
    overlap_grad_reduce: bool = True
    """Reduce each gradient bucket as soon as backward fills it."""
    grad_bucket_elements: int = Field(40_000_000, ge=1, le=1 << 40)
    """Elements per data-parallel gradient bucket."""
    moe_overlap_chunks: int = Field(1, ge=1, le=8)
    """Under ep > 1, each MoE layer's tokens split into this many chunks so that one chunk's
    all-to-alls (dispatch, combine; forward and backward) run while another's experts compute
    (Megatron's --overlap-moe-expert-parallel-comm); 1: no overlap. With moe_dispatch nodes, the
    hop across nodes is pipelined behind the node hop and the experts. Under `parallelism: auto`
    the planner picks 1, 2 or 4, whichever it predicts fastest."""
    moe_overlap_microbatches: bool = False
    """Under ep > 1, two micro-batches in flight: one's forward and the one before's backward take
    turns on each rank, each running while the other waits on an all-to-all (DualPipe's overlap,
    Megatron's combined 1F1B; engine.parallel.lanes). Holds two micro-batches' activations instead
    of one (one more on each pipeline stage, 1F1B's steady pairs); needs pipeline_schedule 1f1b
    with virtual_stages 1, pp + 1 micro-batches per step or more and dropout 0."""
    moe_dispatch: Literal["pairs", "nodes"] = "pairs"
    """How tokens reach their experts under ep > 1. pairs: one row per routed (token, expert) pair,
    one all-to-all each way. nodes: DeepSeek-V3's two hops, each token once to every node holding
    one of its experts, then once to every rank there, the weighted sums made where the experts
    are; a token crosses nodes at most once per node (with node-limited routing,
    model.moe.router_num_groups = the nodes, at most router_group_topk times). Under
    `parallelism: auto` the planner picks nodes where an ep group spans nodes and it predicts
    that faster than the pairs dispatch (each in 1, 2 or 4 chunks)."""

    @field_validator("dp", mode="before")
    @classmethod
    def _dp(cls, v: object) -> object:
        # One message for every bad value, instead of one per branch of the int | 'auto' union.
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise ValueError("parallelism.dp must be 'auto' or an integer in [1, 65536]")
        try:
            n = int(v)
        except ValueError:
            raise ValueError("parallelism.dp must be 'auto' or an integer in [1, 65536]") from None
        if not 1 <= n <= 65536:
            raise ValueError("parallelism.dp must be 'auto' or an integer in [1, 65536]")
        return n


class ResourcesSpec(Strict):
    pool: str = Field("default", pattern=NAME_PATTERN)
    devices: int | None = Field(None, ge=1, le=65536, validation_alias=AliasChoices("devices", "gpus"))
    """Processes the job asks for, one per device (a GPU, or a CPU slot on a CPU pool); None means
    tp·pp·cp·dp."""
    priority: int = Field(0, ge=-1000, le=1000)
    max_runtime_s: int = Field(86400, ge=1, le=30 * 86400)
    max_retries: int = Field(2, ge=0, le=100)
    preemptible: bool = True
    """Whether a queued job of strictly higher priority may preempt this one: it is checkpointed at
    a step boundary, stopped and requeued (not counted as a retry), and resumes from there."""
    max_preemptions: int = Field(10, ge=0, le=1000)
    """How many times it may be preempted; after that it is no longer a preemption candidate and
    runs to its end (its max_retries is never touched by preemptions)."""

    @model_validator(mode="before")
    @classmethod
    def _one_name_for_devices(cls, data: Any) -> Any:
        if isinstance(data, dict) and "devices" in data and "gpus" in data:
            raise ValueError(
                "resources.devices is given twice, also as resources.gpus (its older name): give one"
            )
        return data
