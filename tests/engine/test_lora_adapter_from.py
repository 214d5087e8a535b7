"""model.adapter_from: a LoRA run's adapters start from a PEFT folder that peft itself wrote, or
from a LoRA job's checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain.engine.build import build_model
from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.interop.hf import export_model_hf
from megatrain.engine.interop.peft_load import peft_adapter_source
from megatrain.spec import SpecError, parse_spec

from .helpers import tiny_spec
from .parallel._tp_common import fake_state

peft = pytest.importorskip("peft")
VOCAB = 96
MCFG = TransformerConfig.preset(
    "tiny-llama", hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
    vocab_size=VOCAB, seq_length=16, num_layers=2,
)  # fmt: skip
LORA = LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    """Our base exported to HF, and a PEFT adapter peft wrote on it (B off zero, so it matters)."""
    tmp = tmp_path_factory.mktemp("adapter-from")
    base = build_model(MCFG, fake_state(1, 0), seed=3, device="cpu").module
    export_model_hf(base, tmp / "base", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp / "base")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ref = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=targets, lora_dropout=0.0)
    )
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ref.save_pretrained(tmp / "adapter")
    return tmp / "base", tmp / "adapter", ref.eval()


def test_the_run_starts_from_the_adapters_peft_wrote(folders: tuple[Path, Path, object]) -> None:
    base, adapter, ref = folders
    from megatrain.engine.interop.hf_slices import hf_slices

    source = peft_adapter_source(f"hf:{adapter.as_uri()}", MCFG, LORA)
    with hf_slices(base.as_uri(), MCFG) as weights:
        ours = build_model(MCFG, fake_state(1, 0), seed=9, device="cpu", weights=weights.fill, lora=LORA,
                           adapters=source).module  # fmt: skip
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(tokens).logits  # type: ignore[operator]
        torch.testing.assert_close(ours(tokens)[..., :VOCAB], expected, atol=1e-5, rtol=0)
        bare = build_model(MCFG, fake_state(1, 0), seed=9, device="cpu", lora=LORA).module(tokens)
    assert not torch.allclose(bare[..., :VOCAB], expected, atol=1e-3)  # the adapters are what differs


def test_an_adapter_of_another_shape_is_named(folders: tuple[Path, Path, object]) -> None:
    _, adapter, _ = folders
    with pytest.raises(ValueError, match=r"the adapter's r gives 4, training.lora.rank is 8"):
        peft_adapter_source(f"hf:{adapter.as_uri()}", MCFG, LoRAConfig(rank=8, alpha=8.0))
    with pytest.raises(ValueError, match="targets"):
        peft_adapter_source(f"hf:{adapter.as_uri()}", MCFG, LoRAConfig(rank=4, alpha=8.0, targets=("qkv",)))
    with pytest.raises(ValueError, match="cannot read"):
        peft_adapter_source(f"hf:{(adapter / 'nowhere').as_uri()}", MCFG, LORA)


def test_adapter_from_is_judged(tmp_path: Path) -> None:
    raw = tiny_spec(tmp_path / "c.jsonl")
    raw["model"]["adapter_from"] = "hf:file:///abs/adapter"
    with pytest.raises(SpecError, match="needs training.method lora or qlora"):
        parse_spec(raw)
    raw["training"]["method"] = "lora"
    raw["model"]["adapter_from"] = "peft:somewhere"
    with pytest.raises(SpecError, match="PEFT folder.*checkpoint:JOB_ID"):
        parse_spec(raw)
    raw["model"]["adapter_from"] = "hf:file:///abs/adapter"
    assert parse_spec(raw).model.adapter_from == "hf:file:///abs/adapter"
    raw["model"]["adapter_from"] = "checkpoint:job_abc@2"  # a LoRA job's adapters
    assert parse_spec(raw).model.adapter_from == "checkpoint:job_abc@2"


def test_a_lora_jobs_checkpoint_continues(folders: tuple[Path, Path, object], tmp_path: Path) -> None:
    """model.adapter_from: checkpoint:JOB: a LoRA job's adapters (a fine-tune continued), on the base
    they were trained on; another shape, another base or a full fine-tune's checkpoint is named."""
    from megatrain.engine.checkpoint import save_model
    from megatrain.engine.interop.hf_slices import hf_slices
    from megatrain.engine.interop.peft_load import checkpoint_adapter_source

    base, adapter, ref = folders
    base_url, storage = f"hf:{base.as_uri()}", (tmp_path / "storage").as_uri()
    peft_start = peft_adapter_source(f"hf:{adapter.as_uri()}", MCFG, LORA)
    with hf_slices(base.as_uri(), MCFG) as weights:
        trained = build_model(MCFG, fake_state(1, 0), seed=9, device="cpu", weights=weights.fill, lora=LORA,
                              adapters=peft_start).module  # fmt: skip
    raw = tiny_spec(tmp_path / "c.jsonl")
    raw["model"]["init_from"] = base_url
    raw["training"].update(method="lora", lora={"rank": 4, "alpha": 8.0})
    state = {"base_init_from": base_url}
    save_model(f"{storage}/jobs/job_lora/checkpoints", 2, trained, parse_spec(raw), state)
    source = checkpoint_adapter_source("checkpoint:job_lora", base_url, LORA, storage)
    with hf_slices(base.as_uri(), MCFG) as weights:
        ours = build_model(MCFG, fake_state(1, 0), seed=5, device="cpu", weights=weights.fill, lora=LORA,
                           adapters=source).module  # fmt: skip
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[..., :VOCAB], ref(tokens).logits, atol=1e-5, rtol=0)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"the adapter's r gives 4, training.lora.rank is 8"):
        checkpoint_adapter_source("checkpoint:job_lora@2", base_url, LoRAConfig(rank=8, alpha=8.0), storage)
    with pytest.raises(ValueError, match="holds adapters of hf:file://"):
        checkpoint_adapter_source("checkpoint:job_lora", "hf:file:///another/base", LORA, storage)
    with pytest.raises(ValueError, match="cannot read checkpoint:job_none"):
        checkpoint_adapter_source("checkpoint:job_none", base_url, LORA, storage)
    raw["training"]["method"] = "full"
    del raw["training"]["lora"]
    save_model(f"{storage}/jobs/job_full/checkpoints", 1, trained, parse_spec(raw), state)
    with pytest.raises(ValueError, match="full fine-tune's checkpoint"):
        checkpoint_adapter_source("checkpoint:job_full", base_url, LORA, storage)


def test_peft_defaults_q_and_v_alone_start_the_run_with_k_unadapted(tmp_path: Path) -> None:
    """PEFT's default Llama targets (q_proj, v_proj) on our fused qkv: k's factors are zero, so the
    run starts at peft's model exactly, and k's adapters get no gradient (each factor's is a
    product with the other, zero)."""
    from megatrain.engine.interop.hf_slices import hf_slices

    base = build_model(MCFG, fake_state(1, 0), seed=3, device="cpu").module
    export_model_hf(base, tmp_path / "base", dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    ref = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8.0, init_lora_weights=False)).eval()
    assert set(ref.peft_config["default"].target_modules) == {"q_proj", "v_proj"}
    ref.save_pretrained(tmp_path / "adapter")
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("qkv",))
    source = peft_adapter_source(f"hf:{(tmp_path / 'adapter').as_uri()}", MCFG, lora)
    with hf_slices((tmp_path / "base").as_uri(), MCFG) as weights:
        ours = build_model(MCFG, fake_state(1, 0), seed=9, device="cpu", weights=weights.fill, lora=lora,
                           adapters=source).module  # fmt: skip
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(tokens).logits
    logits = ours(tokens)[..., :VOCAB]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    logits.square().mean().backward()
    qkv = ours.layers[0].attn.qkv.lora
    hd, heads, groups = MCFG.head_dim, MCFG.num_attention_heads, MCFG.num_query_groups
    # Our qkv rows per group: [heads/groups query heads; k; v], each hd rows; A's rows: [q; k; v] · r.
    k_rows = torch.zeros(groups, heads // groups + 2, hd, dtype=torch.bool)
    k_rows[:, heads // groups] = True
    assert qkv.A.grad[4:8].abs().max() == 0 and qkv.A.grad[:4].abs().max() > 0
    assert qkv.B.grad[k_rows.reshape(-1)].abs().max() == 0
