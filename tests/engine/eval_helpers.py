"""One model on both sides of lm-eval, for tests/engine/test_eval_*.py: a seeded tiny Llama loaded as
a serve job loads its base (engine.serving.loader) behind our EngineLM, and the same weights exported
with its byte tokenizer to a transformers folder (interop.hf) behind lm-eval's own HFLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lm_eval.models.huggingface import HFLM

from megatrain.engine.evaluation.lm import EngineLM
from megatrain.engine.interop.hf import export_model_hf
from megatrain.engine.interop.hf_tokenizer import export_tokenizer
from megatrain.engine.serving.loader import Served, load_served
from megatrain.spec import parse_spec

SEQ = 64


def tiny_spec(seq_length: int = SEQ) -> Any:
    return parse_spec(
        {
            "name": "eval-lm",
            # A wide init gives peaked logits: no near-ties for a rounding difference to flip.
            "model": {"arch": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                      "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": seq_length,
                      "init_method_std": 0.3},
            "data": {"train": [{"dataset": "corpus"}], "tokenizer": {"type": "byte"}},
            "training": {"precision": "fp32", "seed": 3},
        }
    )  # fmt: skip


def both_sides(folder: Path, seq_length: int = SEQ) -> tuple[EngineLM, HFLM, Served]:
    """(EngineLM, HFLM, the served model) on the same weights; the export is written to `folder`."""
    spec = tiny_spec(seq_length)
    served = load_served(spec, "cpu")
    tokenizer = export_tokenizer(spec.data.tokenizer, model_max_length=seq_length)
    export_model_hf(
        served.model, folder, dtype=torch.float32, tokenizer_files=tokenizer.files,
        extra_config=tokenizer.special_ids,
    )  # fmt: skip
    hf = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=3, max_length=seq_length)
    return EngineLM(served.model, served.tokenizer, batch_size=2), hf, served
