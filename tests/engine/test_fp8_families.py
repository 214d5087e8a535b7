"""precision fp8 for BERT and T5: which linears multiply in float8, and a few steps of each family
in fp8 (torchao's float8 GEMMs, emulated on a CPU) against bf16 from the same seed.

Tolerance: e4m3 rounds each operand to 2^-4 relative, errors that average out over a GEMM's inner
dimension (32 to 128 here) and the loss's tokens; measured over 8 steps on this project's CPU, the
fp8 losses stay within 4.5e-4 (BERT) and 1.2e-3 (T5) of bf16's, tensorwise and rowwise alike. 0.02
leaves the drift room to grow ~15× (other CPUs, thread counts), while a float8 path that is wrong
(a lost scale, a transposed weight) moves the loss by more than 0.1 within a step or two.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from megatrain.engine.config import TransformerConfig
from megatrain.engine.fp8 import enable_fp8
from megatrain.engine.models.bert import BertModel
from megatrain.engine.models.t5 import T5Config, T5Model
from megatrain.engine.parallel.pipeline_t5 import T5Stage, t5_stage_layers
from megatrain.engine.train import run
from megatrain.kernels.fp8_linear import Fp8Linear
from megatrain.settings import Settings
from megatrain.spec import parse_spec

from .test_bert_train import bert_spec
from .test_t5_train import t5_spec

pytest.importorskip("torchao.float8")

TOLERANCE = 0.02  # see the module docstring


def tagged(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if isinstance(getattr(p, "fp8", None), Fp8Linear)}


def test_bert_runs_its_encoder_layers_in_fp8() -> None:
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
        seq_length=16, vocab_size=128, position_embedding="learned", normalization="layernorm",
        activation="gelu", add_bias=True, tie_embeddings=True, bidirectional=True, num_tokentypes=2,
        binary_head=True,
    )  # fmt: skip
    model = BertModel(cfg)
    names = enable_fp8(model, "tensorwise")
    assert names == [
        f"layers.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    ]
    # The heads (the masked-LM transform over the masked tokens, the pooler and the sentence-order
    # classifier over one token per row), the embeddings and the tied decoder stay bf16.
    assert tagged(model) == {f"{n}.weight" for n in names}
    assert {n for n, _ in model.heads.named_modules() if n} >= {"lm_transform", "pooler", "classifier"}


@pytest.mark.parametrize("tied", [True, False])
def test_t5_runs_every_layer_linear_in_fp8(tied: bool) -> None:
    cfg = T5Config(
        num_layers=2, num_decoder_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
        ffn_hidden_size=64, vocab_size=64, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, encoder_seq_length=16, decoder_seq_length=16,
        activation="relu" if tied else "gated-gelu", tie_embeddings=tied,
    )  # fmt: skip
    model = T5Model(cfg)
    enable_fp8(model, "rowwise")
    layer = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    want = {f"encoder.layers.{i}.{m}.weight" for i in range(2) for m in layer}
    want |= {
        f"decoder.layers.{i}.{m}.weight"
        for i in range(2)
        for m in (*layer, "cross.q", "cross.kv", "cross.proj")
    }
    assert tagged(model) == want  # the embedding, position biases, norms and LM head stay bf16
    # A pipeline's stage (what make_trainable tags: an nn.ModuleList of stages) holds the same.
    stages = nn.ModuleList(
        T5Stage(T5Model(cfg), s, 2, layers) for s, layers in enumerate(t5_stage_layers(cfg, 2, 1))
    )
    enable_fp8(stages, "tensorwise")
    assert {n.split(".", 1)[1] for n in tagged(stages)} == want


def _losses(tmp_path: Path, raw: dict[str, Any], precision: str) -> list[float]:
    raw["training"] |= {"precision": precision}
    out = tmp_path / precision
    run(parse_spec(raw), out)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert next(e for e in events if e["event"] == "started")["precision"] == precision
    return [
        r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    ]


SHORT = {"train_iters": 4, "global_batch_size": 4, "eval_interval": 0, "checkpoint_interval": 0}


def _bert() -> dict[str, Any]:
    return bert_spec(**SHORT)


def _t5() -> dict[str, Any]:
    raw = t5_spec(**SHORT)
    raw["model"]["t5"]["kv_channels"] = 8  # float8 GEMMs need widths of 16s: 4 heads × 8
    return raw


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "t5"])
def test_a_short_fp8_run_tracks_bf16(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """4 steps in fp8 (emulated: bf16 on a CPU needs MEGATRAIN_CPU_LOW_PRECISION) and in bf16."""
    monkeypatch.setattr("megatrain.engine.runtime.get_settings", lambda: Settings(cpu_low_precision=True))
    monkeypatch.setenv("MEGATRAIN_CACHE_DIR", str(tmp_path / "cache"))
    spec = _bert if family == "bert" else _t5
    bf16 = _losses(tmp_path, spec(), "bf16")
    fp8 = _losses(tmp_path, spec(), "fp8")
    assert len(fp8) == len(bf16) == 4
    assert fp8 != bf16  # the float8 GEMMs ran
    assert max(abs(a - b) for a, b in zip(fp8, bf16, strict=True)) < TOLERANCE, (fp8, bf16)
    assert all(torch.isfinite(torch.tensor(fp8)))
