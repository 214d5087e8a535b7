"""Hugging Face folders read by slice (interop.hf_slices) against the whole-tensor import.

Every family the import knows (GPT-2's transposed, fused c_attn; Llama's regrouped q/k/v and stacked
[gate; up]; Mixtral's and Qwen2-MoE's stacked experts, also from transformers' fused spellings; a
padded vocabulary), each canonical tensor read box by box must equal the same box of load_hf_state's
tensor, and a tensor-parallel shard reads only its share of the folder's bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from megatrain.engine.interop import load_hf_state
from megatrain.engine.interop.hf import hf_transformer_config, read_hf_config
from megatrain.engine.interop.hf_slices import hf_slices
from megatrain.engine.train import run
from megatrain.hf_config import model_fields_from_hf
from megatrain.spec import parse_spec

from .helpers import read_jsonl, tiny_spec
from .helpers import torchrun as _torchrun
from .test_hf_interop import _LLAMA, hf_model
from .test_hf_interop import CASES as DENSE
from .test_hf_moe_interop import CASES as MOE

CASES = {**DENSE, **MOE}


def _random_box(shape: tuple[int, ...], rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...]]:
    offsets, sizes = [], []
    for n in shape:
        a = rng.randrange(n)
        b = rng.randrange(a, n) + 1
        offsets.append(a)
        sizes.append(b - a)
    return tuple(offsets), tuple(sizes)


def _check_boxes(folder: Path, boxes_per_tensor: int = 6) -> None:
    cfg = hf_transformer_config(read_hf_config(folder))
    full = load_hf_state(folder, cfg)
    rng = random.Random(0)
    with hf_slices(folder, cfg) as weights:
        for name, t in full.items():
            shape = tuple(t.shape)
            boxes = [((0,) * t.dim(), shape)] + [_random_box(shape, rng) for _ in range(boxes_per_tensor)]
            for offsets, sizes in boxes:
                out = torch.full(sizes, float("nan"))
                weights.fill(name, shape, offsets, out)
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
                torch.testing.assert_close(out, t[index], rtol=0, atol=0, msg=f"{name} box {offsets} {sizes}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_box_equals_the_whole_import(case: str, tmp_path: Path) -> None:
    hf_model(CASES[case]()).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    _check_boxes(tmp_path / "hf")


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe"])
def test_transformers_fused_expert_tensors_read_by_slice(case: str, tmp_path: Path) -> None:
    ref = hf_model(CASES[case]())
    ref.save_pretrained(tmp_path / "hf")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    _check_boxes(tmp_path / "hf")


def test_a_shard_reads_only_its_share(tmp_path: Path) -> None:
    """A tp=4 rank's rows of the embedding and columns of a row-parallel weight read a quarter of
    those tensors' bytes; nothing else is read."""
    hf_model(CASES["llama-gqa-llama3"]()).save_pretrained(tmp_path / "hf")
    cfg = hf_transformer_config(read_hf_config(tmp_path / "hf"))
    with hf_slices(tmp_path / "hf", cfg) as weights:
        embed = torch.empty(cfg.vocab_size // 4, cfg.hidden_size)
        weights.fill("embed.weight", (cfg.vocab_size, cfg.hidden_size), (cfg.vocab_size // 4, 0), embed)
        # Rows 256..511 of 1024 (1000 real): all real, so a quarter of the padded rows' bytes.
        assert weights.bytes_read == (cfg.vocab_size // 4) * cfg.hidden_size * 4
        proj = torch.empty(cfg.hidden_size, cfg.hidden_size // 4)
        weights.fill("layers.1.attn.proj.weight", (cfg.hidden_size,) * 2, (0, 3 * cfg.hidden_size // 4), proj)
        assert weights.bytes_read == (cfg.vocab_size // 4 + cfg.hidden_size // 4) * cfg.hidden_size * 4


@pytest.mark.distributed
def test_sharded_folder_at_tp2_pp2_gives_one_process_first_loss(tmp_path: Path, corpus: Path) -> None:
    """init_from hf: a sharded folder (40 KB files) at tp=2 × pp=2 (4 gloo ranks, each reading only
    its slices) gives the first step's loss one process gives loading the whole folder, and the
    same gradient norm: every rank started from transformers' weights, sliced right."""
    ref = hf_model(LlamaConfig(**{**_LLAMA, "vocab_size": 300}))  # the byte tokenizer's 257 fit
    ref.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    raw = tiny_spec(corpus, train_iters=2, eval_interval=0, checkpoint_interval=0, log_interval=1)
    fields = model_fields_from_hf(read_hf_config(tmp_path / "hf"), seq_length=32)
    raw["model"] = {**fields, "init_from": "hf:" + (tmp_path / "hf").as_uri()}
    run(parse_spec(raw), tmp_path / "single")
    raw["parallelism"] = {"tp": 2, "pp": 2, "dp": 1, "sequence_parallel": True}
    raw["resources"] = {"devices": 4}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    proc = _torchrun(4, tmp_path / "spec.json", tmp_path / "par", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "initialised from the Hugging Face model" in proc.stdout
    one = [r for r in read_jsonl(tmp_path / "single" / "metrics.jsonl") if "loss" in r]
    four = [r for r in read_jsonl(tmp_path / "par" / "metrics.jsonl") if "loss" in r]
    assert four[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-6)
    assert four[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-5)
    assert four[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-4)
