"""A LoRA model's exports against the reference libraries (fp32, CPU): the PEFT adapter folder loads
with `peft.PeftModel.from_pretrained` on the exported base, the merged folder with transformers'
`AutoModelForCausalLM`, and both give our model's logits; Llama (fused q/k/v and gate/up: several
parts per adapter) and GPT-2 (Conv1D, fan_in_fan_out); from a LoRA checkpoint as the workers read it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from megatrain.engine.build import build_model
from megatrain.engine.checkpoint import save_model
from megatrain.engine.config import LoRAConfig, TransformerConfig, lora_config
from megatrain.engine.interop.hf import export_checkpoint_hf, export_hf, export_model_hf
from megatrain.engine.interop.lora_export import (
    export_adapter,
    export_checkpoint_adapter,
    hf_model_type,
    merged_tensor_source,
)
from megatrain.engine.interop.peft import lora_from_peft_config
from megatrain.peft_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megatrain.spec import parse_spec

from .lora_helpers import VOCAB, lora_model
from .parallel._tp_common import fake_state

peft = pytest.importorskip("peft")

CASES = [
    ("llama", LoRAConfig(rank=4, alpha=8.0)),
    ("llama", LoRAConfig(rank=2, alpha=6.0, targets=("qkv", "fc2"), use_rslora=True)),
    ("gpt2", LoRAConfig(rank=4, alpha=16.0)),
    # GPT-2 names both output projections c_proj: an adapter on one only must not land on the other.
    ("gpt2", LoRAConfig(rank=2, alpha=4.0, targets=("proj",))),
    ("gpt2", LoRAConfig(rank=2, alpha=4.0, targets=("qkv", "fc2"))),
]
IDS = ["llama-all", "llama-qkv-fc2-rslora", "gpt2-all", "gpt2-proj", "gpt2-qkv-fc2"]
ATOL = (
    1e-5  # fp32 logits of the same weights: the merge (W + s·B̃·A) and PEFT's two-path sum differ in rounding
)


def _ours(flavour: str, lora: LoRAConfig) -> tuple[Any, TransformerConfig]:
    model, mcfg = lora_model(flavour, lora)
    return model.eval(), mcfg


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize(("flavour", "lora"), CASES, ids=IDS)
def test_adapter_loads_in_peft_on_the_exported_base(flavour: str, lora: LoRAConfig, tmp_path: Path) -> None:
    model, mcfg = _ours(flavour, lora)
    state = model.state_dict()
    export_model_hf(model, tmp_path / "base", dtype=torch.float32)  # the frozen base alone
    written = export_adapter(
        state.__getitem__, mcfg, lora, hf_model_type(mcfg), tmp_path / "adapter",
        base_model=str(tmp_path / "base"), dtype=torch.float32, tokenizer_files={"tokenizer.json": b"{}"},
    )  # fmt: skip
    assert written == [ADAPTER_WEIGHTS, "tokenizer.json", ADAPTER_CONFIG]  # the config last: complete
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (
        config["base_model_name_or_path"] == str(tmp_path / "base") and lora_from_peft_config(config) == lora
    )
    with safe_open(str(tmp_path / "adapter" / ADAPTER_WEIGHTS), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ref = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # Every adapter PEFT puts on the base came from the folder (none left at its initial values).
    loaded = peft.get_peft_model_state_dict(ref)
    with safe_open(str(tmp_path / "adapter" / ADAPTER_WEIGHTS), framework="pt") as f:
        assert set(f.keys()) == set(loaded)
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            torch.testing.assert_close(loaded[name], f.get_tensor(name), atol=0, rtol=0)
    seq = _tokens()
    with torch.no_grad():
        ours = model(seq)[..., :VOCAB]
        theirs = ref(seq).logits
        with ref.disable_adapter():
            plain = ref(seq).logits
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)
    assert (plain - ours).abs().max() > 100 * ATOL  # the adapters change the logits: the check has teeth


@pytest.mark.parametrize(("flavour", "lora"), CASES, ids=IDS)
def test_merged_export_loads_in_transformers(flavour: str, lora: LoRAConfig, tmp_path: Path) -> None:
    model, mcfg = _ours(flavour, lora)
    state = model.state_dict()
    export_hf(
        merged_tensor_source(state.__getitem__, mcfg, lora), mcfg, tmp_path / "merged", dtype=torch.float32
    )
    export_model_hf(model, tmp_path / "base", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    seq = _tokens()
    with torch.no_grad():
        ours = model(seq)[..., :VOCAB]
        torch.testing.assert_close(merged(seq).logits, ours, atol=ATOL, rtol=0)
        assert (base(seq).logits - ours).abs().max() > 100 * ATOL
    # PEFT's own merge of the same adapters gives the same weights.
    export_adapter(
        state.__getitem__, mcfg, lora, hf_model_type(mcfg), tmp_path / "adapter", dtype=torch.float32
    )
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    for name, t in merged.state_dict().items():
        # W + s·(B@A) in another association than PEFT's: a few ulps of weights below 1.
        torch.testing.assert_close(t, theirs[name], atol=1e-6, rtol=0, msg=name)


def test_merged_source_passes_other_tensors_through() -> None:
    lora = LoRAConfig(rank=2, alpha=4.0, targets=("qkv",))
    model, mcfg = _ours("llama", lora)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    asked: list[str] = []

    def get(name: str) -> torch.Tensor:
        asked.append(name)
        return state[name]

    source = merged_tensor_source(get, mcfg, lora)
    for name in ("layers.0.attn.proj.weight", "layers.1.mlp.fc1.weight", "embed.weight"):
        assert source(name) is state[name]  # untouched, in its saved dtype: the caller casts
    assert not any(".lora." in n for n in asked)
    merged = source("layers.1.attn.qkv.weight")
    assert merged.dtype == torch.float32 and asked[-2:] == [
        "layers.1.attn.qkv.lora.A",
        "layers.1.attn.qkv.lora.B",
    ]
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.qkv: adapters A \(6, 32\)"):
        merged_tensor_source(get, mcfg, LoRAConfig(rank=3, alpha=4.0, targets=("qkv",)))(
            "layers.0.attn.qkv.weight"
        )


def test_a_lora_checkpoint_exports_merged_and_as_adapter(tmp_path: Path) -> None:
    """From a checkpoint (what the export workers read): export_checkpoint_hf writes the model the run
    trained, adapters merged in, and export_checkpoint_adapter its PEFT folder; a checkpoint that
    trained every weight has no adapter to export."""
    lora = LoRAConfig(rank=4, alpha=8.0)
    model, mcfg = _ours("llama", lora)
    raw: dict[str, Any] = {"name": "lora-ckpt", "data": {"train": [{"path": "file:///dev/null"}]}}
    spec = parse_spec({**raw, "training": {"method": "lora", "lora": {"rank": 4, "alpha": 8.0}}})
    assert lora_config(spec) == lora
    save_model((tmp_path / "ckpt").as_uri(), 3, model, spec)
    export_checkpoint_hf(tmp_path / "ckpt", tmp_path / "merged", dtype=torch.float32)
    export_checkpoint_adapter(tmp_path / "ckpt", tmp_path / "adapter", dtype=torch.float32)
    export_model_hf(model, tmp_path / "base", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    seq = _tokens()
    with torch.no_grad():
        ours = model(seq)[..., :VOCAB]
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(seq).logits, ours, atol=ATOL, rtol=0)
        with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
        torch.testing.assert_close(with_adapter(seq).logits, ours, atol=ATOL, rtol=0)

    plain = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu").module
    save_model((tmp_path / "full").as_uri(), 1, plain, parse_spec(raw))
    with pytest.raises(ValueError, match=r"step 1 trained every weight \(training.method is 'full'\)"):
        export_checkpoint_adapter(tmp_path / "full", tmp_path / "none")
    assert not (tmp_path / "none").exists()
