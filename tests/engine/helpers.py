"""Helpers for the engine tests: a tiny deterministic corpus and tiny specs."""

from __future__ import annotations

import base64
import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

WORDS = ["def", "return", "import", "class", "self", "while", "for", "if", "else", "yield", "lambda", "None"]


def write_corpus(path: Path, num_docs: int = 120, seed: int = 0) -> Path:
    """Documents of pseudo-code built from a small vocabulary: learnable, deterministic."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_docs):
            lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(12)]
            f.write(json.dumps({"text": f"# doc {i}\n" + "\n".join(lines)}) + "\n")
    return path


def tiny_spec(corpus: Path, **training: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "tiny",
        "model": {
            "arch": "llama",
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 64,
            "seq_length": 32,
        },
        "data": {"train": [{"path": corpus.as_uri()}], "split": "90,10,0"},
        "training": {
            "train_iters": 6,
            "global_batch_size": 8,
            "micro_batch_size": 2,
            "lr": 1e-2,
            "warmup_iters": 2,
            "precision": "fp32",
            "log_interval": 1,
            "eval_interval": 3,
            "eval_iters": 2,
            "checkpoint_interval": 3,
            "seed": 7,
        },
        "resources": {"devices": 1},
    }
    spec["training"].update(training)
    return copy.deepcopy(spec)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_adam_weights_close(
    mine: dict[str, Any], theirs: dict[str, Any], *, lr: float, steps: int, rel_norm: float = 1e-4
) -> None:
    """Weights two runs reached from the same start with Adam: equal up to summation order.

    Adam normalises each element's update, so a gradient below its epsilon (a vocabulary row the
    batches rarely touch) turns a rounding difference into an lr-sized step of that one element.
    Elementwise closeness is therefore fragile; what a layout mistake (a wrong shard, a missing
    average, a rank seeing the wrong samples) changes is the tensor as a whole. So: each tensor's
    difference is at most `rel_norm` of its norm (a mistake gives >= 1e-2); at most 0.1% of its
    elements fall outside rtol 1e-3 / atol 1e-5, and none moved further apart than two Adam
    trajectories can (each run moves an element by at most about lr per step).
    """
    import torch

    assert mine.keys() == theirs.keys()
    for name, ref in theirs.items():
        got = mine[name]
        assert got.shape == ref.shape, name
        diff = (got.double() - ref.double()).abs()
        assert diff.norm() <= rel_norm * ref.double().norm() + 1e-12, (name, float(diff.norm()))
        loose = ~torch.isclose(got, ref, rtol=1e-3, atol=1e-5)
        assert int(loose.sum()) <= max(1, ref.numel() // 1000), (name, int(loose.sum()))
        assert float(diff.max()) <= 2 * lr * steps, (name, float(diff.max()))


def tiktoken_ranks_file(path: Path) -> Path:
    """A tiktoken ranks file: every byte, then merges that build "hello" and "world"."""
    # Every byte, then merges that build "hello" and "world" (a merge needs its parts ranked lower).
    tokens = [bytes([i]) for i in range(256)] + [
        b"he",
        b"ll",
        b"hell",
        b"hello",
        b" w",
        b"or",
        b" wor",
        b" world",
    ]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return path


def torchrun(nproc: int, spec: Path, out: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone` of the engine on `spec` with `nproc` gloo ranks, output under `out`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatrain.engine.train", "--spec", str(spec), "--out", str(out)]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
