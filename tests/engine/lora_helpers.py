"""What the LoRA tests against PEFT share: the tiny models, adapters moved off their zero start,
and batches of a rule 20 steps can learn."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatrain.engine.build import build_model
from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.lora import ExpertLoRA, LoRA

from .parallel._tp_common import fake_state

VOCAB = 96
CONFIGS = {
    "llama": lambda: TransformerConfig.preset(
        "tiny-llama", hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        vocab_size=VOCAB, seq_length=16, num_layers=2,
    ),
    "gpt2": lambda: TransformerConfig.preset(
        "tiny-gpt2", hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=VOCAB,
        seq_length=16, num_layers=2,
    ),
}  # fmt: skip


def offset_adapters(model: torch.nn.Module, seed: int = 5) -> None:
    """B starts at zero: move every B off it, or the adapters would do nothing yet."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            names: tuple[str, ...] = ("B",) if isinstance(mod, LoRA) else ()
            if isinstance(mod, ExpertLoRA):
                names = ("fc1_B", "fc2_B")
            for name in names:
                p = getattr(mod, name)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def lora_model(flavour: str, lora: LoRAConfig) -> tuple[Any, TransformerConfig]:
    """One of CONFIGS built with `lora` (seed 3), its adapters offset."""
    mcfg = CONFIGS[flavour]()
    model = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu", lora=lora).module
    offset_adapters(model)
    return model, mcfg


def successor_batches(steps: int) -> list[torch.Tensor]:
    """Sequences of a fixed successor rule (next = 5·tok + 3 mod V): learnable in 20 steps."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        seq = [torch.randint(0, VOCAB, (4, 1), generator=gen)]
        for _ in range(16):
            seq.append((5 * seq[-1] + 3) % VOCAB)
        out.append(torch.cat(seq, dim=1))
    return out


def next_token_loss(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Next-token loss of logits over seq[:, :-1] (ours pad the vocabulary: cut to the real one)."""
    return F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def assert_trains_as_peft(
    ours: torch.nn.Module, ref: Any, mcfg: TransformerConfig, lora: LoRAConfig, model_type: str
) -> None:
    """`ours` and PEFT's `ref` (the same weights and adapters): the same loss and every adapter
    gradient (fp32), then 20 AdamW steps on the same batches give the same losses and adapters, and
    PEFT's tensors map back onto ours."""
    from peft import get_peft_model_state_dict

    from megatrain.engine.interop.peft import adapter_from_peft, adapter_to_peft

    seq = successor_batches(1)[0]
    ours_loss = next_token_loss(ours(seq[:, :-1].contiguous()), seq)
    ref_loss = next_token_loss(ref(seq[:, :-1]).logits, seq)
    torch.testing.assert_close(ours_loss, ref_loss, atol=1e-6, rtol=0)
    ours_loss.backward()
    ref_loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    assert set(grads) == {n for n, _ in ours.named_parameters() if ".lora." in n}
    ours_peft = adapter_to_peft(grads.__getitem__, mcfg, lora, model_type)
    ref_grads = {n.replace(".default", ""): p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert set(ours_peft) == set(ref_grads)
    for name, g in ours_peft.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)

    ours_opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=3e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3, eps=1e-6)
    losses = []
    for seq in successor_batches(20):
        for opt in (ours_opt, ref_opt):
            opt.zero_grad()
        ours_loss = next_token_loss(ours(seq[:, :-1].contiguous()), seq)
        ref_loss = next_token_loss(ref(seq[:, :-1]).logits, seq)
        torch.testing.assert_close(ours_loss, ref_loss, atol=1e-4, rtol=0)
        ours_loss.backward()
        ref_loss.backward()
        ours_opt.step()
        ref_opt.step()
        losses.append(ours_loss.item())
    assert losses[-1] < losses[0]  # it trained
    state = ours.state_dict()
    ref_state = get_peft_model_state_dict(ref)
    for name, t in adapter_to_peft(state.__getitem__, mcfg, lora, model_type).items():
        torch.testing.assert_close(t, ref_state[name], atol=1e-4, rtol=0, msg=name)
    for name, t in adapter_from_peft(ref_state, mcfg, lora, model_type).items():
        torch.testing.assert_close(t, state[name], atol=1e-4, rtol=0, msg=name)
