"""The shapes that decide a model's memory and where its parameters sit: per layer, per pipeline stage
and tensor/expert-parallel rank. Pure (no torch), shared by the memory estimate and the planner.

A mixture-of-experts layer (every moe.layer_freq-th, from layer 0) replaces the dense MLP with a
router (a bias-free h → num_experts linear, replicated over tp), num_experts routed experts (each an
MLP of moe.ffn_hidden_size, split over tp like the dense MLP and over ep by whole experts) and an
optional shared expert (an MLP of shared_expert_ffn_hidden_size, split over tp, on every token).

A LoRA run (training.method lora, megatrain.engine.lora) freezes the whole model and adds adapters A
(parts·r, in) and B (out, r) to each target linear (on an MoE layer: attention and the shared
expert, and with target experts an adapter per routed expert on each stacked weight): parts is 3
for a Llama-family qkv (q, k, v), 1 for GPT-2's fused c_attn, 2 for a gated fc1 (gate, up). Under
tp each adapter is split like its base: column-parallel (qkv, fc1) B split and A replicated,
row-parallel (proj, fc2) A split and B replicated.

The encoder families (ModelShape.family, megatrain.plan.stacks for where their edges sit): "bert"
is GPT-2's layer (biases, LayerNorm, exact-GELU 4h MLP) attending both ways, with token-type
embeddings and the masked-LM and binary heads. "t5" is an encoder of num_layers layers over
seq_length tokens and a decoder of num_decoder_layers over decoder_seq_length, RMSNorm without
biases, heads of kv_channels (heads·kv_channels may differ from hidden_size); each decoder layer
adds cross-attention (q from the decoder, k and v from the encoder's output, its own norm).
Parameter counts equal transformers' BertForPreTraining and T5ForConditionalGeneration
(tests/plan/test_plan_families.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from megatrain.plan.stacks import (
    bert_edge_params,
    family_fields,
    stack_layers_on_stage,
    t5_config_fields,
    t5_edge_params,
)
from megatrain.plan.stages import layers_on_stage, moe_layers_on_stage

if TYPE_CHECKING:
    from megatrain.spec import JobSpec


BYTE_TOKENIZER_VOCAB = 257
"""The byte tokenizer's vocabulary: 256 byte values and end-of-document (engine/data/tokenizers.py)."""


@dataclass(frozen=True)
class MoEShape:
    """The expert shapes of an MoE model (ffn_hidden_size resolved, as MoEConfig has it)."""

    num_experts: int
    router_topk: int
    ffn_hidden_size: int
    """Each routed expert's MLP width."""
    layer_freq: int = 1
    shared_expert_ffn_hidden_size: int | None = None
    capacity_factor: float | None = None
    """None: dropless (every routed token computed); else each expert's buffer bound, × tokens·topk/E."""
    router_num_groups: int | None = None
    router_group_topk: int | None = None
    """A token's experts in its best group_topk of num_groups groups (links.routed_all_to_all_time)."""

    @classmethod
    def of(cls, moe: Any, dense_ffn: int) -> MoEShape | None:
        """From a MoESpec, MoEConfig, dict or MoEShape (None stays None); a None width is the dense one."""
        if moe is None or isinstance(moe, MoEShape):
            return moe
        get = moe.get if isinstance(moe, dict) else lambda k, d=None: getattr(moe, k, d)
        return cls(
            num_experts=get("num_experts"),
            router_topk=get("router_topk", 2),
            ffn_hidden_size=get("ffn_hidden_size") or dense_ffn,
            layer_freq=get("layer_freq", 1),
            shared_expert_ffn_hidden_size=get("shared_expert_ffn_hidden_size"),
            capacity_factor=get("capacity_factor"),
            router_num_groups=get("router_num_groups"),
            router_group_topk=get("router_group_topk"),
        )


@dataclass(frozen=True)
class LoRAShape:
    """A LoRA run's adapters (training.lora, the engine's LoRAConfig): what decides their size."""

    rank: int
    targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
    dropout: float = 0.0
    """> 0: each adapter saves its dropped input and mask (the base's input is not dropped)."""
    quantize_base: bool = False
    """QLoRA: the dense layers' frozen linear weights are held in NF4 (NF4_BYTES each)."""

    @classmethod
    def of(cls, lora: Any, quantize_base: bool | None = None) -> LoRAShape | None:
        """From a LoRASpec, LoRAConfig, dict or LoRAShape (None stays None)."""
        if lora is None or isinstance(lora, LoRAShape):
            return lora
        get = lora.get if isinstance(lora, dict) else lambda k, d=None: getattr(lora, k, d)
        nf4 = bool(get("quantize_base", False)) if quantize_base is None else quantize_base
        return cls(
            rank=get("rank"), targets=tuple(get("targets", cls.targets)), dropout=get("dropout", 0.0),
            quantize_base=nf4,
        )  # fmt: skip


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per NF4 weight (engine.lora.quantize_nf4: torchao's NF4, blocks of 64): 4 bits, an int8
scale per block, an fp32 factor per 256 scales."""


@dataclass(frozen=True)
class ModelShape:
    """The shapes that decide memory; built from a dict, a TransformerConfig or anything with these fields."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    """Padded embedding rows."""
    seq_length: int
    activation: Literal["gelu", "swiglu", "geglu", "relu"] = "swiglu"
    tie_embeddings: bool = False
    add_bias: bool = False
    position_embedding: Literal["learned", "rope", "relative"] = "rope"
    """relative: T5's bucketed position biases (no position embedding)."""
    normalization: Literal["layernorm", "rmsnorm"] | None = None
    """None: layernorm with GELU (GPT-2), rmsnorm with SwiGLU (Llama)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    moe: MoEShape | None = None
    """None: every layer has the dense MLP."""
    lora: LoRAShape | None = None
    """training.method lora: every weight above is frozen and only these adapters train; None: all train."""
    family: Literal["gpt", "bert", "t5"] = "gpt"
    """gpt: a causal decoder (gpt2, llama); bert: a two-way encoder and its heads; t5: encoder-decoder."""
    kv_channels: int | None = None
    """Each head's width; None: hidden_size / num_attention_heads."""
    num_decoder_layers: int = 0
    """T5's decoder layers (num_layers is the encoder's)."""
    decoder_seq_length: int | None = None
    """T5's decoder (target) length; None: seq_length."""
    relative_attention_num_buckets: int = 32
    """T5: rows of each stack's position-bias table (buckets × heads)."""
    num_tokentypes: int = 0
    """BERT's token-type embeddings."""
    binary_head: bool = False
    """BERT's pooler and two-way classifier."""
    post_layernorm: bool = False
    """BERT's original norm order: a norm after the embeddings instead of a final one."""

    def __post_init__(self) -> None:
        if self.moe is not None and not isinstance(self.moe, MoEShape):  # a dict, MoESpec or MoEConfig
            object.__setattr__(self, "moe", MoEShape.of(self.moe, self.ffn_hidden_size))
        if self.lora is not None and not isinstance(self.lora, LoRAShape):  # a dict, LoRASpec or LoRAConfig
            object.__setattr__(self, "lora", LoRAShape.of(self.lora))

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """From a dict, the engine's TransformerConfig (bidirectional: BERT) or T5Config, or anything
        with these fields."""
        if isinstance(model, ModelShape):
            return model
        names = [f.name for f in fields(cls)]
        if isinstance(model, dict):
            values = {k: model[k] for k in names if k in model}
        else:
            values = {k: getattr(model, k) for k in names if hasattr(model, k)}
        if "family" not in values and hasattr(model, "encoder_seq_length"):  # the engine's T5Config
            values |= t5_config_fields(model)
        elif "family" not in values and getattr(model, "bidirectional", False):
            values["family"] = "bert"
        return cls(**values)

    @property
    def norm(self) -> str:
        if self.normalization is not None:
            return self.normalization
        return "layernorm" if self.activation == "gelu" else "rmsnorm"

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """The queries' (and attention output's) width: hidden_size but where T5's kv_channels differ."""
        return self.num_attention_heads * self.head_dim

    @property
    def total_layers(self) -> int:
        """Every layer a pipeline splits: T5's encoder and decoder layers end to end."""
        return self.num_layers + self.num_decoder_layers

    @property
    def dec_seq_length(self) -> int:
        """T5's decoder length (seq_length where unset)."""
        return self.decoder_seq_length or self.seq_length

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    @property
    def fc1_width(self) -> int:
        return self.mlp_fc1_width(self.ffn_hidden_size)

    def mlp_fc1_width(self, ffn: int) -> int:
        """fc1's output width for an MLP of width `ffn`: [gate; up] under SwiGLU and GeGLU."""
        return 2 * ffn if self.activation in ("swiglu", "geglu") else ffn

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer % self.moe.layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.moe is None else -(-self.num_layers // self.moe.layer_freq)


def shape_of_spec(spec: JobSpec, tokenizer_vocab: int) -> ModelShape:
    """The shapes of the model a spec builds (as megatrain.engine.config.transformer_config does)."""
    m = spec.model
    gpt2 = m.arch == "gpt2"
    flavour = family_fields(m) or {
        "num_query_groups": m.query_groups,
        "activation": m.mlp_activation,
        "tie_embeddings": m.tied,
        "add_bias": gpt2,
        "position_embedding": "learned" if gpt2 else "rope",
        "normalization": "layernorm" if gpt2 else "rmsnorm",
        "moe": MoEShape.of(m.moe, m.ffn_size),
    }
    return ModelShape(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_size,
        vocab_size=m.padded_vocab(tokenizer_vocab),
        seq_length=m.seq_length,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        lora=lora_of_spec(spec),
        **flavour,
    )


def lora_of_spec(spec: JobSpec) -> LoRAShape | None:
    """The adapters a spec trains (training.method other than full, as engine.config.lora_config
    decides; its lora block, else LoRASpec's defaults)."""
    t = spec.training
    if t.method == "full":
        return None
    from megatrain.spec_lora import LoRASpec  # (lazy: this module imports no pydantic model)

    return LoRAShape.of(t.lora or LoRASpec(), quantize_base=t.method == "qlora")


def mlp_params(m: ModelShape, ffn: int, tp: int) -> int:
    """One MLP of width `ffn` on a tensor-parallel rank: fc1 column-parallel (its bias split), fc2
    row-parallel (its bias replicated)."""
    h, fw = m.hidden_size, m.mlp_fc1_width(ffn)
    return (h * fw + ffn * h) // tp + ((fw // tp + h) if m.add_bias else 0)


def layer_params(m: ModelShape, tp: int, moe: bool = False, decoder: bool = False) -> int:
    """One transformer layer's parameters on a tensor-parallel rank (column/row splits of the
    linears), the routed experts excepted (expert_params): attention, norms and the dense MLP, or
    for an MoE layer (moe=True) its router and shared expert instead of the MLP. decoder: a T5
    decoder layer, with cross-attention (q, kv, proj: self-attention's shapes) and its norm."""
    h, q, kv = m.hidden_size, m.q_size, m.kv_size
    attention = (h * (q + 2 * kv) + q * h) // tp
    norm = h * (2 if m.norm == "layernorm" else 1)  # replicated over tp
    norms = 2 * norm
    if decoder:
        attention *= 2
        norms += norm
    if m.add_bias:
        # Column-parallel biases (qkv) are split; row-parallel ones (proj) are replicated.
        attention += (q + 2 * kv) // tp + h
    if not moe or m.moe is None:
        return attention + norms + mlp_params(m, m.ffn_hidden_size, tp)
    shared = m.moe.shared_expert_ffn_hidden_size
    router = h * m.moe.num_experts  # replicated over tp and ep
    return attention + norms + router + (mlp_params(m, shared, tp) if shared else 0)


def expert_params(m: ModelShape, tp: int, ep: int) -> int:
    """One MoE layer's routed experts on a (tensor, expert)-parallel rank: num_experts/ep whole
    experts, each split over tp like the dense MLP."""
    if m.moe is None:
        return 0
    return m.moe.num_experts // ep * mlp_params(m, m.moe.ffn_hidden_size, tp)


def stage_params(
    m: ModelShape,
    tp: int,
    pp: int,
    stage: int,
    pipeline_layers: Sequence[int] | None = None,
    ep: int = 1,
    virtual_stages: int = 1,
) -> dict[str, int]:
    """Parameters of one pipeline stage's (tensor, expert)-parallel rank, by part: "experts" holds
    the routed experts (sharded over ep, their gradients reduced over dp·cp/ep), the rest dp·cp's."""
    if m.family == "bert":
        n = layers_on_stage(m.num_layers, pp, stage, pipeline_layers)
        return {"layers": n * layer_params(m, tp)} | bert_edge_params(m, tp, pp, stage)
    if m.family == "t5":
        n_enc, n_dec = stack_layers_on_stage(m, pp, stage, pipeline_layers)
        layers = n_enc * layer_params(m, tp) + n_dec * layer_params(m, tp, decoder=True)
        return {"layers": layers} | t5_edge_params(m, tp, pp, stage, pipeline_layers)
    h, v = m.hidden_size, m.vocab_size
    first, last = stage == 0, stage == pp - 1
    n = layers_on_stage(m.num_layers, pp, stage, pipeline_layers)
    n_moe = moe_layers_on_stage(m, pp, stage, pipeline_layers, virtual_stages)
    parts = {"layers": (n - n_moe) * layer_params(m, tp) + n_moe * layer_params(m, tp, moe=True)}
    if n_moe:
        parts["experts"] = n_moe * expert_params(m, tp, ep)
    if first:
        parts["embedding"] = v * h // tp
        if m.position_embedding == "learned":
            parts["position_embedding"] = m.seq_length * h  # replicated over tp, as in Megatron
    if last:
        parts["final_norm"] = h * (2 if m.norm == "layernorm" else 1)
        # A tied head shares the embedding on a single stage; with pp > 1 the last stage keeps a
        # copy whose gradient is all-reduced with the first stage's (Megatron's word embeddings).
        if not m.tie_embeddings or pp > 1:
            parts["lm_head"] = v * h // tp
    return parts


def lora_linears(m: ModelShape, moe: bool = False) -> dict[str, tuple[int, int, int, bool]]:
    """Each LoRA target's (in, out, parts, column-parallel): the parts are the Hugging Face linears
    the fused one stands for (engine.lora.part_of_rows), one adapter each. On an MoE layer fc1 and
    fc2 are its shared expert's."""
    h, kv = m.hidden_size, m.kv_size
    qkv_parts = 1 if m.position_embedding == "learned" else 3  # GPT-2's c_attn is one linear
    fc1_parts = 2 if m.activation in ("swiglu", "geglu") else 1
    ffn = m.ffn_hidden_size
    if moe and m.moe is not None:
        ffn = m.moe.shared_expert_ffn_hidden_size or 0
    return {
        "qkv": (h, h + 2 * kv, qkv_parts, True),
        "proj": (h, h, 1, False),
        "fc1": (h, m.mlp_fc1_width(ffn), fc1_parts, True),
        "fc2": (ffn, h, 1, False),
    }


def lora_layer_targets(m: ModelShape, moe: bool = False) -> tuple[str, ...]:
    """The linears one layer carries adapters on: an MoE layer's fc1/fc2 are its shared expert's
    (none without one); its routed experts' adapters are lora_expert_params'."""
    if m.lora is None:
        return ()
    no_mlp = moe and m.moe is not None and m.moe.shared_expert_ffn_hidden_size is None
    return tuple(t for t in m.lora.targets if t != "experts" and not (no_mlp and t in ("fc1", "fc2")))


def lora_layer_params(m: ModelShape, tp: int, moe: bool = False) -> int:
    """One layer's adapters on a tensor-parallel rank: A (parts·r, in) and B (out, r) per target,
    A replicated and B split over a column-parallel base, A split and B replicated over a row-parallel one."""
    if m.lora is None:
        return 0
    r, total = m.lora.rank, 0
    for target in lora_layer_targets(m, moe):
        n_in, n_out, parts, column = lora_linears(m, moe)[target]
        total += parts * r * (n_in if column else n_in // tp) + r * (n_out // tp if column else n_out)
    return total


def lora_expert_params(m: ModelShape, tp: int, ep: int) -> int:
    """One MoE layer's routed-expert adapters on a (tensor, expert)-parallel rank (target experts):
    per expert A (r, h) and B (fc1 width / tp, r) on fc1, A (r, ffn / tp) and B (h, r) on fc2."""
    if m.lora is None or m.moe is None or "experts" not in m.lora.targets:
        return 0
    ffn = m.moe.ffn_hidden_size
    per_expert = m.lora.rank * (m.hidden_size + m.mlp_fc1_width(ffn) // tp + ffn // tp + m.hidden_size)
    return m.moe.num_experts // ep * per_expert


def lora_stage_params(
    m: ModelShape,
    tp: int,
    pp: int,
    stage: int,
    pipeline_layers: Sequence[int] | None = None,
    virtual_stages: int = 1,
    ep: int = 1,
) -> int:
    """The adapters of one pipeline stage's (tensor, expert)-parallel rank (0 without LoRA): the
    trainable parameters of a LoRA run."""
    if m.lora is None:
        return 0
    n = layers_on_stage(m.num_layers, pp, stage, pipeline_layers)
    n_moe = moe_layers_on_stage(m, pp, stage, pipeline_layers, virtual_stages)
    moe = lora_layer_params(m, tp, moe=True) + lora_expert_params(m, tp, ep)
    return (n - n_moe) * lora_layer_params(m, tp) + n_moe * moe


def nf4_stage_params(
    m: ModelShape,
    tp: int,
    pp: int,
    stage: int,
    pipeline_layers: Sequence[int] | None = None,
    virtual_stages: int = 1,
) -> int:
    """Of one stage's parameters on a tensor-parallel rank, those QLoRA holds in NF4: the dense
    layers' linear weights (attention's in every layer, the MLP's in dense layers); 0 otherwise."""
    n = layers_on_stage(m.num_layers, pp, stage, pipeline_layers)
    n_moe = moe_layers_on_stage(m, pp, stage, pipeline_layers, virtual_stages)
    return (n - n_moe) * nf4_layer_params(m, tp) + n_moe * nf4_layer_params(m, tp, moe=True)


def nf4_layer_params(m: ModelShape, tp: int, moe: bool = False) -> int:
    """One layer's linear weights QLoRA holds in NF4 on a tensor-parallel rank (an MoE layer's
    attention only); 0 without QLoRA."""
    if m.lora is None or not m.lora.quantize_base:
        return 0
    h, kv = m.hidden_size, m.kv_size
    attention = (h * (h + 2 * kv) + h * h) // tp
    mlp = (h * m.mlp_fc1_width(m.ffn_hidden_size) + m.ffn_hidden_size * h) // tp
    return attention + (0 if moe and m.moe is not None else mlp)


def param_counts(m: ModelShape) -> dict[str, int]:
    """The model's parameters: total, and active (those one token runs through: the routed experts
    it is not sent to left out), as MoE models are described (Mixtral 8x7B: 46.7B total, 12.9B active).
    A LoRA run adds trainable: its adapters (equal to LoRAConfig.num_params), which it holds on top
    of the frozen total."""
    total = sum(stage_params(m, 1, 1, 0).values())
    idle = 0
    if m.moe is not None:
        idle = m.num_moe_layers * (m.moe.num_experts - m.moe.router_topk)
        idle *= mlp_params(m, m.moe.ffn_hidden_size, 1)
    counts = {"total": total, "active": total - idle}
    if m.lora is not None:
        counts["trainable"] = lora_stage_params(m, 1, 1, 0)
    return counts


def spec_param_counts(spec: JobSpec) -> dict[str, int] | None:
    """param_counts of the model `spec` builds (the one parameter formula: the API, CLI and dashboard
    show these), or None where its vocabulary is a tokenizer file's and model.vocab_size is unset
    (only the engine reads tokenizer files)."""
    if spec.model.vocab_size is None and spec.data.tokenizer.type != "byte":
        return None
    return param_counts(shape_of_spec(spec, spec.model.vocab_size or BYTE_TOKENIZER_VOCAB))
