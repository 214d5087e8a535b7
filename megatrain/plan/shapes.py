"""The shapes that decide a model's memory and where its parameters sit: per layer, per pipeline stage
and tensor-parallel rank. Pure (no torch), shared by the memory estimate and the planner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from megatrain.spec import JobSpec


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
    activation: Literal["gelu", "swiglu"] = "swiglu"
    tie_embeddings: bool = False
    add_bias: bool = False
    position_embedding: Literal["learned", "rope"] = "rope"
    normalization: Literal["layernorm", "rmsnorm"] | None = None
    """None: layernorm with GELU (GPT-2), rmsnorm with SwiGLU (Llama)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        if isinstance(model, ModelShape):
            return model
        names = [f.name for f in fields(cls)]
        if isinstance(model, dict):
            values = {k: model[k] for k in names if k in model}
        else:
            values = {k: getattr(model, k) for k in names if hasattr(model, k)}
        return cls(**values)

    @property
    def norm(self) -> str:
        if self.normalization is not None:
            return self.normalization
        return "layernorm" if self.activation == "gelu" else "rmsnorm"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    @property
    def fc1_width(self) -> int:
        return 2 * self.ffn_hidden_size if self.activation == "swiglu" else self.ffn_hidden_size


def shape_of_spec(spec: JobSpec, tokenizer_vocab: int) -> ModelShape:
    """The shapes of the model a spec builds (as megatrain.engine.config.transformer_config does)."""
    m = spec.model
    gpt2 = m.arch == "gpt2"
    return ModelShape(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        ffn_hidden_size=m.ffn_size,
        vocab_size=m.padded_vocab(tokenizer_vocab),
        seq_length=m.seq_length,
        activation="gelu" if gpt2 else "swiglu",
        tie_embeddings=m.tied,
        add_bias=gpt2,
        position_embedding="learned" if gpt2 else "rope",
        normalization="layernorm" if gpt2 else "rmsnorm",
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
    )


def layer_params(m: ModelShape, tp: int) -> int:
    """One transformer layer's parameters on a tensor-parallel rank (column/row splits of the linears)."""
    h, kv, f, fw = m.hidden_size, m.kv_size, m.ffn_hidden_size, m.fc1_width
    weights = (h * (h + 2 * kv) + h * h + h * fw + f * h) // tp
    norms = 2 * h * (2 if m.norm == "layernorm" else 1)  # replicated over tp
    biases = 0
    if m.add_bias:
        # Column-parallel biases (qkv, fc1) are split; row-parallel ones (proj, fc2) are replicated.
        biases = (h + 2 * kv + fw) // tp + 2 * h
    return weights + norms + biases


def stage_params(
    m: ModelShape, tp: int, pp: int, stage: int, pipeline_layers: Sequence[int] | None = None
) -> dict[str, int]:
    """Parameters of one pipeline stage's tensor-parallel rank, by part."""
    h, v = m.hidden_size, m.vocab_size
    first, last = stage == 0, stage == pp - 1
    parts = {"layers": layers_on_stage(m.num_layers, pp, stage, pipeline_layers) * layer_params(m, tp)}
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


def layers_on_stage(
    num_layers: int, pp: int, stage: int, pipeline_layers: Sequence[int] | None = None
) -> int:
    """Layers are split evenly (the engine needs num_layers divisible by pp × virtual stages then;
    any remainder would go to the first stages), or as `pipeline_layers` says: one count per model
    chunk, chunk c on stage c % pp (megatrain.plan.layout.Layout.chunk_layers)."""
    if pipeline_layers is not None:
        return sum(pipeline_layers[stage::pp])
    base, extra = divmod(num_layers, pp)
    return base + (1 if stage < extra else 0)
