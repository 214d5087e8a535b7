"""Engine configs derived from the JobSpec: each component gets its slice, nothing is kept by hand.

`TransformerConfig` is what the model needs; `TrainConfig` what the training loop needs. Both are
built by pure functions of (spec, tokenizer vocabulary, layout), so tests need no torch for them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from megatrain.spec import JobSpec, ModelSpec
from megatrain.spec_dpo import DPOSpec
from megatrain.spec_lora import LoRASpec, lora_targets_of

if TYPE_CHECKING:  # models.t5 imports torch; this module stays torch-free
    from megatrain.engine.models.t5 import T5Config


def padded_vocab_size(tokenizer_vocab: int, requested: int | None = None) -> int:
    """The embedding rows for a tokenizer (see ModelSpec.padded_vocab, which owns the rule)."""
    return ModelSpec(vocab_size=requested).padded_vocab(tokenizer_vocab)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts model's routing and expert shapes (megatrain.spec_moe.MoESpec, with the
    expert width resolved)."""

    num_experts: int
    router_topk: int
    ffn_hidden_size: int
    """Each routed expert's MLP width."""
    layer_freq: int = 1
    """Layers i with i % layer_freq == 0 are MoE; the others keep the dense MLP."""
    shared_expert_ffn_hidden_size: int | None = None
    shared_expert_gate: bool = False
    """The shared expert's output scaled by sigmoid(gate(x)) (Qwen2-MoE)."""
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    router_pre_softmax: bool = False
    """softmax only: the top-k probabilities as they are (True) or renormalised over the k (False)."""
    router_num_groups: int | None = None
    router_group_topk: int | None = None
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None
    """None: dropless."""

    def is_moe_layer(self, layer: int) -> bool:
        return layer % self.layer_freq == 0


@dataclass(frozen=True)
class DPOConfig:
    """Preference training's loss (megatrain.spec_dpo.DPOSpec; engine.dpo computes it)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (megatrain.spec_lora.LoRASpec; engine.lora attaches them)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
    use_rslora: bool = False
    quantize_base: bool = False
    """QLoRA: the dense layers' base linear weights are held in NF4 (engine.lora.quantize_nf4)."""

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.use_rslora else self.rank)

    def num_params(self, m: TransformerConfig) -> int:
        """The adapters' parameters over the whole model: per target linear (in → out) split into
        `parts` Hugging Face linears (engine.lora), parts·r·in for A and r·out for B; on an MoE
        layer its shared expert's fc1/fc2, and r·(in + out) per expert on each stacked weight."""
        c, f, hd, r = m.hidden_size, m.ffn_hidden_size, m.head_dim, self.rank
        qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * hd
        qkv_parts = 1 if m.position_embedding == "learned" else 3
        attention = {"qkv": (c, qkv_out, qkv_parts), "proj": (c, c, 1)}

        def mlp(ffn: int) -> dict[str, tuple[int, int, int]]:
            return {"fc1": (c, 2 * ffn, 2) if m.gated_mlp else (c, ffn, 1), "fc2": (ffn, c, 1)}

        total = 0
        for layer in range(m.num_layers):
            shapes = dict(attention)
            if m.moe is None or not m.moe.is_moe_layer(layer):
                shapes |= mlp(f)
            else:
                if m.moe.shared_expert_ffn_hidden_size is not None:
                    shapes |= mlp(m.moe.shared_expert_ffn_hidden_size)
                if "experts" in self.targets:
                    fe = m.moe.ffn_hidden_size
                    total += m.moe.num_experts * r * ((c + (2 * fe if m.gated_mlp else fe)) + (fe + c))
            for target in self.targets:
                if target in shapes:
                    n_in, n_out, parts = shapes[target]
                    total += r * (parts * n_in + n_out)
        return total


@dataclass(frozen=True)
class TransformerConfig:
    """Everything `GPTModel` needs; the arch flavour is spelled out as explicit choices
    (FLAVOURS), and `preset()` names the tiny models tests and benchmarks share."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads; equal to num_attention_heads for plain multi-head attention."""
    ffn_hidden_size: int
    seq_length: int
    vocab_size: int
    """Padded embedding rows (>= the tokenizer's vocabulary)."""
    vocab_size_unpadded: int | None = None
    """The real vocabulary (a Hugging Face config's vocab_size, or the tokenizer's); rows beyond it
    are padding. None: vocab_size."""
    position_embedding: Literal["learned", "rope"] = "rope"
    normalization: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    activation: Literal["gelu", "swiglu", "geglu"] = "swiglu"
    """swiglu and geglu (gated_mlp) fuse gate and up in fc1; geglu's gate is tanh-approximated GELU."""
    add_bias: bool = False
    """Biases on every Linear (GPT-2) or none (Llama)."""
    qkv_bias: bool | None = None
    """Biases on the qkv projection only (Qwen2); None: add_bias's value."""
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """None, {"type": "linear", "factor"} or {"type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"} (Hugging Face's rope types)."""
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_backend: str = "auto"
    """The `attention` kernel's backend (megatrain.spec_attention): auto, sdpa, flash, te or
    flex; MEGATRAIN_KERNELS overrides it."""
    moe: MoEConfig | None = None
    """None: a dense model."""
    hf_family: str | None = None
    """The Hugging Face model_type the weights came from (an import, a fine-tune of one): an export
    keeps it where the shape alone would say otherwise (mistral, not llama). Computes nothing."""
    bidirectional: bool = False
    """An encoder (BERT): every token attends to its whole segment, before and after it."""
    post_layernorm: bool = False
    """The original BERT's order: a norm after each residual add and after the embeddings, no final
    norm (False: the pre-norm blocks and final norm Megatron's BERT and every GPT use)."""
    num_tokentypes: int = 0
    """Token-type (sentence A/B) embeddings added to the input (BERT: 2); 0: none."""
    binary_head: bool = False
    """BERT's pooler (tanh of a linear of the first token) and two-way classifier (NSP / SOP)."""
    masked_lm: bool = True
    """An encoder's masked-LM head (pretraining); False: a sequence classifier, which has none."""
    num_classes: int = 2
    """The binary head's outputs: 2 for sentence order, the labels of a classification fine-tune."""
    gelu_approximate: Literal["tanh", "none"] = "tanh"
    """The GELU MLP's form: tanh (GPT-2's gelu_new) or none (the exact erf GELU: BERT's)."""

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from_dict / a checkpoint's model_config
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError("num_attention_heads must be divisible by num_query_groups")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError("rotary embeddings need an even head dimension")
        if self.activation == "geglu" and self.moe is not None:
            raise ValueError("geglu is for dense models: experts run swiglu or gelu")
        if self.vocab_size_unpadded is not None and not 0 < self.vocab_size_unpadded <= self.vocab_size:
            raise ValueError(f"vocab_size_unpadded={self.vocab_size_unpadded} must be in [1, vocab_size]")
        if (self.post_layernorm or self.num_tokentypes or self.binary_head) and not self.bidirectional:
            raise ValueError("post_layernorm, token types and the binary head are for encoders (BERT)")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type")
            missing = [k for k in ROPE_SCALING_KEYS.get(kind, ()) if k not in self.rope_scaling]
            if kind not in ROPE_SCALING_KEYS or missing:
                raise ValueError(f"rope_scaling {self.rope_scaling} is not linear or llama3 with its keys")

    @property
    def is_encoder(self) -> bool:
        """A BERT-family model (models.bert.BertModel): MLM and binary heads, bidirectional."""
        return self.bidirectional

    @property
    def has_qkv_bias(self) -> bool:
        return self.add_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def real_vocab_size(self) -> int:
        """The vocabulary without padding rows."""
        return self.vocab_size_unpadded or self.vocab_size

    @property
    def gated_mlp(self) -> bool:
        """fc1 computes [gate; up] (2·ffn_hidden_size wide): SwiGLU and GeGLU."""
        return self.activation in ("swiglu", "geglu")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): num_query_groups · head_dim."""
        return self.num_query_groups * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TransformerConfig:
        """A named configuration (PRESETS) with `overrides`; a GPT-2 flavour keeps one key/value
        group per head unless num_query_groups is given."""
        if name not in PRESETS:
            raise ValueError(f"no preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        fields = {**PRESETS[name], **overrides}
        if name.endswith("gpt2") and "num_query_groups" not in overrides:
            fields["num_query_groups"] = fields["num_attention_heads"]
        return cls(**fields)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        return cls(**data)


ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
"""The keys each rope-scaling type needs (megatrain.engine.models.gpt.rope_inv_freq applies them)."""

FLAVOURS: dict[str, dict[str, Any]] = {
    # Learned positions, LayerNorm, GELU MLP, biases, tied embeddings.
    "gpt2": {"position_embedding": "learned", "normalization": "layernorm", "activation": "gelu",
             "add_bias": True, "tie_embeddings": True},
    # RoPE, RMSNorm, SwiGLU MLP, no biases, an untied LM head (grouped-query attention by size).
    "llama": {"position_embedding": "rope", "normalization": "rmsnorm", "activation": "swiglu",
              "add_bias": False, "tie_embeddings": False},
    # GPT-2's shapes, bidirectional, with the exact (erf) GELU; norm order and heads: model.bert.
    "bert": {"position_embedding": "learned", "normalization": "layernorm", "activation": "gelu",
             "add_bias": True, "tie_embeddings": True, "bidirectional": True, "gelu_approximate": "none"},
}  # fmt: skip
_TINY = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
         "seq_length": 16, "vocab_size": 128}  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-gpt2": {**_TINY, **FLAVOURS["gpt2"], "num_query_groups": 4},  # ~21.8k parameters
    "tiny-llama": {**_TINY, **FLAVOURS["llama"], "num_query_groups": 2},
}


def transformer_config(spec: JobSpec, tokenizer_vocab: int) -> TransformerConfig:
    """The model slice of a spec, with the vocabulary padded for the tokenizer in use."""
    m = spec.model
    flavour = {**model_flavour(m), "activation": m.mlp_activation}
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        ffn_hidden_size=m.ffn_size,
        seq_length=m.seq_length,
        vocab_size=m.padded_vocab(tokenizer_vocab),
        vocab_size_unpadded=m.vocab_size if m.vocab_size is not None else tokenizer_vocab,
        **flavour,
        qkv_bias=m.qkv_bias,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        rope_scaling=m.rope_scaling.model_dump(exclude_none=True) if m.rope_scaling is not None else None,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        attention_backend=m.attention_backend,
        moe=moe_config(m),
    )


def t5_config(spec: JobSpec, tokenizer_vocab: int) -> T5Config:
    """The model slice of an arch t5 spec (models.t5.T5Config), the vocabulary padded as
    transformer_config pads it; the decoder's length is model.t5.decoder_seq_length (else the
    encoder's model.seq_length)."""
    from megatrain.engine.models.t5 import T5Config

    m, t5 = spec.model, spec.model.t5_block
    if m.arch != "t5":
        raise ValueError(f"model.arch {m.arch} is not t5")
    return T5Config(
        num_layers=m.num_layers,
        num_decoder_layers=t5.num_decoder_layers or m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        kv_channels=t5.kv_channels or m.head_dim,
        ffn_hidden_size=m.ffn_size,
        vocab_size=m.padded_vocab(tokenizer_vocab),
        vocab_size_unpadded=m.vocab_size if m.vocab_size is not None else tokenizer_vocab,
        relative_attention_num_buckets=t5.relative_attention_num_buckets,
        relative_attention_max_distance=t5.relative_attention_max_distance,
        activation=t5.feed_forward,
        tie_embeddings=m.tied,
        norm_eps=m.norm_eps,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        encoder_seq_length=m.seq_length,
        decoder_seq_length=t5.decoder_seq_length or m.seq_length,
    )


def model_config_from_dict(data: dict[str, Any]) -> TransformerConfig | T5Config:
    """A model config as a checkpoint records it (to_dict): a T5's has a decoder stack."""
    if "num_decoder_layers" in data:
        from megatrain.engine.models.t5 import T5Config

        return T5Config.from_dict(data)
    return TransformerConfig.from_dict(data)


def model_flavour(m: ModelSpec) -> dict[str, Any]:
    """TransformerConfig's arch choices for a model spec: the arch's FLAVOURS, its tying, and
    model.bert's heads and norm order."""
    if m.arch not in FLAVOURS:
        raise ValueError(f"model.arch {m.arch} is not a TransformerConfig model")
    flavour = {**FLAVOURS[m.arch], "tie_embeddings": m.tied}
    if m.arch == "bert":
        b = m.bert_block
        flavour |= {"post_layernorm": b.post_layernorm, "num_tokentypes": b.num_tokentypes}
        flavour |= {"binary_head": b.binary_head}
        if b.num_labels is not None:  # a sequence classifier: no masked-LM head
            flavour |= {"binary_head": True, "masked_lm": False, "num_classes": b.num_labels}
    return flavour


def moe_config(model: ModelSpec) -> MoEConfig | None:
    """The model's MoE slice (also for a Hugging Face config's fields: interop.hf)."""
    moe = model.moe
    if moe is None:
        return None
    return MoEConfig(
        num_experts=moe.num_experts,
        router_topk=moe.router_topk,
        ffn_hidden_size=moe.ffn_hidden_size or model.ffn_size,
        layer_freq=moe.layer_freq,
        shared_expert_ffn_hidden_size=moe.shared_expert_ffn_hidden_size,
        shared_expert_gate=moe.shared_expert_gate,
        router_score_function=moe.router_score_function,
        router_pre_softmax=moe.router_pre_softmax,
        router_num_groups=moe.router_num_groups,
        router_group_topk=moe.router_group_topk,
        aux_loss_coeff=moe.aux_loss_coeff,
        z_loss_coeff=moe.z_loss_coeff,
        capacity_factor=moe.capacity_factor,
    )


@dataclass(frozen=True)
class TrainConfig:
    """The training-loop slice of a spec, resolved against the data-parallel degree (the batch
    divides into whole micro-batches: megatrain.plan.layout.batch_problems checked it at submission
    and again when the engine loaded the layout)."""

    train_iters: int
    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    seq_length: int
    lr: float
    min_lr: float
    lr_schedule: Literal["cosine", "linear", "constant"]
    warmup_iters: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    precision: Literal["auto", "fp32", "bf16", "fp16", "fp8"]
    """As the spec asks; the engine resolves auto (runtime.effective_precision) before building."""
    fp8_recipe: Literal["tensorwise", "rowwise"]
    fp8_backend: Literal["torchao", "te"]
    recompute: Literal["none", "selective", "full"]
    recompute_every: int
    compile: bool
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: int
    hysteresis: int
    checkpoint_interval: int
    log_interval: int
    eval_interval: int
    eval_iters: int
    seed: int
    lora: LoRAConfig | None = None
    """training.method lora: the adapters; None: every weight trains."""
    dpo: DPOConfig | None = None
    """kind dpo: the preference loss over pairs of sequences; None: the LM loss."""

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches each rank runs per iteration: global / (micro · dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def samples_per_rank(self) -> int:
        return self.global_batch_size // self.data_parallel_size


def train_config(spec: JobSpec, data_parallel_size: int) -> TrainConfig:
    """The training slice of a spec whose micro-batch size is a number (an auto one is resolved on
    the layout first: megatrain.plan.layout.with_micro_batch_size)."""
    t = spec.training
    if not isinstance(t.micro_batch_size, int):
        raise ValueError("training.micro_batch_size auto is resolved on the layout before the engine")
    return TrainConfig(
        train_iters=t.train_iters,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        data_parallel_size=data_parallel_size,
        seq_length=spec.model.seq_length,
        lr=t.lr,
        min_lr=t.min_lr,
        lr_schedule=t.lr_schedule,
        warmup_iters=t.warmup_iters,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        precision=t.precision,
        fp8_recipe=t.fp8_recipe,
        fp8_backend=t.fp8_backend,
        recompute=t.recompute,
        recompute_every=t.recompute_every,
        compile=t.compile,
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
        checkpoint_interval=t.checkpoint_interval,
        log_interval=t.log_interval,
        eval_interval=t.eval_interval,
        eval_iters=t.eval_iters,
        seed=t.seed,
        lora=lora_config(spec),
        dpo=dpo_config(spec),
    )


def dpo_config(spec: JobSpec) -> DPOConfig | None:
    """The preference loss of a dpo job, else None."""
    if spec.kind != "dpo":
        return None
    d = spec.training.dpo or DPOSpec()
    return DPOConfig(d.beta, d.loss_type, d.label_smoothing)


def lora_config(spec: JobSpec) -> LoRAConfig | None:
    """The adapters a spec trains (training.method lora), else None."""
    t = spec.training
    if t.method == "full":
        return None
    lora = t.lora or LoRASpec()
    targets = lora_targets_of(lora, spec.model.moe, spec.model.num_layers)
    return LoRAConfig(lora.rank, lora.alpha, lora.dropout, targets, lora.use_rslora, t.method == "qlora")
