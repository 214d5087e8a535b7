"""The activations of a training step on one rank: what each layer saves for backward, and the
largest transient of a stage (the loss's, a layer's backward, a recomputed layer). Pure arithmetic;
megatrain.plan.memory adds the model state and documents the coefficients (its module docstring).

A LoRA run's frozen weights need no weight gradient, so none of its temporaries exist: no fp32
weight gradient of the fused LM head, no weight-gradient GEMM output in a layer's backward, no input
all-gathered again under sequence parallelism for it. Each adapter saves its rank-r product x·Aᵀ
(for B's gradient) and, with dropout, its dropped input and mask; the input A's gradient needs is
the base's, saved already.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatrain.kernels.policy import linear_cross_entropy_chunk_rows
from megatrain.plan.moe_memory import moe_backward_peak, moe_dispatch_transient, moe_layer_activations
from megatrain.plan.shapes import ModelShape, lora_layer_targets, lora_linears

MLM_FRACTION = 0.15
"""The share of positions BERT's masked-LM loss scores: Megatron's masked_lm_prob and the default of
megatrain.engine.data.masking; the engine projects only those rows onto the vocabulary."""


def norm_saved(m: ModelShape, act: int) -> float:
    """Bytes per token a norm saves for backward (besides its output, the next linear's input)."""
    h = m.hidden_size
    if m.norm == "layernorm":
        return act * h + 8  # input + fp32 mean and rstd
    return act * h + 4  # input + fp32 rstd


def layer_activations(
    m: ModelShape,
    *,
    tp: int,
    sp: bool,
    act: int,
    mask: int,
    attention: str,
    selective: bool,
    gathered_inputs: bool = False,
) -> dict[str, float]:
    """Bytes per token (of the rank's micro-batch, before any sequence split) one layer saves for backward.
    gathered_inputs: with sp, qkv and fc1 save their all-gathered input instead of the shard (fp8)."""
    h, kv, f, fw, s = m.hidden_size, m.kv_size, m.ffn_hidden_size, m.fc1_width, m.seq_length
    heads, q = m.num_attention_heads, m.q_size  # q = h but where T5's kv_channels differ
    seq_div = tp if sp else 1  # parts outside the tensor-parallel region shard only with sp
    rope = m.position_embedding == "rope"
    grouped = m.num_query_groups != heads
    terms: dict[str, float] = {}
    # Two norms' saved tensors, and their outputs: the inputs qkv and fc1 save for their weight grads.
    # With sp these are sequence shards: the column-parallel linears keep the shard and all-gather
    # it again in backward (megatrain.engine.parallel.layers, as Megatron does).
    terms["norms"] = 2 * norm_saved(m, act) / seq_div
    terms["linear_inputs"] = 2 * act * h / (1 if gathered_inputs else seq_div)
    # The fused qkv output (q + 2kv wide) stays alive: SDPA saves K and V as views into it.
    qkv = act * (q + 2 * kv)
    # Q is a separate tensor after RoPE, or after regrouping GQA heads (a reshape that copies).
    if rope or grouped:
        qkv += act * q
    if rope:
        qkv += act * kv  # rotated K
    terms["qkv"] = qkv / tp
    if rope and act != 4:
        # make_trainable casts RoPE's tables with the model; each rotation saves fp32 copies of the
        # cos and sin halves it used (Q's and K's: 4 × head_dim/2 fp32 per token, whole over tp).
        terms["rope_tables"] = 8.0 * m.head_dim
    if attention == "math":
        # Contiguous q/k/v copies replace the qkv storage (K/V expanded to all heads under GQA),
        # plus the softmax probabilities (heads·s per token) unless selective recompute drops them.
        core = act * (q + 2 * q) + act * q  # q, k, v copies + the output's contiguous copy for proj
        if not selective:
            core += act * heads * s
        if m.attention_dropout > 0 and not selective:
            core += mask * heads * s
        terms["qkv"] = 0.0
        terms["attention"] = core / tp
    else:
        # Output (laid out (B, T, H, hd), so proj reads it without a copy) + fp32 log-sum-exp. T5's
        # SDPA output is (B, H, T, d): proj saves the (B, T, q) copy its reshape makes.
        copies = 2 if m.family == "t5" else 1
        terms["attention"] = (copies * act * q + 4 * heads) / tp
    if m.activation in ("swiglu", "geglu"):
        terms["mlp"] = act * (fw + f) / tp  # fc1 out [gate; up], act(gate)·up (act recomputed)
    elif m.activation == "relu":
        terms["mlp"] = act * f / tp  # relu's output, which is fc2's input too
    else:
        terms["mlp"] = act * 2 * f / tp  # fc1 out, gelu out
    if m.hidden_dropout > 0:
        terms["dropout_masks"] = 2 * mask * h / seq_div
        if m.family == "t5":
            terms["dropout_masks"] += mask * f / tp  # T5 drops the MLP's hidden activations too
    return terms


def lora_activations(m: ModelShape, *, tp: int, sp: bool, act: int, mask: int, moe: bool = False) -> float:
    """Bytes per token one layer's LoRA adapters save (0 without LoRA): each its rank-r product
    u = x·Aᵀ, whole over tp (gathered under sp on a column-parallel base, a partial sum on a
    row-parallel one); with dropout also its dropped input and mask, split like the base's input."""
    if m.lora is None:
        return 0.0
    saved = 0.0
    for target in lora_layer_targets(m, moe):
        n_in, _, parts, column = lora_linears(m, moe)[target]
        saved += act * parts * m.lora.rank
        if m.lora.dropout > 0:
            saved += (act + mask) * (n_in / (tp if sp else 1) if column else n_in / tp)
    return saved


def frozen_layer_savings(
    m: ModelShape, terms: dict[str, float], *, tp: int, sp: bool, act: int
) -> dict[str, float]:
    """A LoRA layer's terms that differ from a full run's (`terms`, layer_activations'): a frozen
    linear without an adapter keeps no input for a weight gradient, where nothing else keeps it:
    qkv's and fc1's (the norms' outputs; under sp the sequence-parallel linear keeps its shard
    anyway) and fc2's (the MLP's product; proj's is attention's output, which SDPA keeps)."""
    assert m.lora is not None
    h, f = m.hidden_size, m.ffn_hidden_size
    bare = [t for t in ("qkv", "fc1", "fc2") if t not in m.lora.targets]
    out = {}
    if not sp:
        out["linear_inputs"] = terms["linear_inputs"] - act * h * sum(t in ("qkv", "fc1") for t in bare)
    if "fc2" in bare:
        out["mlp"] = terms["mlp"] - act * f / tp
    return out


@dataclass(frozen=True)
class StepActivations:
    """What every stage of one step shares: the model, its split and the per-layer saved bytes."""

    m: ModelShape
    tp: int
    sp: bool
    ep: int
    micro_batch_size: int
    act: int
    mask: int
    """Bytes per element of a dropout mask: bool on CUDA, the model dtype on a CPU."""
    tokens: float
    """Per rank and micro-batch, before the sequence-parallel split."""
    fp8: bool
    fused_loss: bool
    per_layer: dict[str, float] = field(default_factory=dict)
    """Bytes per token a dense layer saves, by term."""
    per_moe_layer: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(
        cls, m: ModelShape, *, tp: int, sp: bool, cp: int, ep: int, micro_batch_size: int, act: int,
        mask: int, attention: str, selective: bool, fp8: bool, fused_loss: bool,
    ) -> StepActivations:  # fmt: skip
        per_layer = layer_activations(
            m, tp=tp, sp=sp, act=act, mask=mask, attention=attention, selective=selective, gathered_inputs=fp8
        )
        per_moe = moe_layer_activations(m, per_layer, tp=tp, act=act) if m.moe is not None else {}
        if m.lora is not None:
            # (An MoE layer's frozen experts are counted as a full run's: an upper bound.)
            per_layer.update(frozen_layer_savings(m, per_layer, tp=tp, sp=sp, act=act))
            per_layer["lora"] = lora_activations(m, tp=tp, sp=sp, act=act, mask=mask)
            if per_moe:
                per_moe["lora"] = lora_activations(m, tp=tp, sp=sp, act=act, mask=mask, moe=True)
        tokens = micro_batch_size * m.seq_length / cp
        return cls(m, tp, sp, ep, micro_batch_size, act, mask, tokens, fp8, fused_loss, per_layer, per_moe)

    @property
    def seq_div(self) -> int:
        return self.tp if self.sp else 1

    @property
    def trains_weights(self) -> bool:
        """False for a LoRA run: the base's weights need no gradient."""
        return self.m.lora is None

    @property
    def layer_bytes(self) -> float:
        return self.tokens * sum(self.per_layer.values())

    @property
    def moe_layer_bytes(self) -> float:
        return self.tokens * sum(self.per_moe_layer.values())

    def regathered(self, out: float) -> float:
        """What a column-parallel linear's backward adds under sp: its input all-gathered again (for
        the weight gradient) and, for more than one sequence per micro-batch, a reorder copy of the
        narrower of its output gradient (out/t wide) and its input (megatrain.engine.parallel.layers)."""
        if not self.sp:
            return 0.0
        h, tp = self.m.hidden_size, self.tp
        gathered = h if self.trains_weights else 0
        return self.tokens * self.act * (gathered + (min(out / tp, h) if self.micro_batch_size > 1 else 0))

    def stage(
        self, *, first: bool, last: bool, n_layers: int, n_moe: int, n_ckpt: int, in_flight: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        """(saved for backward, transients) of a stage's rank, by term: `in_flight` micro-batches of
        n_layers layers (n_moe of them MoE), n_ckpt of them checkpointed (keeping only their input)."""
        m, tokens, act, seq_div = self.m, self.tokens, self.act, self.seq_div
        h = m.hidden_size
        layer_bytes, moe_layer_bytes = self.layer_bytes, self.moe_layer_bytes
        checkpointed_bytes = tokens * act * h / seq_div  # the residual stream, sharded with sp
        # Checkpointed layers are taken as dense and MoE in the stage's proportion.
        mean_layer = ((n_layers - n_moe) * layer_bytes + n_moe * moe_layer_bytes) / max(1, n_layers)
        stored: dict[str, float] = {}
        stored["layers"] = in_flight * (n_ckpt * checkpointed_bytes + (n_layers - n_ckpt) * mean_layer)
        # (A frozen embedding's output needs no gradient: its dropout saves no mask.)
        if first and m.hidden_dropout > 0 and self.trains_weights:
            stored["embedding_dropout_mask"] = in_flight * tokens * self.mask * h / seq_div
        transients: dict[str, float] = {}
        if last:
            self._loss(stored, transients)
        if n_layers:
            head_freed = sum(stored.get(k, 0) for k in ("final_norm_and_head_input", "final_norm",
                                                        "log_probs", "fused_loss_grads", "mlm_transform",
                                                        "mlm_masked_rows"))  # fmt: skip
            peak = self._layer_backward_peak(first and last, n_layers, n_moe, n_ckpt)
            transients["layer_backward"] = max(0.0, peak - head_freed)
            if n_moe:
                transients["moe_dispatch"] = moe_dispatch_transient(m, tokens, act=act)
        return stored, transients

    def _loss(self, stored: dict[str, float], transients: dict[str, float]) -> None:
        """The last stage's final norm, LM head and loss: what they save, and their transient."""
        m, tokens, act, tp, sp = self.m, self.tokens, self.act, self.tp, self.sp
        h, v = m.hidden_size, m.vocab_size
        if m.family == "bert":
            self._bert_loss(stored, transients)
            return
        # The head's weight gradient (fp32 in the fused loss), none when it is frozen.
        wgrad = 1 if self.trains_weights else 0
        if self.fused_loss:
            # The fused head + loss (megatrain.kernels.linear_cross_entropy, and its vocab-parallel
            # variant over V/t columns): the head's input is not kept; the loss's forward leaves the
            # hidden states' gradient (every token's, a partial sum at tp > 1) and an fp32 weight
            # gradient for backward, and at its peak holds one chunk of fp32 logits (plus, for a
            # 16-bit model, their cast and the chunk's weight-gradient GEMM output before it is
            # accumulated in fp32) next to, under sp, the all-gathered head input.
            vt = v / tp
            stored["final_norm"] = tokens * norm_saved(m, act) / self.seq_div
            stored["fused_loss_grads"] = tokens * act * h + wgrad * 4 * vt * h
            rows = linear_cross_entropy_chunk_rows(int(tokens), int(vt))
            gathered = tokens * act * h if sp else 0.0
            transients["loss_forward"] = (
                gathered + rows * vt * 4 + (rows * vt * act + wgrad * act * vt * h if act != 4 else 0)
            )
            # Backward scales both in place; a 16-bit weight gradient is cast once; under sp the
            # hidden gradient is reduce-scattered to the rank's tokens.
            transients["loss_backward"] = (wgrad * act * vt * h if act != 4 else 0.0) + gathered / tp
            return
        # Final norm, its output (the LM head's input) and the loss's fp32 (tokens, V/t) tensor:
        # log-probs for F.cross_entropy, the softmax for the vocab-parallel loss (tp > 1).
        stored["final_norm_and_head_input"] = tokens * (norm_saved(m, act) + act * h) / self.seq_div
        stored["log_probs"] = tokens * 4 * v / tp
        head_grad_temp = wgrad * act * v * h / tp  # LM-head weight grad before it is accumulated
        if tp == 1:
            # F.cross_entropy's backward: fp32 grads of the log-probs and of the logits next to
            # the log-probs; then the logits' grad next to the head's weight-grad temporary.
            transients["loss_backward"] = max(
                tokens * 8 * v, tokens * 4 * v - stored["log_probs"] + head_grad_temp
            )
        else:
            # The vocab-parallel loss turns its softmax into the logits' grad in place; only a
            # 16-bit model adds a cast of it (and the softmax is then freed before the head's grad).
            cast = tokens * act * v / tp if act != 4 else 0.0
            freed = stored["log_probs"] if act != 4 else 0.0
            transients["loss_backward"] = max(cast, cast + head_grad_temp - freed) + self.regathered(v)

    def _bert_loss(self, stored: dict[str, float], transients: dict[str, float]) -> None:
        """BERT's heads (megatrain.engine.parallel.bert_loss): the final norm (pre-norm) and the
        masked-LM transform (dense, GELU, LayerNorm) on the rank's shard of every position, then only
        the masked rows (MLM_FRACTION) gathered, projected onto the vocabulary shard and scored in fp32.
        The binary head reads one token per sequence (negligible)."""
        m, tokens, act, tp = self.m, self.tokens, self.act, self.tp
        h, v = m.hidden_size, m.vocab_size
        masked = MLM_FRACTION * tokens
        final = 0.0 if m.post_layernorm else norm_saved(m, act)
        # The dense's and GELU's inputs, the LayerNorm's input and statistics.
        stored["mlm_transform"] = tokens * (final + 2 * act * h + norm_saved(m, act)) / self.seq_div
        stored["mlm_masked_rows"] = masked * act * h  # the decoder's input, whole over tp
        stored["log_probs"] = masked * 4 * v / tp  # the vocab-parallel loss's fp32 softmax
        # Backward: the logits' gradient cast to 16 bits, and the decoder's weight-gradient temporary.
        cast = masked * act * v / tp if act != 4 else 0.0
        transients["loss_backward"] = cast + (act * v * h / tp if self.trains_weights else 0.0)

    def _layer_backward_peak(self, single_stage: bool, n_layers: int, n_moe: int, n_ckpt: int) -> float:
        """A layer's backward peaks in the MLP, at one of three moments: fc2's backward (its input
        grad and weight-grad temporary, before that is added to the accumulated gradient); the
        activation's backward (about three f-wide grads: for SwiGLU fc2's input grad, silu(gate)'s
        and up's); fc1's backward (its output grad, the input grad and its weight-grad temporary, the
        MLP's saved tensors freed by then). A recomputed layer first rebuilds its own activations.
        The loss's tensors are freed by then (the caller takes them off)."""
        m, tokens, act, tp = self.m, self.tokens, self.act, self.tp
        h, v, fw, f = m.hidden_size, m.vocab_size, m.fc1_width, m.ffn_hidden_size
        wgrad = 1 if self.trains_weights else 0  # a frozen base has no weight-gradient temporaries
        layer_bytes, moe_layer_bytes = self.layer_bytes, self.moe_layer_bytes
        rebuilt = max(layer_bytes if n_layers > n_moe else 0.0, moe_layer_bytes if n_moe else 0.0)
        rebuilt = rebuilt if n_ckpt else 0.0
        mlp_saved = tokens * self.per_layer["mlp"] if n_ckpt else 0.0
        # (Grads of the full-width hidden states are whole on every tensor-parallel rank.)
        fc2_backward = tokens * act * (f / tp + h) + wgrad * act * f * h / tp + rebuilt
        act_backward = tokens * act * (fw + f) / tp + rebuilt
        fc1_backward = (
            tokens * act * (fw / tp + h)
            + wgrad * act * h * fw / tp
            + (0 if self.fp8 else self.regathered(fw))
            + rebuilt
            - mlp_saved
        )
        if self.fp8:
            # float8 copies (1 byte): the output gradient twice, the weight and the input once.
            fc2_backward += tokens * (2 * h + f / tp) + f * h / tp
            fc1_backward += tokens * (2 * fw / tp + h) + h * fw / tp
        peak = max(fc2_backward, act_backward, fc1_backward) if n_layers > n_moe else 0.0
        if n_moe:
            # As fc1's backward above: a recomputed layer's expert tensors are freed by the peak.
            experts_saved = tokens * self.per_moe_layer["moe_experts"] if n_ckpt else 0.0
            moe_peak = moe_backward_peak(m, tokens, tp=tp, ep=self.ep, act=act, frozen=not wgrad)
            peak = max(peak, moe_peak + rebuilt - experts_saved)
        if m.tie_embeddings and single_stage and wgrad:
            # A tied weight's two gradients are summed before accumulation: the LM head's waits
            # in autograd's input buffer until the embedding's arrives at the end of backward.
            peak += act * v * h / tp
        return peak


__all__ = ["MLM_FRACTION", "StepActivations", "layer_activations", "lora_activations", "norm_saved"]
