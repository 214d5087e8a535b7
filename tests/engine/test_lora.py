"""LoRA against PEFT's own LoraLayer on transformers' own models (fp32, CPU): the same weights give
the same logits and gradients, and 20 AdamW steps on the same batches land on the same adapters."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatrain.engine.build import build_model
from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.interop.hf import export_model_hf
from megatrain.engine.interop.peft import adapter_from_peft, adapter_to_peft, peft_config
from megatrain.engine.lora import LoRA, adapters_disabled, trainable_parameters

from .parallel._tp_common import fake_state

peft = pytest.importorskip("peft")

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
MODEL_TYPE = {"llama": "llama", "gpt2": "gpt2"}


def _ours(flavour: str, lora: LoRAConfig) -> Any:
    mcfg = CONFIGS[flavour]()
    model = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu", lora=lora).module
    with torch.no_grad():  # B starts at zero: move it off, or the adapters would do nothing yet
        gen = torch.Generator().manual_seed(5)
        for mod in model.modules():
            if isinstance(mod, LoRA):
                mod.B.copy_(torch.randn(mod.B.shape, generator=gen) * 0.1)
    return model, mcfg


def _peft(model: Any, mcfg: TransformerConfig, lora: LoRAConfig, flavour: str, tmp: Path) -> Any:
    export_model_hf(model, tmp / "hf", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp / "hf")
    config = peft_config(mcfg, lora, MODEL_TYPE[flavour])
    keys = ("r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules", "fan_in_fan_out")
    ref = peft.get_peft_model(base, peft.LoraConfig(**{k: config[k] for k in keys}))
    state = model.state_dict()
    adapters = adapter_to_peft(lambda n: state[n], mcfg, lora, MODEL_TYPE[flavour])
    # PEFT's own loader, on the names we export: every adapter tensor must be taken.
    result = peft.set_peft_model_state_dict(ref, adapters)
    assert not result.unexpected_keys
    return ref


def _batches(steps: int) -> list[torch.Tensor]:
    """Sequences of a fixed successor rule (next = 5·tok + 3 mod V): learnable in 20 steps."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        seq = [torch.randint(0, VOCAB, (4, 1), generator=gen)]
        for _ in range(16):
            seq.append((5 * seq[-1] + 3) % VOCAB)
        out.append(torch.cat(seq, dim=1))
    return out


def _loss(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Next-token loss of logits over seq[:, :-1] (ours pad the vocabulary: cut to the real one)."""
    return F.cross_entropy(logits[..., :VOCAB].reshape(-1, VOCAB), seq[:, 1:].reshape(-1))


def _our_grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    ("flavour", "lora"),
    [
        ("llama", LoRAConfig(rank=4, alpha=8.0)),
        ("llama", LoRAConfig(rank=2, alpha=6.0, targets=("qkv", "fc2"), use_rslora=True)),
        ("gpt2", LoRAConfig(rank=4, alpha=16.0)),
    ],
    ids=["llama-all", "llama-qkv-fc2-rslora", "gpt2-all"],
)
def test_lora_trains_as_peft_does(flavour: str, lora: LoRAConfig, tmp_path: Path) -> None:
    model, mcfg = _ours(flavour, lora)
    ref = _peft(model, mcfg, lora, flavour, tmp_path)
    trainable, total = trainable_parameters(model)
    assert trainable == sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert 0 < trainable < total and trainable == lora.num_params(mcfg)  # the formula the log and planner use

    seq = _batches(1)[0]
    ours_loss, ref_loss = _loss(model(seq[:, :-1].contiguous()), seq), _loss(ref(seq[:, :-1]).logits, seq)
    torch.testing.assert_close(ours_loss, ref_loss, atol=1e-6, rtol=0)
    ours_loss.backward()
    ref_loss.backward()
    grads = _our_grads(model)
    assert set(grads) == {n for n, _ in model.named_parameters() if ".lora." in n}
    ours_peft = adapter_to_peft(grads.__getitem__, mcfg, lora, MODEL_TYPE[flavour])
    ref_grads = {n.replace(".default", ""): p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert set(ours_peft) == set(ref_grads)
    for name, g in ours_peft.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)

    # 20 AdamW steps on the same batches: the same losses, the same adapters.
    ours_opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, eps=1e-6)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=3e-3, eps=1e-6)
    first = last = None
    for seq in _batches(20):
        for opt in (ours_opt, ref_opt):
            opt.zero_grad()
        ours_loss = _loss(model(seq[:, :-1].contiguous()), seq)
        ref_loss = _loss(ref(seq[:, :-1]).logits, seq)
        torch.testing.assert_close(ours_loss, ref_loss, atol=1e-4, rtol=0)
        ours_loss.backward()
        ref_loss.backward()
        ours_opt.step()
        ref_opt.step()
        first = first if first is not None else ours_loss.item()
        last = ours_loss.item()
    assert last is not None and first is not None and last < first  # it trained
    state = model.state_dict()
    ours_peft = adapter_to_peft(state.__getitem__, mcfg, lora, MODEL_TYPE[flavour])
    ref_state = peft.get_peft_model_state_dict(ref)
    for name, t in ours_peft.items():
        torch.testing.assert_close(t, ref_state[name], atol=1e-4, rtol=0, msg=name)
    # ... and back: PEFT's tensors map onto ours exactly.
    back = adapter_from_peft(ref_state, mcfg, lora, MODEL_TYPE[flavour])
    for name, t in back.items():
        torch.testing.assert_close(t, state[name], atol=1e-4, rtol=0, msg=name)


def test_the_base_is_frozen_and_adapters_start_as_the_base() -> None:
    lora = LoRAConfig(rank=4, alpha=8.0)
    mcfg = CONFIGS["llama"]()
    plain = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu").module
    adapted = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu", lora=lora).module
    seq = _batches(1)[0][:, :-1].contiguous()
    with torch.no_grad():
        torch.testing.assert_close(adapted(seq), plain(seq), atol=0, rtol=0)  # B = 0: exactly the base
    frozen = {n for n, p in adapted.named_parameters() if not p.requires_grad}
    assert frozen == set(dict(plain.named_parameters()))
    a = adapted.layers[0].attn.qkv.lora.A
    assert a.shape == (3 * 4, 32) and a.abs().max() <= 1 / 32**0.5 and a.std() > 0.05  # 3 parts: q, k, v
    assert adapted.layers[0].mlp.fc1.lora.A.shape == (2 * 4, 32)  # gate, up
    assert adapted.layers[0].attn.proj.lora.A.shape == (4, 32)
    with adapters_disabled(adapted), torch.no_grad():  # B moved off zero, then switched off: the base
        for mod in adapted.modules():
            if isinstance(mod, LoRA):
                mod.B.fill_(0.5)
        torch.testing.assert_close(adapted(seq), plain(seq), atol=0, rtol=0)
    with torch.no_grad():
        assert not torch.allclose(adapted(seq), plain(seq))
    # Another model config gives other adapters from the same seed only where the shapes differ.
    other = build_model(replace(mcfg, ffn_hidden_size=64), fake_state(1, 0), seed=3, device="cpu", lora=lora)
    torch.testing.assert_close(other.module.layers[0].attn.qkv.lora.A, a, atol=0, rtol=0)
