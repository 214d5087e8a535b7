"""T5 trains through the engine: spec -> span-corruption or input/target data -> T5Model -> the
decoder's per-token loss over its target tokens. Every parallel layout reproduces one process's run
on the same seed and samples (gloo, fp32); a checkpoint resumes under another layout and exports to
transformers' T5ForConditionalGeneration; a fine-tune starts from a transformers folder at
transformers' own loss."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOKENIZER = EXAMPLES / "data" / "t5_wordpiece.json"
VOCAB = 211  # t5_wordpiece.json's pieces (make_t5_vocab.py)


def t5_spec(parallelism: dict[str, Any] | None = None, world: int = 1, **training: Any) -> dict[str, Any]:
    """Span corruption of corpus.jsonl on a tiny T5 v1.0 (ReLU, tied head: its copies on several
    pipeline stages are the harder case), 32 encoder and 16 decoder positions."""
    return {
        "name": "t5-test",
        "kind": "pretrain",
        "model": {
            "arch": "t5",
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "seq_length": 32,
            "norm_eps": 1e-6,
            "t5": {
                "feed_forward": "relu",
                "kv_channels": 6,  # inner width 24 != hidden 32
                "decoder_seq_length": 16,
                "relative_attention_num_buckets": 8,
                "relative_attention_max_distance": 16,
            },
        },
        "data": {
            "tokenizer": {"type": "hf", "path": str(TOKENIZER)},
            "train": [{"path": (EXAMPLES / "data" / "corpus.jsonl").as_uri()}],
            "split": "90,10,0",
        },
        "training": {
            "train_iters": 6,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "lr": 1e-2,
            "warmup_iters": 1,
            "precision": "fp32",
            "log_interval": 1,
            "eval_interval": 3,
            "checkpoint_interval": 3,
            "seed": 7,
            **training,
        },
        "parallelism": {"distributed_optimizer": True, **(parallelism or {})},
        "resources": {"devices": world},
    }


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _rank(
    rank: int, world: int, workdir: str, parallelism: dict[str, Any], name: str
) -> list[dict[str, Any]] | None:
    import torch.distributed as dist

    from megatrain.engine.runtime import Dist
    from megatrain.engine.train import run
    from megatrain.spec import parse_spec

    os.environ["MEGATRAIN_CACHE_DIR"] = str(Path(workdir) / "cache")
    raw = t5_spec(parallelism, world)
    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    out = Path(workdir) / name
    run(parse_spec(raw), out, ctx=ctx if world > 1 else Dist())
    return _rows(out) if rank == 0 else None


LAYOUTS = {
    "tp2-sp": {"tp": 2, "sequence_parallel": True, "dp": 1},
    "pp2-split1": {"pp": 2, "dp": 1, "pipeline_split_rank": 1},
    "pp2-split1-zbh1": {"pp": 2, "dp": 1, "pipeline_split_rank": 1, "pipeline_schedule": "zb-h1"},
    "dp2-distopt": {"dp": 2},
}


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    from .parallel._launch import run_distributed

    workdir = str(tmp_path_factory.mktemp("t5"))
    rows = run_distributed(_rank, 1, workdir, {}, "single")[0]
    return workdir, rows


def test_t5_learns_and_reports_decoder_token_accuracy(single: tuple[str, list[dict[str, Any]]]) -> None:
    workdir, rows = single
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    # Cross-entropy over the 211 real pieces (ln 211 = 5.35) at the start; the targets are
    # sentinels and masked words, whose frequencies the model picks up within a few steps.
    assert 4.8 < train[0]["loss"] < 5.9
    assert train[-1]["loss"] < train[0]["loss"] - 0.1  # (5.36 -> 5.15 measured)
    # The decoder's targets: sentinels (the first is always <extra_id_0>) and the masked words.
    assert all(0 <= r["token_accuracy"] <= 1 for r in train) and max(r["token_accuracy"] for r in train) > 0.1
    assert all(r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0 for r in train)
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert all(0 < r["valid_mean_token_accuracy"] < 1 for r in rows if "val_loss" in r)
    saved = sorted(p.name for p in (Path(workdir) / "single" / "checkpoints").glob("iter_*"))
    assert saved == ["iter_0000003", "iter_0000006"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_t5_layouts_match_one_process(single: tuple[str, list[dict[str, Any]]], layout: str) -> None:
    """Only the fp32 summation order differs between layouts (row-parallel partial sums, the
    vocab-parallel softmax, gradients of the shared embedding's stage copies summed over stages,
    dp reduce-scatters): ~1e-6 apart; a lost copy gradient, a wrong head shard or a doubled loss
    moves the losses by far more than the 1e-4 allowed (Adam turns rounding noise on a near-zero
    gradient into an lr-sized step, so later steps drift a little: 1e-3 on the gradient norm)."""
    from .parallel._launch import run_distributed

    workdir, ref = single
    got = run_distributed(_rank, 2, workdir, LAYOUTS[layout], layout)[0]
    want = [r for r in ref if "loss" in r]
    have = [r for r in got if "loss" in r]
    assert len(have) == len(want) == 6
    assert ("pipeline_bubble_fraction" in have[0]) == ("pp" in LAYOUTS[layout])  # a pipeline ran
    for a, b in zip(want, have, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), layout
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), layout
        assert b["token_accuracy"] == pytest.approx(a["token_accuracy"], abs=2e-3), layout
    val_ref = [r["val_loss"] for r in ref if "val_loss" in r]
    val_got = [r["val_loss"] for r in got if "val_loss" in r]
    assert val_got == pytest.approx(val_ref, rel=1e-4)


# -- fine-tuning from a transformers folder ------------------------------------------------------

PAIRS = EXAMPLES / "data" / "t5_pairs.jsonl"
HF_SHAPE = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4}


def hf_folder(path: Path) -> Path:
    """A random transformers T5 v1.1 (gated GELU, its own head) over t5_wordpiece.json's pieces,
    saved with save_pretrained."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=VOCAB, **HF_SHAPE, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0, layer_norm_epsilon=1e-6,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, 32) * 0.05)  # untied: its own values
    model.save_pretrained(path)
    return path


def finetune_spec(folder: Path, parallelism: dict[str, Any] | None = None, world: int = 1) -> dict[str, Any]:
    """Text to text on t5_pairs.jsonl (copy, reverse, sort word lists) from the folder's weights."""
    return {
        "name": "t5-finetune-test",
        "kind": "finetune",
        "model": {
            "arch": "t5",
            "init_from": f"hf:{folder.as_uri()}",
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "ffn_hidden_size": 64,
            "seq_length": 16,
            "norm_eps": 1e-6,
            "t5": {
                "num_decoder_layers": 2,
                "kv_channels": 8,
                "feed_forward": "gated-gelu",
                "decoder_seq_length": 8,
                "relative_attention_num_buckets": 8,
                "relative_attention_max_distance": 16,
            },
        },
        "data": {
            "tokenizer": {"type": "hf", "path": str(TOKENIZER)},
            "train": [{"path": PAIRS.as_uri()}],
            "split": "95,5,0",
        },
        "training": {
            "train_iters": 8,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "lr": 3e-3,
            "warmup_iters": 1,
            "precision": "fp32",
            "log_interval": 1,
            "eval_interval": 0,
            "checkpoint_interval": 0,
            "seed": 3,
        },
        "parallelism": {"distributed_optimizer": True, **(parallelism or {})},
        "resources": {"devices": world},
    }


def _finetune_rank(
    rank: int, world: int, folder: str, workdir: str, parallelism: dict[str, Any], name: str
) -> Any:
    import torch.distributed as dist

    from megatrain.engine.runtime import Dist
    from megatrain.engine.train import run
    from megatrain.spec import parse_spec

    os.environ["MEGATRAIN_CACHE_DIR"] = str(Path(workdir) / "cache")
    ctx = Dist(rank=rank, world_size=world, local_rank=rank, local_world_size=world, group=dist.group.WORLD)
    out = Path(workdir) / name
    run(parse_spec(finetune_spec(Path(folder), parallelism, world)), out, ctx=ctx if world > 1 else Dist())
    return _rows(out) if rank == 0 else None


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict[str, Any]]]:
    from .parallel._launch import run_distributed

    workdir = tmp_path_factory.mktemp("t5-finetune")
    folder = hf_folder(workdir / "hf-t5")
    rows = run_distributed(_finetune_rank, 1, str(folder), str(workdir), {}, "single")[0]
    return folder, workdir, rows


def test_a_finetune_from_transformers_starts_at_its_loss_on_target_tokens_only(
    finetuned: tuple[Path, Path, list[dict[str, Any]]],
) -> None:
    """The first step's loss is transformers' own on the same rows with every non-target label
    ignored (-100), and each row's loss tokens are its target's tokens and the end token, counted
    from the JSONL record itself: the loss counts target tokens only. Then it learns."""
    import numpy as np
    import torch
    import transformers

    from megatrain.engine.data import build_datasets, build_tokenizer
    from megatrain.spec import parse_spec

    folder, workdir, rows = finetuned
    spec = parse_spec(finetune_spec(folder))
    os.environ["MEGATRAIN_CACHE_DIR"] = str(workdir / "cache")
    tokenizer = build_tokenizer(spec.data.tokenizer)
    train = build_datasets(spec, tokenizer, spec.model.seq_length)["train"]
    batch = train.batch(list(range(8)))  # the first step's rows, in order (dp = 1)
    records = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    for row in range(8):
        target = records[train.record(row)]["target"]
        assert batch.loss_mask[row].sum() == len(tokenizer.encode(target)) + 1  # + [EOS]
        assert batch.tokens[row][batch.enc_mask[row] > 0][-1] == 6  # the input ends in [EOS]
    hf = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
    with torch.no_grad():
        expect = hf(
            input_ids=torch.as_tensor(batch.tokens),
            attention_mask=torch.as_tensor(batch.enc_mask),
            decoder_input_ids=torch.as_tensor(batch.dec_tokens),
            decoder_attention_mask=torch.as_tensor(batch.dec_mask),
            labels=torch.as_tensor(np.where(batch.loss_mask > 0, batch.labels, -100)),
        ).loss.item()
    losses = [r["loss"] for r in rows if "loss" in r]
    # fp32, the same weights; only reduction orders differ (~1e-7).
    assert losses[0] == pytest.approx(expect, rel=1e-5)
    assert losses[-1] < losses[0] - 0.3  # (5.46 -> 4.97 measured)
    assert all(0 <= r["token_accuracy"] <= 1 for r in rows if "loss" in r)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2-sp", "pp2-split1"])
def test_a_finetune_from_transformers_matches_one_process(
    finetuned: tuple[Path, Path, list[dict[str, Any]]], layout: str
) -> None:
    """Each rank reads its own slices of the transformers folder (interop.hf_t5.t5_hf_slices: a
    tensor-parallel rank its heads' rows and bias-table columns, a stage its layers) and trains as
    one process does."""
    from .parallel._launch import run_distributed

    folder, workdir, ref = finetuned
    got = run_distributed(_finetune_rank, 2, str(folder), str(workdir), LAYOUTS[layout], layout)[0]
    want = [r["loss"] for r in ref if "loss" in r]
    assert [r["loss"] for r in got if "loss" in r] == pytest.approx(want, rel=1e-4)


# -- checkpoints ---------------------------------------------------------------------------------


@pytest.mark.distributed
def test_a_checkpoint_resumes_under_a_pipeline_and_exports_to_transformers(
    single: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The one-process run's step-3 checkpoint resumes at pp=2 (the shared embedding's and tables'
    stage copies read from the one saved tensor) and continues as the uninterrupted run did; its
    step-6 checkpoint exports to a folder transformers loads, whose logits are the checkpoint's."""
    import torch
    import transformers

    from megatrain.engine.checkpoint import load_checkpoint
    from megatrain.engine.interop.hf import export_checkpoint_hf

    from .parallel._launch import run_distributed

    workdir, ref = single
    checkpoints = Path(workdir) / "single" / "checkpoints"
    resumed = Path(workdir) / "resumed" / "checkpoints"
    shutil.copytree(checkpoints / "iter_0000003", resumed / "iter_0000003")
    (resumed / "latest").write_text("3\n")
    got = run_distributed(_rank, 2, workdir, LAYOUTS["pp2-split1"], "resumed")[0]
    want = {r["step"]: r["loss"] for r in ref if "loss" in r}
    have = {r["step"]: r["loss"] for r in got if "loss" in r}
    assert sorted(have) == [4, 5, 6]
    assert [have[s] for s in have] == pytest.approx([want[s] for s in have], rel=1e-4)

    export_checkpoint_hf(checkpoints / "iter_0000006", tmp_path / "hf", dtype=torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["decoder_start_token_id"], config["eos_token_id"], config["pad_token_id"]) == (5, 6, 0)
    hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    ours, _ = load_checkpoint(checkpoints / "iter_0000006")
    g = torch.Generator().manual_seed(0)
    enc, dec = torch.randint(7, VOCAB, (2, 12), generator=g), torch.randint(7, VOCAB, (2, 5), generator=g)
    with torch.no_grad():
        expect = hf(input_ids=enc, decoder_input_ids=dec).logits
        torch.testing.assert_close(ours(enc, dec)[..., :VOCAB], expect, rtol=1e-5, atol=1e-5)


# -- the engine's gradients ----------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["relu", "gated-gelu"])
def test_the_engines_gradients_are_autograds(flavour: str) -> None:
    """The engine's T5 (meta build, materialised, DataParallel's gradient buffer with fused
    accumulation) gets, for one micro-batch, the gradient plain autograd gives the same weights:
    a tied head's share beside the embedding's fused one is not dropped (layouts agreeing with one
    process could not tell). Same fp32 ops in the same order: equal to 1e-6."""
    import torch

    from megatrain.engine.build import build_model, lm_loss, make_trainable
    from megatrain.engine.config import t5_config, train_config
    from megatrain.engine.microbatch import T5MicroBatch
    from megatrain.engine.models.t5 import T5Model
    from megatrain.engine.parallel.state import ParallelState
    from megatrain.spec import ParallelismSpec, parse_spec

    raw = t5_spec()
    raw["model"]["t5"]["feed_forward"] = flavour
    spec = parse_spec(raw)
    cfg, tcfg = t5_config(spec, VOCAB), train_config(spec, 1)
    state = ParallelState.single()
    train = make_trainable(build_model(cfg, state, 7, "cpu"), tcfg, ParallelismSpec(), "fp32", cfg)
    reference = T5Model(cfg)
    reference.load_state_dict(train.model.module.state_dict())
    g = torch.Generator().manual_seed(0)
    enc, dec = torch.randint(7, VOCAB, (2, 32), generator=g), torch.randint(7, VOCAB, (2, 16), generator=g)
    mask = torch.ones(2, 16)
    mask[1, 9:] = 0
    mb = T5MicroBatch(enc, torch.roll(dec, -1, 1), mask, dec_tokens=dec, enc_mask=torch.ones_like(enc))
    lm_loss(train.ddp, mb, state).backward()
    train.ddp.finish_grad_sync()
    reference.loss(enc, dec, mb.labels, mask, mb.enc_mask).backward()
    for name, p in reference.named_parameters():
        ours = train.model.module.get_parameter(name).main_grad
        torch.testing.assert_close(ours, p.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert cfg.tie_embeddings == (flavour == "relu")  # both heads were checked
