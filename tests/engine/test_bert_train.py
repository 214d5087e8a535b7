"""BERT trains through the engine (spec -> masked sentence data -> BertModel -> MLM + SOP loss) and
every parallel layout reproduces one process's run on the same seed and samples (gloo, fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def bert_spec(parallelism: dict[str, Any] | None = None, world: int = 1, **training: Any) -> dict[str, Any]:
    return {
        "name": "bert-test",
        "kind": "pretrain",
        "model": {
            "arch": "bert",
            "bert": {"binary_head": True, "post_layernorm": True},
            "num_layers": 4,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "seq_length": 32,
        },
        "data": {
            "tokenizer": {"type": "hf", "path": str(EXAMPLES / "data" / "wordpiece.json")},
            "train": [{"path": (EXAMPLES / "data" / "corpus.jsonl").as_uri()}],
            "split": "90,10,0",
        },
        "training": {
            "train_iters": 6,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "lr": 3e-3,
            "warmup_iters": 1,
            "precision": "fp32",
            "log_interval": 1,
            "eval_interval": 3,
            "checkpoint_interval": 0,
            "seed": 7,
            **training,
        },
        "parallelism": {"distributed_optimizer": True, **(parallelism or {})},
        "resources": {"devices": world},
    }


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _rank(rank: int, world: int, workdir: str, parallelism: dict[str, Any]) -> list[dict[str, Any]] | None:
    import os

    import torch.distributed as dist

    from megatrain.engine.runtime import Dist
    from megatrain.engine.train import run
    from megatrain.spec import parse_spec

    os.environ["MEGATRAIN_CACHE_DIR"] = str(Path(workdir) / "cache")
    raw = bert_spec(parallelism, world)
    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    if world == 1:
        ctx = Dist()
    out = Path(workdir) / ("-".join(f"{k}{v}" for k, v in parallelism.items()) or "single")
    run(parse_spec(raw), out, ctx=ctx)
    return _rows(out) if rank == 0 else None


LAYOUTS = {
    "tp2-sp": {"tp": 2, "sequence_parallel": True, "dp": 1},
    "pp2": {"pp": 2, "dp": 1},
    "dp2-distopt": {"dp": 2},
    "cp2": {"cp": 2, "dp": 1},
    "pp2-interleaved": {"pp": 2, "virtual_stages": 2, "dp": 1},
}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    from .parallel._launch import run_distributed

    workdir = str(tmp_path_factory.mktemp("bert"))
    rows = run_distributed(_rank, 1, workdir, {})[0]
    return workdir, rows


def test_bert_learns_and_reports_masked_token_accuracy(single: tuple[str, list[dict[str, Any]]]) -> None:
    _, rows = single
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    # MLM over ~128 word pieces (ln 128 = 4.85) plus sentence order (ln 2 = 0.69) at the start.
    assert 4.5 < train[0]["loss"] < 6.5
    assert train[-1]["loss"] < train[0]["loss"]
    assert all(0 <= r["token_accuracy"] <= 1 for r in train)
    # The sentence-order head's own figures (its loss starts near ln 2: two balanced classes).
    assert 0.5 < train[0]["sop_loss"] < 0.9 and all(0 <= r["sop_accuracy"] <= 1 for r in train)
    assert all(r["sop_loss"] < r["loss"] for r in train)
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]


def test_a_trained_bert_exports_to_transformers(
    single: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The run's checkpoint (post-norm: the original BERT's order) as a Hugging Face folder that
    transformers' BertForPreTraining loads and computes our logits with."""
    import torch
    import transformers

    from megatrain.engine.checkpoint.sharded import load_checkpoint
    from megatrain.engine.interop.hf import export_checkpoint_hf

    workdir, _ = single
    ckpt = Path(workdir) / "single" / "checkpoints"
    export_checkpoint_hf(ckpt, tmp_path, dtype=torch.float32)
    theirs = transformers.BertForPreTraining.from_pretrained(tmp_path).eval()
    ours, _ = load_checkpoint(ckpt)
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    types = (torch.arange(32) >= 16).long().expand(2, 32)
    want = ours(tokens, token_type_ids=types)
    got = theirs(input_ids=tokens, token_type_ids=types)
    torch.testing.assert_close(got.prediction_logits, want.mlm_logits[..., :128], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.seq_relationship_logits, want.class_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bert_layouts_match_one_process(single: tuple[str, list[dict[str, Any]]], layout: str) -> None:
    """Only the fp32 summation order differs between layouts: losses agree to ~1e-6 (1e-4 allowed,
    as the GPT layouts' test explains); a wrong shard, a lost sentence-order gradient or a doubled
    one moves them by far more. (pp caught the decoder's gradient lost beside the embedding's fused
    one on a single device: parallel.bert_loss runs the `linear` kernel for it.)"""
    from .parallel._launch import run_distributed

    workdir, ref = single
    got = run_distributed(_rank, 2, workdir, LAYOUTS[layout])[0]
    want = [r for r in ref if "loss" in r]
    have = [r for r in got if "loss" in r]
    assert len(have) == len(want) == 6
    for a, b in zip(want, have, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), layout
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), layout
        assert b["token_accuracy"] == pytest.approx(a["token_accuracy"], abs=2e-3), layout
        assert b["sop_loss"] == pytest.approx(a["sop_loss"], rel=1e-4), layout
        assert b["sop_accuracy"] == a["sop_accuracy"], layout
    val_ref = [r["val_loss"] for r in ref if "val_loss" in r]
    val_got = [r["val_loss"] for r in got if "val_loss" in r]
    assert val_got == pytest.approx(val_ref, rel=1e-4)


def classifier_spec(
    workdir: str, parallelism: dict[str, Any] | None = None, world: int = 1
) -> dict[str, Any]:
    raw = bert_spec(parallelism, world, train_iters=8, lr=2e-3, eval_interval=4)
    raw["kind"] = "finetune"
    raw["model"]["bert"] = {"post_layernorm": True, "num_labels": 2}
    raw["model"]["norm_eps"] = 1e-12  # the folder's (transformers' BERT)
    raw["model"]["init_from"] = f"hf:{(Path(workdir) / 'pretrained').as_uri()}"
    raw["data"]["train"] = [{"path": (Path(workdir) / "labels.jsonl").as_uri()}]
    raw["data"]["split"] = "80,20,0"
    return raw


def _classifier_rank(rank: int, world: int, workdir: str, parallelism: dict[str, Any]) -> list | None:
    import os

    import torch.distributed as dist

    from megatrain.engine.runtime import Dist
    from megatrain.engine.train import run
    from megatrain.spec import parse_spec

    os.environ["MEGATRAIN_CACHE_DIR"] = str(Path(workdir) / "cache")
    ctx = Dist()
    if world > 1:
        ctx = Dist(
            rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD
        )
    out = Path(workdir) / ("cls-" + "-".join(f"{k}{v}" for k, v in parallelism.items()))
    run(parse_spec(classifier_spec(workdir, parallelism, world)), out, ctx=ctx)
    return _rows(out) if rank == 0 else None


@pytest.mark.distributed
def test_a_sequence_classifier_fine_tunes_from_a_pretrained_bert_at_every_layout(tmp_path: Path) -> None:
    """kind finetune with model.bert.num_labels: [CLS] text [SEP] rows, the pooler and a fresh
    classifier on top of a BertForPreTraining folder's encoder; the label (does the sentence name a
    wolf?) is learnt, and tp and pp reproduce one process."""
    import random

    import transformers

    from .parallel._launch import run_distributed

    rng = random.Random(0)
    docs = [
        json.loads(line)["text"] for line in (EXAMPLES / "data" / "corpus.jsonl").read_text().splitlines()
    ]
    sentences = [s.strip() + "." for d in docs for s in d.split(".") if s.strip()]
    rows = [{"text": s, "label": int("wolf" in s)} for s in rng.sample(sentences, 400)]
    (tmp_path / "labels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=4,
                                     num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=32)  # fmt: skip
    transformers.BertForPreTraining(config).save_pretrained(tmp_path / "pretrained")

    ref = run_distributed(_classifier_rank, 1, str(tmp_path), {})[0]
    train = [r for r in ref if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"] and "token_accuracy" not in train[0]
    assert all(0 <= r["classification_accuracy"] <= 1 for r in train)
    valid = [r for r in ref if "val_loss" in r]
    assert [r["step"] for r in valid] == [4, 8] and "valid_classification_accuracy" in valid[-1]
    for layout in ({"tp": 2, "sequence_parallel": True, "dp": 1}, {"pp": 2, "dp": 1}):
        got = run_distributed(_classifier_rank, 2, str(tmp_path), layout)[0]
        for a, b in zip(train, [r for r in got if "loss" in r], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), layout
            assert b["classification_accuracy"] == a["classification_accuracy"], layout
        assert [r["val_loss"] for r in got if "val_loss" in r] == pytest.approx(
            [r["val_loss"] for r in valid], rel=1e-4
        )
