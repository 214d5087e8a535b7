"""JobSpec: the one contract shared by the API, the scheduler, the worker and the engine.

Every rule of a spec's own fields is checked here, and the rules between a spec and its parallel
layout in megatrain.plan.layout (`resolve_layout`), before anything runs, each with a message that
names the field and the rule; `parse_spec` reports all of them at once (megatrain.spec_errors).
Engine-internal configs are derived from this tree, never kept by hand beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationInfo, field_validator, model_validator

from megatrain.secret_names import check_secret_names
from megatrain.spec_attention import AttentionBackend, dropout_problem, precision_problem
from megatrain.spec_base import NAME_PATTERN  # noqa: F401  (re-exported)
from megatrain.spec_base import Strict as _Strict
from megatrain.spec_base import rule as _rule
from megatrain.spec_data import (  # noqa: F401  (re-exported: the spec's sections live beside it)
    JSONL_SUFFIXES,
    TOKENIZER_KINDS,
    DataSource,
    DataSpec,
    TokenizerSpec,
    parse_tokenizer,
)
from megatrain.spec_dpo import DPOSpec, dpo_problems
from megatrain.spec_errors import (
    Findings,
    Problem,
    SpecError,
    collect_errors,
    report_rules,
)
from megatrain.spec_eval import EvalSpec
from megatrain.spec_families import BertSpec, T5Spec, bert_job_problems, family_problems, t5_job_problems
from megatrain.spec_layout import ParallelismSpec, ResourcesSpec
from megatrain.spec_lora import LoRASpec, absent_targets
from megatrain.spec_moe import MoESpec
from megatrain.spec_rope import RopeScalingSpec  # noqa: F401  (re-exported)
from megatrain.spec_tracking import TrackingSpec, tracking_problems

# Bounds keep hostile numbers (1e30 layers) out long before a planner or a GPU sees them.
MAX_DIM = 1 << 17
MAX_MICRO_BATCH = 1 << 20
VOCAB_PAD_MULTIPLE = 128
"""The tokenizer's vocabulary is padded to this multiple: a friendly LM-head shape, divisible by tp."""


HF_URL_PREFIXES = ("file:///", "s3://", "/")


def _valid_init_from(text: str) -> bool:
    # hf: names a folder we can read (a hub id such as hf:gpt2 would need the network).
    kind, _, rest = text.partition(":")
    if kind == "hf":
        return rest.startswith(HF_URL_PREFIXES) and len(rest) > len("s3://")
    return kind == "checkpoint" and bool(rest)


class ModelSpec(_Strict):
    arch: Literal["gpt2", "llama", "bert", "t5"] = "llama"
    """gpt2: learned positions, LayerNorm, GELU, tied embeddings. llama: RoPE, RMSNorm, SwiGLU, GQA.
    bert: a bidirectional encoder with masked-LM (+ sentence-order) heads (model.bert). t5: an
    encoder-decoder with relative position buckets (model.t5)."""
    num_layers: int = Field(4, ge=1, le=1024)
    hidden_size: int = Field(256, ge=1, le=MAX_DIM)
    num_attention_heads: int = Field(8, ge=1, le=1024)
    num_query_groups: int | None = Field(None, ge=1, le=1024)
    """Key/value heads (GQA); None means one per attention head (plain multi-head attention)."""
    ffn_hidden_size: int | None = Field(None, ge=1, le=1 << 20)
    """None: 4·hidden for gpt2; for llama 8/3·hidden rounded up to a multiple of 64."""
    seq_length: int = Field(256, ge=1, le=1 << 20)
    vocab_size: int | None = Field(None, ge=1, le=1 << 22)
    """The model's vocabulary (at least the tokenizer's); None: the tokenizer's. The embedding and
    LM head have it rounded up to a multiple of 128 rows."""
    hidden_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    attention_backend: AttentionBackend = "auto"
    """The attention kernel. auto: flash-attn where installed and usable (a CUDA GPU, fp16/bf16, head
    dim a multiple of 8 up to 256), else torch's SDPA. sdpa: torch's scaled_dot_product_attention.
    flash: flash-attn 2 (or 3), dense causal and varlen over packed documents. te: Transformer Engine's
    fused attention. flex: torch's flex_attention with a causal / per-document block mask. flash and te
    need the gpu extra (`pip install megatrain[gpu]`) on the workers."""
    norm_eps: float = Field(1e-5, gt=0.0, le=1e-1)
    rope_theta: float = Field(10000.0, gt=0.0, le=1e9)
    rope_scaling: RopeScalingSpec | None = None
    """None: plain RoPE; else linear or llama3 scaling of the rotary frequencies."""
    qkv_bias: bool | None = None
    """Biases on the query/key/value projection (Qwen2); None: as the arch (gpt2 has biases everywhere)."""
    tie_embeddings: bool | None = None
    """None: tied for gpt2, untied for llama."""
    init_method_std: float = Field(0.02, gt=0.0, le=1.0)
    activation: Literal["gelu", "swiglu", "geglu"] | None = None
    """The MLP's activation; None: the arch's (gelu for gpt2, swiglu for llama). swiglu and geglu
    (tanh-approximated GELU gate, as Gemma's) fuse gate and up in fc1 (2·ffn_hidden_size wide);
    geglu is for dense models (experts run swiglu or gelu)."""
    moe: MoESpec | None = None
    """Mixture of experts (megatrain/spec_moe.py); None: every layer has a dense MLP."""
    bert: BertSpec | None = None
    """arch bert only: its heads and norm order (megatrain/spec_families.py); None: the defaults."""
    t5: T5Spec | None = None
    """arch t5 only: the decoder and relative positions (megatrain/spec_families.py); None: defaults."""
    init_from: str | None = Field(None, max_length=1024)
    """null | checkpoint:JOB_ID[@STEP] | hf:URL (a Hugging Face model folder: config.json and
    safetensors, as file:///abs/path or s3://bucket/prefix)."""
    adapter_from: str | None = Field(None, max_length=1024)
    """training.method lora or qlora: hf:URL of a PEFT LoRA folder (adapter_config.json and
    adapter_model.safetensors, file:///abs/path or s3://bucket/prefix), or checkpoint:JOB_ID[@STEP]
    of a LoRA job trained on this model.init_from, whose adapters the run starts from instead of
    fresh ones (its rank, alpha, targets and rsLoRA must be training.lora's)."""

    @model_validator(mode="after")
    def _shapes(self, info: ValidationInfo) -> ModelSpec:
        out: list[Problem] = []
        if self.hidden_size % self.num_attention_heads:
            out.append(
                _rule(
                    "model.hidden_size",
                    f"model.hidden_size={self.hidden_size} is not divisible by "
                    f"model.num_attention_heads={self.num_attention_heads}",
                )
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            out.append(
                _rule(
                    "model.num_attention_heads",
                    f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                    f"model.num_query_groups={groups}",
                )
            )
        if self.rope_scaling is not None and self.arch != "llama":
            why = "model.rope_scaling is only for arch llama (gpt2 and bert learn positions, t5 buckets them)"
            out.append(_rule("model.rope_scaling", why))
        out += family_problems(self)
        if self.activation == "geglu" and self.moe is not None:
            out.append(
                _rule(
                    "model.activation",
                    "model.activation geglu is for dense models (experts run swiglu or gelu)",
                )
            )
        attention = dropout_problem(self.attention_backend, self.attention_dropout)
        if attention:
            out.append(_rule("model.attention_backend", attention))
        if self.adapter_from is not None and not _valid_init_from(self.adapter_from):
            why = (
                "model.adapter_from must be null, hf:URL (a PEFT folder: file:///abs/path or "
                "s3://bucket/prefix) or checkpoint:JOB_ID[@STEP] (a LoRA job's adapters)"
            )
            out.append(_rule("model.adapter_from", why))
        if self.init_from is not None and not _valid_init_from(self.init_from):
            out.append(
                _rule(
                    "model.init_from",
                    "model.init_from must be null, checkpoint:JOB_ID[@STEP] or hf:URL "
                    "(file:///abs/path or s3://bucket/prefix of a Hugging Face model folder)",
                )
            )
        report_rules(info, out)
        return self

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.arch != "llama":
            return 4 * self.hidden_size
        return ((8 * self.hidden_size // 3) + 63) // 64 * 64

    @property
    def mlp_activation(self) -> str:
        """The activation the model runs: the spec's, else the arch's."""
        if self.arch == "t5":
            return "geglu" if self.t5_block.feed_forward == "gated-gelu" else "relu"
        return self.activation or ("gelu" if self.arch in ("gpt2", "bert") else "swiglu")

    @property
    def tied(self) -> bool:
        if self.tie_embeddings is not None:
            return self.tie_embeddings
        return self.arch in ("gpt2", "bert") or (self.arch == "t5" and self.t5_block.feed_forward == "relu")

    @property
    def bert_block(self) -> BertSpec:
        """model.bert, or its defaults."""
        return self.bert or BertSpec()

    @property
    def t5_block(self) -> T5Spec:
        """model.t5, or its defaults."""
        return self.t5 or T5Spec()

    def padded_vocab(self, tokenizer_vocab: int) -> int:
        """The embedding rows: the model's vocabulary (vocab_size if given, at least the tokenizer's;
        else the tokenizer's) rounded up to a multiple of VOCAB_PAD_MULTIPLE, so that every power-of-two
        tp divides it (GPT-2's 50257 becomes 50304 rows). Rows past the vocabulary are padding."""
        if self.vocab_size is not None:
            if self.vocab_size < tokenizer_vocab:
                why = f"model.vocab_size={self.vocab_size} is smaller than the tokenizer's vocabulary"
                raise SpecError([_rule("model.vocab_size", f"{why} ({tokenizer_vocab})")])
            tokenizer_vocab = self.vocab_size
        return -(-tokenizer_vocab // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


class TrainingSpec(_Strict):
    train_iters: int = Field(200, ge=1, le=100_000_000)
    global_batch_size: int = Field(16, ge=1, le=1 << 24)
    micro_batch_size: int | Literal["auto"] = 4
    """Samples per forward/backward on one rank; the step accumulates global_batch_size /
    (micro_batch_size × dp) of them. A number (1 to 1048576) is kept as written, under parallelism
    auto too. auto: the planner picks it with the layout (the fastest that fits the pool); where no
    planner runs (a pool whose memory is unknown, the engine on its own), the largest of 4, 3, 2, 1
    that splits the batch. The stored job holds the number (POST /v1/spec/validate's `auto` says
    which)."""
    lr: float = Field(3e-4, gt=0.0, le=10.0)
    min_lr: float = Field(0.0, ge=0.0, le=10.0)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_iters: int = Field(0, ge=0, le=100_000_000)
    weight_decay: float = Field(0.1, ge=0.0, le=10.0)
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.95, ge=0.0, lt=1.0)
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0)
    clip_grad: float = Field(1.0, ge=0.0, le=1e6)
    """Global gradient-norm clip; 0 disables it."""
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    """bf16/fp16 keep low-precision model weights and fp32 main weights in the optimizer. auto: bf16
    where the device runs it natively (a GPU with bf16, a CPU with AVX512-BF16/AMX), else fp32.
    fp8 is bf16 with the transformer layers' linear GEMMs (forward and both backward) in float8
    with dynamic scaling, through torchao (real float8 GEMMs on GPUs of compute capability 8.9+,
    emulated elsewhere); the embedding, LM head, BERT's heads, MoE router and experts stay bf16.
    Needs the linear layers' widths per tensor-parallel shard and a micro-batch's tokens (a T5's
    encoder and decoder tokens) divisible by 16, and the torchao package (or transformer_engine:
    fp8_backend)."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """precision fp8 only: torchao's scaling recipe. tensorwise: one scale per tensor (fastest);
    rowwise: one per row, e4m3 gradients, power-of-two scales (more accurate, slower)."""
    fp8_backend: Literal["torchao", "te"] = "torchao"
    """precision fp8 only: torchao's float8 training (any device; emulated off GPUs of compute
    capability 8.9+), or NVIDIA Transformer Engine's te.Linear (CUDA; the transformer_engine
    package; tensorwise only, as Float8CurrentScaling)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute: selective (the attention core) or full (whole transformer layers)."""
    recompute_every: int = Field(1, ge=1, le=100_000)
    """With recompute=full, recompute every k-th layer (1 = every layer)."""
    compile: bool = False
    """torch.compile each transformer layer (fuses norms, RoPE, activations and residual adds);
    the first steps pay the compilation."""
    initial_loss_scale: float = Field(65536.0, ge=1.0, le=2.0**32)
    """fp16 only: the dynamic loss scaler's starting scale."""
    min_loss_scale: float = Field(1.0, ge=1e-8, le=2.0**32)
    loss_scale_window: int = Field(1000, ge=1, le=1_000_000)
    """fp16 only: steps without overflow before the scale doubles."""
    hysteresis: int = Field(2, ge=1, le=1000)
    """fp16 only: overflowing steps tolerated before the scale halves."""
    checkpoint_interval: int = Field(50, ge=0, le=100_000_000)
    """Save every N iterations (and always at the end); 0 saves only at the end."""
    async_checkpoint: bool = True
    """Write checkpoints in the background: training pauses only to copy the state to host memory."""
    checkpoint_keep_last: int = Field(0, ge=0, le=1_000_000)
    """Keep only the newest N checkpoints (deleting older ones from storage); 0 keeps all."""
    checkpoint_keep_every: int = Field(0, ge=0, le=100_000_000)
    """With checkpoint_keep_last, also keep every checkpoint whose step is a multiple of N forever."""
    log_interval: int = Field(10, ge=1, le=100_000_000)
    profile_steps: int = Field(0, ge=0, le=20)
    """torch.profiler's Chrome traces of N steps, one per rank (GET /v1/jobs/{id}/profile)."""
    eval_interval: int = Field(100, ge=0, le=100_000_000)
    """Validate every N iterations; 0 disables validation."""
    eval_iters: int = Field(4, ge=1, le=100_000)
    eval_tasks: list[str] = Field(default_factory=list, max_length=64)
    """lm-eval task YAML files (as an eval job's eval.tasks) scored on the training ranks themselves
    every eval_interval iterations and at the end (only at the end when eval_interval is 0); the
    scores join the metrics (GET /v1/jobs/{id}/results keeps every step's)."""
    eval_tasks_limit: int | None = Field(default=None, ge=1)
    """At most this many items of each of eval_tasks (None: all of them)."""
    seed: int = Field(1234, ge=0, le=2**31 - 1)
    method: Literal["full", "lora", "qlora"] = "full"
    """full: every weight trains. lora: the model is frozen and low-rank adapters on its linears
    train (training.lora, PEFT's LoRA): gradients, gradient buffers and optimizer state exist for
    the adapters only. qlora: lora with the frozen base linears held in NF4 (QLoRA, Dettmers et
    al. 2023; torchao's NF4 tensor, dequantised per GEMM: about 0.53 bytes per base weight)."""
    lora: LoRASpec | None = None
    """method lora or qlora only: the adapters (None: LoRASpec's defaults, rank 16, alpha 32, every
    target)."""
    dpo: DPOSpec | None = None
    """kind dpo only: the preference loss (None: DPOSpec's defaults, sigmoid with beta 0.1). A dpo
    job's batch sizes count sequences, a chosen and a rejected one per pair (so both are even and a
    pair never straddles two micro-batches); the loss is the mean over the global batch's pairs."""

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _micro_batch_size(cls, v: object) -> object:
        # One message for every bad value, instead of one per branch of the int | 'auto' union.
        if v == "auto":
            return v
        bad = f"training.micro_batch_size must be 'auto' or an integer in [1, {MAX_MICRO_BATCH}]"
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise ValueError(bad)
        try:
            n = int(v)
        except ValueError:
            raise ValueError(bad) from None
        if not 1 <= n <= MAX_MICRO_BATCH:
            raise ValueError(bad)
        return n

    @model_validator(mode="after")
    def _batches(self, info: ValidationInfo) -> TrainingSpec:
        out: list[Problem] = []
        if isinstance(self.micro_batch_size, int) and self.global_batch_size % self.micro_batch_size:
            out.append(
                _rule(
                    "training.global_batch_size",
                    f"training.global_batch_size={self.global_batch_size} is not divisible by "
                    f"training.micro_batch_size={self.micro_batch_size}",
                )
            )
        if self.warmup_iters > self.train_iters:
            out.append(
                _rule(
                    "training.warmup_iters",
                    f"training.warmup_iters={self.warmup_iters} exceeds "
                    f"training.train_iters={self.train_iters}",
                )
            )
        if self.min_loss_scale > self.initial_loss_scale:
            out.append(
                _rule(
                    "training.min_loss_scale",
                    f"training.min_loss_scale={self.min_loss_scale} exceeds "
                    f"training.initial_loss_scale={self.initial_loss_scale}",
                )
            )
        if self.lora is not None and self.method == "full":
            why = "training.lora is set but training.method is 'full' (set it to 'lora' or 'qlora')"
            out.append(_rule("training.lora", why))
        if self.method == "qlora" and self.precision == "fp8":
            why = "training.method qlora keeps an NF4 base: precision fp8 has no NF4 GEMMs (use bf16)"
            out.append(_rule("training.method", why))
        if self.min_lr > self.lr:
            out.append(
                _rule("training.min_lr", f"training.min_lr={self.min_lr} exceeds training.lr={self.lr}")
            )
        report_rules(info, out)
        return self


class JobSpec(_Strict):
    name: str = Field(..., pattern=NAME_PATTERN)
    kind: Literal["pretrain", "finetune", "dpo", "serve", "eval"] = "pretrain"
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    parallelism: Annotated[ParallelismSpec | Literal["auto"], Field(union_mode="left_to_right")] = "auto"
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    secrets: list[str] = Field(default_factory=list, max_length=32)
    eval: EvalSpec | None = None
    """kind eval only: the lm-eval tasks to score model.init_from on (megatrain.spec_eval)."""
    tracking: TrackingSpec | None = None
    """TensorBoard, W&B and MLflow: rank 0 logs the dashboard's series there (megatrain.spec_tracking)."""

    _secret_names = field_validator("secrets")(check_secret_names)

    @model_validator(mode="after")
    def _cross_field(self, info: ValidationInfo) -> JobSpec:
        out: list[Problem] = []
        if self.kind in ("finetune", "dpo", "serve", "eval") and not self.model.init_from:
            out.append(_rule("model.init_from", f"model.init_from is required when kind is '{self.kind}'"))
        # A model server reads no data; an eval job reads its tasks' items, and data only to measure
        # its perplexity (eval.perplexity).
        no_data = self.kind == "serve" or (self.kind == "eval" and not (self.eval and self.eval.perplexity))
        if no_data == bool(self.data.train):
            why = f"kind {self.kind} reads no data: leave data.train empty" if self.data.train else ""
            if why and self.kind == "eval":
                why = "kind eval reads data only to measure eval.perplexity: leave data.train empty"
            out.append(_rule("data.train", why or "data.train needs at least 1 item (a path or a dataset)"))
        if no_data and self.data.valid:
            out.append(_rule("data.valid", f"kind {self.kind} reads no data: leave data.valid empty"))
        if (self.kind == "eval") != (self.eval is not None):
            why = f"eval is set but kind is '{self.kind}'" if self.eval else "kind eval needs eval.tasks"
            out.append(_rule("eval", why))
        elif self.eval is not None and not (self.eval.tasks or self.eval.perplexity):
            out.append(_rule("eval", "eval needs tasks or perplexity (splits of data to measure)"))
        lora = self.training.lora
        if lora is not None and self.training.method != "full" and "targets" in lora.model_fields_set:
            absent = absent_targets(lora.targets, self.model.moe, self.model.num_layers)
            if absent:
                what = (
                    "no routed experts (model.moe is not set)"
                    if "experts" in absent
                    else ("no dense MLP and no shared expert (use experts)")
                )
                why = f"training.lora.targets names {', '.join(absent)}, but the model has {what}"
                out.append(_rule("training.lora.targets", why))
        if self.model.adapter_from and self.training.method == "full":
            why = "model.adapter_from needs training.method lora or qlora (it starts the adapters)"
            out.append(_rule("model.adapter_from", why))
        out += tracking_problems(self.kind, self.tracking)
        report_rules(info, out)
        return self

    @model_validator(mode="after")
    def _preference(self, info: ValidationInfo) -> JobSpec:
        report_rules(info, dpo_problems(self) + bert_job_problems(self) + t5_job_problems(self))
        return self

    @model_validator(mode="after")
    def _attention_precision(self, info: ValidationInfo) -> JobSpec:
        problem = precision_problem(self.model.attention_backend, self.training.precision)
        if problem:
            report_rules(info, [_rule("model.attention_backend", problem)])
        return self

    @property
    def packing(self) -> bool:
        """Whether samples pack documents with attention blocked between them (data.packing resolved;
        never for dpo, whose rows are single sequences)."""
        return self.kind == "finetune" if self.data.packing is None else self.data.packing


JOB_SECTIONS = tuple(JobSpec.model_fields)
SPEC_PLACEHOLDERS: dict[str, Any] = {"name": "unnamed", "data": {"train": [{"dataset": "unnamed"}]}}
"""Valid stand-ins for the required top-level fields, so the rest of a spec missing one (or with
a bad one) can still be judged; its field is then unknown, so no rule judges the stand-in."""


def check_spec(data: dict[str, Any], findings: Findings | None = None) -> tuple[JobSpec | None, Findings]:
    """(the spec, every error it has): the spec is built with defaults standing in for failing
    values (listed in `findings.unknown`), or None when even that fails."""
    findings = findings if findings is not None else Findings(JOB_SECTIONS)
    spec = collect_errors(JobSpec, data, SPEC_PLACEHOLDERS, findings)
    return spec, findings


def parse_spec(data: Any) -> JobSpec:
    """Validate a dict into a JobSpec, raising SpecError with every error, each naming its field."""
    if not isinstance(data, dict):
        raise SpecError([{"field": "spec", "message": "a job spec must be a mapping (YAML or JSON object)"}])
    spec, findings = check_spec(data)
    findings.raise_if_any()
    if spec is None:  # unreachable: a spec that cannot be built has an error
        raise SpecError([{"field": "spec", "message": "not a valid job spec"}])
    return spec


def load_spec(path: str | Path) -> JobSpec:
    """Read a spec from a YAML or JSON file (YAML is a superset, so one parser serves both)."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError([{"field": "spec", "message": f"not valid YAML/JSON: {exc}"}]) from None
    return parse_spec(data)


def spec_json_schema() -> dict[str, Any]:
    return JobSpec.model_json_schema()


def dump_spec(spec: JobSpec) -> str:
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True)
