"""LoRA on mixture-of-experts models against PEFT on transformers' own Mixtral and Qwen2-MoE (fp32,
CPU): adapters on attention, the shared expert and every routed expert (PEFT's target_parameters on
the stacked expert tensors) give PEFT's logits and gradients, train as PEFT does for 20 steps, and
export to and import from PEFT's own files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain.engine.build import build_model
from megatrain.engine.checkpoint import save_model
from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.interop.hf import export_checkpoint_hf, hf_transformer_config, read_hf_config
from megatrain.engine.interop.hf_slices import hf_slices
from megatrain.engine.interop.lora_export import export_checkpoint_adapter
from megatrain.engine.interop.peft import (
    adapter_to_peft,
    lora_from_peft_config,
    peft_config,
)
from megatrain.engine.lora import ExpertLoRA, adapters_disabled, merged_weight, trainable_parameters
from megatrain.peft_config import ADAPTER_CONFIG
from megatrain.spec import parse_spec

from .lora_helpers import assert_trains_as_peft, offset_adapters
from .parallel._tp_common import fake_state
from .test_hf_interop import VOCAB, hf_model
from .test_hf_moe_interop import CASES

peft = pytest.importorskip("peft")

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("qkv", "proj", "fc1", "fc2", "experts"))


def _pair(case: str, lora: LoRAConfig, tmp: Path) -> tuple[Any, Any, TransformerConfig, str]:
    """Ours from transformers' model (B off zero, so the adapters matter) and PEFT's on that model
    with the same adapters, loaded through PEFT's own state-dict loader."""
    base = hf_model(CASES[case]())
    base.save_pretrained(tmp / "hf")
    config = read_hf_config(tmp / "hf")
    mcfg = hf_transformer_config(config, seq_length=16)
    assert mcfg.moe is not None  # transformers adds no aux loss unless asked: neither do we here
    mcfg = replace(mcfg, moe=replace(mcfg.moe, aux_loss_coeff=0.0, z_loss_coeff=0.0))
    with hf_slices((tmp / "hf").as_uri(), mcfg) as weights:
        ours = build_model(
            mcfg, fake_state(1, 0), seed=3, device="cpu", weights=weights.fill, lora=lora
        ).module
    offset_adapters(ours)
    model_type = config["model_type"]
    settings = peft_config(mcfg, lora, model_type)
    keys = ("r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules", "target_parameters")
    ref = peft.get_peft_model(base.train(), peft.LoraConfig(**{k: settings[k] for k in keys}))
    state = ours.state_dict()
    result = peft.set_peft_model_state_dict(ref, adapter_to_peft(state.__getitem__, mcfg, lora, model_type))
    assert not result.unexpected_keys
    return ours, ref, mcfg, model_type


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_expert_adapters_train_as_peft_does(case: str, tmp_path: Path) -> None:
    ours, ref, mcfg, model_type = _pair(case, LORA, tmp_path)
    trainable, total = trainable_parameters(ours)
    assert trainable == sum(p.numel() for p in ref.parameters() if p.requires_grad) == LORA.num_params(mcfg)
    assert sum(isinstance(m, ExpertLoRA) for m in ours.modules()) == 2  # both layers' experts
    assert_trains_as_peft(ours, ref, mcfg, LORA, model_type)


def test_expert_adapters_merge_and_switch_off(tmp_path: Path) -> None:
    """The merged stacked weights give the adapted model's logits (PEFT's merge_and_unload); with
    the adapters off the model is its base."""
    ours, ref, mcfg, _ = _pair("qwen2_moe", LORA, tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    state = ours.state_dict()
    merged = {
        n: merged_weight(n, t, state.__getitem__, mcfg, LORA) for n, t in state.items() if ".lora." not in n
    }
    assert not torch.equal(
        merged["layers.0.mlp.experts.fc1_weight"], state["layers.0.mlp.experts.fc1_weight"]
    )
    plain = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu").module
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens), ours(tokens), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            ref.merge_and_unload()(tokens).logits, ours(tokens)[..., :VOCAB], atol=1e-5, rtol=0
        )
        base = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu").module
        base.load_state_dict({n: t for n, t in state.items() if ".lora." not in n})
        with adapters_disabled(ours):
            torch.testing.assert_close(ours(tokens), base(tokens), atol=0, rtol=0)


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_a_moe_lora_checkpoint_exports_as_peft_and_merged(case: str, tmp_path: Path) -> None:
    """What the export workers write from a checkpoint: the PEFT folder (target_parameters for the
    experts) that PeftModel.from_pretrained loads on the base, and the merged model; both give ours."""
    lora = (
        LORA if case == "qwen2_moe" else replace(LORA, targets=("qkv", "proj", "experts"))
    )  # Mixtral: no MLP
    ours, _, mcfg, _ = _pair(case, lora, tmp_path)
    assert mcfg.moe is not None
    moe = {"num_experts": 4, "shared_expert_ffn_hidden_size": mcfg.moe.shared_expert_ffn_hidden_size}
    lora_spec = {"rank": 4, "alpha": 8.0, "targets": list(lora.targets)}
    raw = {"name": "moe-lora", "data": {"train": [{"path": "file:///dev/null"}]}, "model": {"moe": moe},
           "training": {"method": "lora", "lora": lora_spec}}  # fmt: skip
    save_model((tmp_path / "ckpt").as_uri(), 2, ours, parse_spec(raw))
    export_checkpoint_adapter(tmp_path / "ckpt", tmp_path / "adapter", dtype=torch.float32)
    export_checkpoint_hf(tmp_path / "ckpt", tmp_path / "merged", dtype=torch.float32)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert lora_from_peft_config(config) == lora  # and back: what adapter_from would train on
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(tokens)[..., :VOCAB]
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(adapted(tokens).logits, expected, atol=1e-5, rtol=0)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(tokens).logits, expected, atol=1e-5, rtol=0)
