"""The demo job: a small Llama trained on the Python standard library's own sources.

No torch here: the CLI imports this to build the corpus and the spec, then submits the job like
any other. The spec is tuned to converge visibly in a few minutes on 2 CPU cores. Measured with
the default 4 MiB corpus on this project's 2-core AVX2 machine (single process, fp32): 133 s wall,
first logged loss 5.32, final 1.56 (29%), 4 checkpoints (the validation loss of 1.06 measured then
came from a path-sorted split, since replaced by a random one). It runs slower when other
processes (the API, tests) share the two cores.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import sysconfig
from pathlib import Path
from typing import Any

DEFAULT_CORPUS_BYTES = 4 << 20
CORPUS_NAME = "stdlib.jsonl.gz"
CORPUS_SEED = 0
"""Seeds the corpus's document order: the spec's split takes contiguous document ranges (the last
2% for validation, as Megatron), so the documents must come in random order for validation to be
a random sample; sorted by path it held only the last packages (xml, zoneinfo) and its loss sat
far below the training loss."""
# Not the standard library's own code: third-party installs and bundled wheels.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "ensurepip", "idlelib", "turtledemo"}


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted by path relative to its root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_stdlib_corpus(dest: Path, max_bytes: int = DEFAULT_CORPUS_BYTES) -> Path:
    """Write {"text", "path"} JSON lines for stdlib sources, in a seeded random order, until
    max_bytes of text; returns the file. Any contiguous range of its lines (a split) is a random
    sample of the standard library.

    `dest` is the file to write (.jsonl or .jsonl.gz) or a directory to put stdlib.jsonl.gz in.
    The output is byte-for-byte deterministic for a given Python install (gzip mtime is fixed).
    """
    dest = Path(dest)
    if not dest.name.endswith((".jsonl", ".jsonl.gz")):
        dest = dest / CORPUS_NAME
    dest.parent.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    buf = io.BytesIO()
    total = 0
    sources = stdlib_sources()
    random.Random(CORPUS_SEED).shuffle(sources)
    for path in sources:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
        if not text.strip():
            continue
        if total and total + len(text) > max_bytes:
            break
        line = json.dumps({"text": text, "path": path.relative_to(root).as_posix()})
        buf.write(line.encode("utf-8") + b"\n")
        total += len(text)
    data = buf.getvalue()
    if dest.name.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return dest


def demo_spec(corpus_url: str, tp: int = 1, dp: int = 1, sequence_parallel: bool = False) -> dict[str, Any]:
    """A small byte-level Llama (GQA, SwiGLU, RoPE) on the corpus at corpus_url, on tp×dp processes."""
    parallelism: dict[str, Any] | str = "auto"
    if tp * dp > 1:
        parallelism = {"tp": tp, "dp": dp, "sequence_parallel": sequence_parallel}
    return {
        "name": "demo-llama-stdlib",
        "kind": "pretrain",
        "model": {
            "arch": "llama",
            "num_layers": 6,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 352,
            "seq_length": 128,
        },
        "data": {
            "tokenizer": {"type": "byte"},
            "train": [{"path": corpus_url, "weight": 1.0}],
            "split": "98,2,0",
        },
        "training": {
            "train_iters": 500,
            "global_batch_size": 16,
            "micro_batch_size": max(1, 16 // dp),
            "lr": 3e-3,
            "min_lr": 3e-4,
            "lr_schedule": "cosine",
            "warmup_iters": 50,
            "weight_decay": 0.1,
            # bf16 would fall back to fp32 on CPUs without native bf16 anyway (see engine.train).
            "precision": "fp32",
            "checkpoint_interval": 125,
            "log_interval": 10,
            "eval_interval": 125,
            "eval_iters": 4,
            "seed": 1234,
        },
        "parallelism": parallelism,
        "resources": {"devices": tp * dp, "max_runtime_s": 1800},
    }


SAMPLE_PROMPTS = ("def ", "import ", "class ")
"""What the demo asks the trained model to continue: a line each, to show it learned Python's shape."""
