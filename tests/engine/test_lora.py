"""LoRA against PEFT's own LoraLayer on transformers' own models (fp32, CPU): the same weights give
the same logits and gradients, and 20 AdamW steps on the same batches land on the same adapters."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain.engine.build import build_model
from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.interop.hf import export_model_hf
from megatrain.engine.interop.peft import adapter_to_peft, peft_config
from megatrain.engine.lora import LoRA, adapters_disabled, trainable_parameters

from .lora_helpers import CONFIGS, assert_trains_as_peft, lora_model, successor_batches
from .parallel._tp_common import fake_state

peft = pytest.importorskip("peft")

MODEL_TYPE = {"llama": "llama", "gpt2": "gpt2"}


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
    model, mcfg = lora_model(flavour, lora)
    ref = _peft(model, mcfg, lora, flavour, tmp_path)
    trainable, total = trainable_parameters(model)
    assert trainable == sum(p.numel() for p in ref.parameters() if p.requires_grad)
    assert 0 < trainable < total and trainable == lora.num_params(mcfg)  # the formula the log and planner use

    assert_trains_as_peft(model, ref, mcfg, lora, MODEL_TYPE[flavour])


def test_the_base_is_frozen_and_adapters_start_as_the_base() -> None:
    lora = LoRAConfig(rank=4, alpha=8.0)
    mcfg = CONFIGS["llama"]()
    plain = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu").module
    adapted = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu", lora=lora).module
    seq = successor_batches(1)[0][:, :-1].contiguous()
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
