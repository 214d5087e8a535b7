"""BERT and T5 training steps on a CPU: our models against transformers' own on the same weights and
shapes, in the same process, as tokens/s of forward + backward + an AdamW step.

    PYTHONPATH=. python benchmarks/families_cpu.py             # ~2 min on a 2-core CPU
    PYTHONPATH=. python benchmarks/families_cpu.py --tiny      # a smoke run
    PYTHONPATH=. python benchmarks/families_cpu.py --flush-denormal

BERT: BertModel (the engine's masked-LM loss on the masked positions and the sentence-order loss,
parallel.bert_loss) against BertForPreTraining (its loss over every position's logits), 15% of the
tokens masked. T5: T5Model.loss (the fused head + cross-entropy kernel) against
T5ForConditionalGeneration's loss. Both in fp32, eager attention for transformers ("sdpa" where it
has it, as it picks by default). Each cell is the median of --repeats timed steps after a warm-up,
the two sides interleaved step by step so that the shared machine's noise falls on both. Tokens: the
encoder's (BERT: every input position; T5: encoder + decoder positions).

--flush-denormal runs both sides with torch.set_flush_denormal(True): transformers' softmax backward
leaves subnormal probabilities that slow a CPU's GEMMs many times over (our fused cross-entropy makes
none), so that row compares the arithmetic alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SHAPES = {
    "base": {"layers": 4, "hidden": 256, "heads": 4, "ffn": 1024, "vocab": 30522, "seq": 128, "batch": 8,
             "dec_seq": 32},
    "tiny": {"layers": 2, "hidden": 64, "heads": 4, "ffn": 256, "vocab": 1024, "seq": 32, "batch": 4,
             "dec_seq": 8},
}  # fmt: skip


def bert_pair(s: dict[str, int]) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    import transformers

    from megatrain.engine.config import TransformerConfig
    from megatrain.engine.interop.hf_mapping_bert import bert_rules
    from megatrain.engine.models.bert import BertModel
    from megatrain.engine.parallel.bert_loss import encoder_losses

    hf_cfg = transformers.BertConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], intermediate_size=s["ffn"], max_position_embeddings=s["seq"],
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_cfg).train()
    padded = -(-s["vocab"] // 128) * 128
    cfg = TransformerConfig(
        num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
        num_query_groups=s["heads"], ffn_hidden_size=s["ffn"], seq_length=s["seq"], vocab_size=padded,
        vocab_size_unpadded=s["vocab"], position_embedding="learned", normalization="layernorm",
        activation="gelu", add_bias=True, tie_embeddings=True, norm_eps=1e-12, bidirectional=True,
        post_layernorm=True, num_tokentypes=2, binary_head=True, gelu_approximate="none",
    )  # fmt: skip
    ours = BertModel(cfg).train()
    theirs_state = hf.state_dict()
    with torch.no_grad():
        mine = ours.state_dict()
        for rule in bert_rules(cfg):
            mine[rule.name].copy_(rule.from_hf(*(theirs_state[n] for n in rule.hf)))
    g = torch.Generator().manual_seed(1)
    b, t = s["batch"], s["seq"]
    tokens = torch.randint(0, s["vocab"], (b, t), generator=g)
    types = (torch.arange(t) >= t // 2).long().expand(b, t).contiguous()
    masked = torch.rand(b, t, generator=g) < 0.15
    labels = torch.randint(0, s["vocab"], (b, t), generator=g)
    hf_labels = torch.where(masked, labels, torch.full_like(labels, -100))
    order = torch.randint(0, 2, (b,), generator=g)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def step_ours() -> float:
        hidden = ours.hidden_states(tokens, token_type_ids=types)
        losses = encoder_losses(hidden, ours, labels, masked.float(), order)
        assert losses.binary is not None
        loss = losses.mlm + losses.binary
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        return float(loss.detach())

    def step_hf() -> float:
        out = hf(input_ids=tokens, token_type_ids=types, labels=hf_labels, next_sentence_label=order)
        out.loss.backward()
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    return step_ours, step_hf, b * t


def t5_pair(s: dict[str, int]) -> tuple[Callable[[], Any], Callable[[], Any], int]:
    import transformers

    from megatrain.engine.interop.hf_t5 import t5_config_from_hf, t5_model_from_state, t5_state_from_hf

    hf_cfg = transformers.T5Config(
        vocab_size=s["vocab"], d_model=s["hidden"], d_kv=s["hidden"] // s["heads"], d_ff=s["ffn"],
        num_layers=s["layers"], num_decoder_layers=s["layers"], num_heads=s["heads"],
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(hf_cfg).train()
    cfg = t5_config_from_hf(hf_cfg.to_dict(), encoder_seq_length=s["seq"], decoder_seq_length=s["dec_seq"])
    ours = t5_model_from_state(t5_state_from_hf(hf.state_dict(), cfg, "benchmark"), cfg).train()
    g = torch.Generator().manual_seed(1)
    b, te, td = s["batch"], s["seq"], s["dec_seq"]
    enc = torch.randint(0, s["vocab"], (b, te), generator=g)
    labels = torch.randint(0, s["vocab"], (b, td), generator=g)
    dec = torch.cat([torch.zeros(b, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    mask = torch.ones(b, td)
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_hf = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def step_ours() -> float:
        loss = ours.loss(enc, dec, labels, mask)
        loss.backward()
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)
        return float(loss.detach())

    def step_hf() -> float:
        out = hf(input_ids=enc, decoder_input_ids=dec, labels=labels)
        out.loss.backward()
        opt_hf.step()
        opt_hf.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    return step_ours, step_hf, b * (te + td)


def measure(pair: tuple[Callable[[], Any], Callable[[], Any], int], repeats: int) -> tuple[float, float]:
    """(our tokens/s, theirs), medians of `repeats` interleaved steps after two warm-up steps each."""
    ours, theirs, tokens = pair
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for i in range(repeats + 2):
        for name, fn in (
            (("ours", ours), ("theirs", theirs)) if i % 2 == 0 else (("theirs", theirs), ("ours", ours))
        ):
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return tokens / statistics.median(times["ours"]), tokens / statistics.median(times["theirs"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--flush-denormal", action="store_true", help="both sides with subnormal floats flushed to zero"
    )
    args = parser.parse_args()
    if args.flush_denormal and not torch.set_flush_denormal(True):
        raise SystemExit("this CPU cannot flush subnormal floats to zero")
    s = SHAPES["tiny" if args.tiny else "base"]
    print(
        f"shape: {s} | threads {torch.get_num_threads()} | torch {torch.__version__}"
        f" | flush denormal {args.flush_denormal}"
    )
    print("| model | ours tokens/s | transformers tokens/s | ours / transformers |")
    print("|---|---:|---:|---:|")
    for name, build in (("BERT (MLM + SOP)", bert_pair), ("T5 v1.1 (gated-gelu)", t5_pair)):
        mine, theirs = measure(build(s), args.repeats)
        print(f"| {name} | {mine:,.0f} | {theirs:,.0f} | {mine / theirs:.2f}x |")


if __name__ == "__main__":
    main()
