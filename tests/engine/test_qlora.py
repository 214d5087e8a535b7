"""QLoRA: the frozen base linears in torchao's NF4, dequantised per GEMM, adapters as LoRA's; its
loss tracks LoRA's over 20 steps."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatrain.engine.build import build_model
from megatrain.engine.config import LoRAConfig, TransformerConfig
from megatrain.engine.train import run
from megatrain.spec import SpecError, parse_spec

from .helpers import tiny_spec, write_corpus
from .parallel._tp_common import fake_state

NF4 = pytest.importorskip("torchao.quantization").NF4Tensor
MODEL = {"hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 256}


def test_the_nf4_base_is_torchaos_quantisation_of_the_base() -> None:
    tiny = TransformerConfig.preset("tiny-llama", vocab_size=256, seq_length=16, num_layers=2)
    mcfg = replace(tiny, **MODEL)
    lora = LoRAConfig(rank=4, alpha=8.0, quantize_base=True)
    plain = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu").module
    q = build_model(mcfg, fake_state(1, 0), seed=3, device="cpu", lora=lora).module
    weights = dict(q.named_parameters())
    quantized = [n for n, p in weights.items() if isinstance(p, NF4)]
    assert len(quantized) == 4 * mcfg.num_layers  # qkv, proj, fc1, fc2 of every layer
    for name, p in plain.named_parameters():
        if name in quantized:
            expected = NF4.from_tensor(p.detach(), 64, 256).get_original_weight()
            got = weights[name].get_original_weight()
            torch.testing.assert_close(got, expected, atol=0, rtol=0, msg=name)
            assert not weights[name].requires_grad
        else:  # norms, embeddings, head: as they were
            torch.testing.assert_close(weights[name], p, atol=0, rtol=0, msg=name)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = q(tokens)
    assert torch.isfinite(out).all() and not torch.equal(out, plain(tokens).detach())  # NF4 rounds


def _losses(tmp: Path, method: str) -> list[float]:
    raw = tiny_spec(tmp / "c.jsonl", train_iters=20, eval_interval=0, checkpoint_interval=0, lr=2e-2)
    raw["model"].update(MODEL, num_layers=2)
    raw["training"].update(method=method, lora={"rank": 8, "alpha": 16.0})
    run(parse_spec(raw), tmp / method)
    rows = [json.loads(line) for line in (tmp / method / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_qlora_tracks_lora_over_20_steps(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c.jsonl")
    lora, qlora = _losses(tmp_path, "lora"), _losses(tmp_path, "qlora")
    assert len(lora) == len(qlora) == 20
    assert qlora[-1] < qlora[0] - 0.3 and lora[-1] < lora[0] - 0.3  # both learn
    # The base differs by NF4's rounding (about 7% of a weight's scale): the losses stay within 2%.
    assert max(abs(a - b) / a for a, b in zip(lora, qlora, strict=True)) < 0.02, (lora, qlora)


def test_qlora_with_fp8_is_refused(tmp_path: Path) -> None:
    raw = tiny_spec(tmp_path / "c.jsonl", precision="fp8")
    raw["training"]["method"] = "qlora"
    with pytest.raises(SpecError, match="NF4"):
        parse_spec(raw)
