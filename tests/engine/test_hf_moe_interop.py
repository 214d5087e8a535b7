"""Hugging Face import and export of Mixtral and Qwen2-MoE models against transformers' own (tiny random
configs: 4 experts, top-2, fp32, CPU). As test_hf_interop: transformers' logits on the same tokens, its
from_pretrained of our export, and its save_pretrained's files tensor for tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

from megatrain.engine.checkpoint import load_checkpoint
from megatrain.engine.config import MoEConfig, TransformerConfig
from megatrain.engine.interop import (
    export_checkpoint_hf,
    export_model_hf,
    load_hf_model,
    load_hf_state,
    read_hf_config,
)
from megatrain.engine.models.gpt import GPTModel
from megatrain.engine.train import run
from megatrain.hf_config import model_fields_from_hf, spec_model_with_hf
from megatrain.spec import parse_spec

from .helpers import tiny_spec
from .test_hf_interop import ATOL, VOCAB, hf_logits, hf_model, our_logits

_SHAPE = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
          "vocab_size": VOCAB, "max_position_embeddings": 64, "num_experts_per_tok": 2}  # fmt: skip
_QWEN = {**_SHAPE, "num_experts": 4, "intermediate_size": 48, "moe_intermediate_size": 24,
         "shared_expert_intermediate_size": 40}  # fmt: skip
CASES: dict[str, Any] = {
    "mixtral": lambda: MixtralConfig(**_SHAPE, num_local_experts=4, intermediate_size=24),
    # norm_topk_prob false: the softmax's top-k probabilities as they are (router_pre_softmax).
    "qwen2_moe": lambda: Qwen2MoeConfig(**_QWEN),
    # Renormalised top-k, no q/k/v biases, experts on layers 0 and 2 (a dense MLP on layer 1).
    "qwen2_moe-norm-sparse": lambda: Qwen2MoeConfig(**{**_QWEN, "num_hidden_layers": 3}, norm_topk_prob=True,
                                                    qkv_bias=False, mlp_only_layers=[1]),
}  # fmt: skip


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_and_export_match_transformers(case: str, tmp_path: Path) -> None:
    ref = hf_model(CASES[case]())
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))

    ours, cfg = load_hf_model(tmp_path / "hf")
    assert cfg.moe is not None and cfg.moe.num_experts == 4
    kinds = [type(block.mlp).__name__ for block in ours.layers]
    expected = ["MoELayer", "MLP", "MoELayer"] if case.endswith("sparse") else ["MoELayer"] * 2
    assert kinds == expected
    torch.testing.assert_close(our_logits(ours, tokens), hf_logits(ref, tokens), atol=ATOL, rtol=0)

    export_model_hf(ours, tmp_path / "out", dtype=torch.float32, max_shard_bytes=40_000)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(ref)
    torch.testing.assert_close(hf_logits(back, tokens), our_logits(ours, tokens), atol=ATOL, rtol=0)
    # The Hub's per-expert names, every tensor exactly as save_pretrained wrote it.
    theirs, exported = tensors(tmp_path / "hf"), tensors(tmp_path / "out")
    assert exported.keys() == theirs.keys()
    assert any(".experts.3." in name for name in exported)
    for name, t in theirs.items():
        assert torch.equal(exported[name], t), name


MODELS = {
    "mixtral": MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=24),
    "qwen2_moe": MoEConfig(
        num_experts=4, router_topk=2, ffn_hidden_size=24, layer_freq=2, router_pre_softmax=True,
        shared_expert_ffn_hidden_size=40, shared_expert_gate=True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODELS))
def test_our_random_moe_model_exports_to_transformers(name: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    qwen = name == "qwen2_moe"
    cfg = TransformerConfig.preset(
        "tiny-llama",
        num_layers=3,
        vocab_size=1024,
        vocab_size_unpadded=VOCAB,
        qkv_bias=qwen,
        moe=MODELS[name],
    )
    model = GPTModel(cfg).eval()
    with torch.no_grad():  # routers far from uniform, biases and norms off their initial values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_model_hf(model, tmp_path / "out", dtype=torch.float32)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.config.model_type == name
    tokens = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(hf_logits(back, tokens), our_logits(model, tokens), atol=ATOL, rtol=0)
    if qwen:  # layer 1 dense
        assert back.config.mlp_only_layers == [1] and hasattr(back.model.layers[1].mlp, "gate_proj")


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_import_accepts_transformers_fused_expert_tensors(case: str, tmp_path: Path) -> None:
    """A folder holding transformers' in-memory names (mlp.gate, mlp.experts.gate_up_proj (E, 2F, C),
    mlp.experts.down_proj (E, C, F)) instead of the Hub's per-expert ones."""
    ref = hf_model(CASES[case]())
    ref.save_pretrained(tmp_path / "hf")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.gate.weight" in state
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ours, _ = load_hf_model(tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (2, 16))
    torch.testing.assert_close(our_logits(ours, tokens), hf_logits(ref, tokens), atol=ATOL, rtol=0)


def test_mismatched_experts_are_refused(tmp_path: Path) -> None:
    hf_model(CASES["qwen2_moe"]()).save_pretrained(tmp_path / "hf")
    _, cfg = load_hf_model(tmp_path / "hf", seq_length=32)
    assert cfg.moe is not None
    wrong = TransformerConfig.from_dict(
        {**cfg.to_dict(), "moe": {**cfg.to_dict()["moe"], "num_experts": 8, "router_pre_softmax": False}}
    )
    with pytest.raises(ValueError, match="moe.num_experts: checkpoint 4, model 8.*router_pre_softmax"):
        load_hf_state(tmp_path / "hf", wrong)
    dense = TransformerConfig.from_dict({**cfg.to_dict(), "moe": None})
    with pytest.raises(ValueError, match="moe: checkpoint"):
        load_hf_state(tmp_path / "hf", dense)
    # Training choices are the model's own: a capacity factor and other loss coefficients load.
    coeffs = {"capacity_factor": 2.0, "aux_loss_coeff": 0.1, "z_loss_coeff": 1e-3}
    trained = TransformerConfig.from_dict({**cfg.to_dict(), "moe": {**cfg.to_dict()["moe"], **coeffs}})
    assert load_hf_state(tmp_path / "hf", trained).keys() == GPTModel(trained).state_dict().keys()


def test_train_from_hf_moe_then_export(tmp_path: Path, corpus: Path) -> None:
    """The hf: init path: a spec completed from a Qwen2-MoE config.json trains 3 steps with its own
    capacity factor; the checkpoint exports to a folder transformers loads with our trained logits."""
    ref = hf_model(Qwen2MoeConfig(**{**_QWEN, "vocab_size": 300}))  # the byte tokenizer's 257 fit
    ref.save_pretrained(tmp_path / "hf")
    raw = tiny_spec(corpus, train_iters=3, lr=1e-5, warmup_iters=0, eval_interval=0, checkpoint_interval=0)
    fields = model_fields_from_hf(read_hf_config(tmp_path / "hf"), seq_length=32)
    spec = {
        "init_from": "hf:" + (tmp_path / "hf").as_uri(),
        "seq_length": 32,
        "moe": {"aux_loss_coeff": 0.01},
    }
    raw["model"] = spec_model_with_hf(spec, fields)
    parsed = parse_spec(raw)
    assert parsed.model.moe is not None and parsed.model.moe.shared_expert_gate
    assert (parsed.model.moe.num_experts, parsed.model.moe.aux_loss_coeff) == (4, 0.01)
    run(parsed, tmp_path / "run")

    trained, _ = load_checkpoint(tmp_path / "run" / "checkpoints")
    theirs = ref.model.layers[1].mlp.experts.down_proj
    moved = (trained.layers[1].mlp.experts.fc2_weight - theirs).abs().max()
    assert 0 < moved < 1e-4
    export_checkpoint_hf(tmp_path / "run" / "checkpoints", tmp_path / "out", dtype=torch.float32)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        ours = trained(tokens)[..., :300]
    torch.testing.assert_close(hf_logits(back, tokens), ours, atol=ATOL, rtol=0)
