"""T5's activations on a pipeline stage: Korthikanti et al.'s per-layer accounting (megatrain.plan.
memory's docstring: each tensor a layer saves for backward, counted per token) applied to the two
stacks of an encoder-decoder (megatrain.engine.models.t5).

- An **encoder layer** saves what a GPT layer does over the Te encoder tokens (bidirectional
  attention keeps the same tensors as causal), with RMSNorm, no biases, heads of kv_channels, and
  the attention output's (B, T, q) copy that proj saves (SDPA returns (B, H, T, d)); relu's MLP
  keeps one f-wide tensor (relu's output is fc2's input), gated-GELU its [gate; up] and product.
- A **decoder layer** saves that over the Td decoder tokens, plus its cross-attention: a third
  norm, q's input and output, the attention output and its copy, the log-sum-exp, and K and V of
  the encoder's Te tokens (2·kv per encoder token, per decoder layer).
- The **encoder's output** is held once for every decoder layer of a stage (each kv linear saves
  it; in a pipeline every decoder stage receives it beside the decoder's hidden states and keeps it
  for each micro-batch in flight).
- Each stack's **position bias** is one (B, H/t, q, k) additive mask (the relative-position bias
  where a key may be seen), built before the stack's first layer and saved by every layer's
  attention: Te² per encoder sequence, Td² per decoder one, held once per stage and micro-batch in
  flight; its gradient (and the one accumulating it) is the stage's transient.
- The LM head and loss run over Td tokens: fused with the loss at tp = 1 (T5Model.loss), as
  vocab-parallel logits and cross-entropy at tp > 1 (megatrain.engine.parallel.parallelize_t5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from megatrain.plan.activation_memory import StepActivations, norm_saved
from megatrain.plan.shapes import ModelShape
from megatrain.plan.stacks import first_decoder_stage, last_encoder_stage, stack_layers_on_stage


def cross_attention_activations(
    m: ModelShape, *, tp: int, sp: bool, act: int, mask: int, attention: str, selective: bool
) -> dict[str, float]:
    """Bytes per decoder token a decoder layer's cross-attention saves (its K and V, which are per
    encoder token, scaled by Te/Td to be per decoder token)."""
    h, q, kv, heads = m.hidden_size, m.q_size, m.kv_size, m.num_attention_heads
    te, td = m.seq_length, m.dec_seq_length
    seq_div = tp if sp else 1
    terms = {
        "cross_norm": norm_saved(m, act) / seq_div,
        "cross_q_input": act * h / seq_div,  # the norm's output
        "cross_q": act * q / tp,  # SDPA saves Q (a view of q's output)
        "cross_kv": act * 2 * kv / tp * te / td,  # K and V of every encoder token
    }
    core = 2 * act * q + 4 * heads  # the output, proj's copy of it, the fp32 log-sum-exp
    if attention == "math" and not selective:
        core += act * heads * te  # the (Td × Te) probabilities
    terms["cross_attention"] = core / tp
    if m.hidden_dropout > 0:
        terms["cross_dropout_mask"] = mask * h / seq_div
    return terms


@dataclass(frozen=True)
class T5StepActivations:
    """What every stage of one T5 step shares: each stack's per-layer bytes and its token count."""

    encoder: StepActivations
    """Encoder layers over micro_batch_size · Te tokens."""
    decoder: StepActivations
    """Decoder layers (their cross-attention folded into per_layer) and the LM head, over
    micro_batch_size · Td tokens."""

    @classmethod
    def of(cls, encoder: StepActivations, *, cp: int, attention: str, selective: bool) -> T5StepActivations:
        """From the encoder's StepActivations (built on the T5 shape) and the settings it was built with."""
        m = encoder.m
        view = replace(m, seq_length=m.dec_seq_length)  # the decoder's self-attention over Td
        e = encoder
        dec = StepActivations.of(
            view, tp=e.tp, sp=e.sp, cp=cp, ep=e.ep, micro_batch_size=e.micro_batch_size, act=e.act,
            mask=e.mask, attention=attention, selective=selective, fp8=e.fp8,
            fused_loss=e.fused_loss and e.tp == 1,  # (tp > 1: vocab-parallel logits, parallelize_t5)
        )  # fmt: skip
        cross = cross_attention_activations(
            m, tp=encoder.tp, sp=encoder.sp, act=encoder.act, mask=encoder.mask, attention=attention,
            selective=selective,
        )  # fmt: skip
        return cls(encoder, replace(dec, per_layer=dec.per_layer | cross))

    def mask_bytes(self, length: int) -> float:
        """One micro-batch's additive position-bias mask over `length` queries and keys."""
        e = self.encoder
        return e.micro_batch_size * e.act * e.m.num_attention_heads / e.tp * length * length

    def stage(
        self,
        stage: int,
        pp: int,
        pipeline_layers: Sequence[int] | None,
        *,
        recompute: str,
        recompute_every: int,
        in_flight: float,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """(saved for backward, transients) of a stage's rank, by term: its encoder and decoder layers
        (full recompute checkpointing every recompute_every-th of each), the stacks' position-bias
        masks and, on a decoder stage, the encoder's output."""
        m, enc = self.encoder.m, self.encoder
        n_enc, n_dec = stack_layers_on_stage(m, pp, stage, pipeline_layers)

        def ckpt(n: int) -> int:
            return -(-n // recompute_every) if recompute == "full" else 0

        s_enc, t_enc = enc.stage(first=stage == 0, last=False, n_layers=n_enc, n_moe=0, n_ckpt=ckpt(n_enc),
                                 in_flight=in_flight)  # fmt: skip
        first_dec = stage == first_decoder_stage(m, pp, pipeline_layers) and n_dec > 0
        s_dec, t_dec = self.decoder.stage(first=first_dec, last=stage == pp - 1, n_layers=n_dec, n_moe=0,
                                          n_ckpt=ckpt(n_dec), in_flight=in_flight)  # fmt: skip
        stored = {("encoder_layers" if k == "layers" else k): b for k, b in s_enc.items()}
        for k, b in s_dec.items():
            key = "decoder_layers" if k == "layers" else k
            stored[key] = stored.get(key, 0.0) + b
        transients = dict(t_enc)
        for k, b in t_dec.items():
            transients[k] = max(transients.get(k, 0.0), b)
        masks = []
        if n_enc:
            masks.append(self.mask_bytes(m.seq_length))
        if n_dec:
            masks.append(self.mask_bytes(m.dec_seq_length))
            stored["encoder_output"] = in_flight * enc.tokens * enc.act * m.hidden_size / enc.seq_div
        if n_enc and stage == last_encoder_stage(m, pp, pipeline_layers):
            stored["encoder_final_norm"] = in_flight * enc.tokens * norm_saved(m, enc.act) / enc.seq_div
        if masks:
            stored["position_bias"] = in_flight * sum(masks)
            # A layer's backward also holds the mask's gradient and the sum it is accumulated into.
            transients["layer_backward"] = transients.get("layer_backward", 0.0) + 2 * max(masks)
        return stored, transients


__all__ = ["T5StepActivations", "cross_attention_activations"]
