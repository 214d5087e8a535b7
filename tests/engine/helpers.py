"""Helpers for the engine tests: a tiny deterministic corpus and tiny specs."""

from __future__ import annotations

import copy
import json
import random
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
