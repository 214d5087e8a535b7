from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from megatrain.demo import build_stdlib_corpus, demo_spec
from megatrain.plan.layout import resolve_layout
from megatrain.spec import parse_spec


def test_stdlib_corpus_is_deterministic(tmp_path: Path) -> None:
    a = build_stdlib_corpus(tmp_path / "a", max_bytes=200_000)
    b = build_stdlib_corpus(tmp_path / "b" / "corpus.jsonl.gz", max_bytes=200_000)
    assert a.name == "stdlib.jsonl.gz" and a.read_bytes() == b.read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(a.read_bytes()).splitlines()]
    paths = [r["path"] for r in rows]
    assert paths == sorted(paths) and all(p.endswith(".py") for p in paths)
    assert not any("site-packages" in p for p in paths)
    assert 50_000 < sum(len(r["text"]) for r in rows) <= 200_000
    plain = build_stdlib_corpus(tmp_path / "c.jsonl", max_bytes=200_000)
    assert plain.read_bytes() == gzip.decompress(a.read_bytes())


def test_demo_spec_is_a_valid_single_process_llama_job(tmp_path: Path) -> None:
    spec = parse_spec(demo_spec((tmp_path / "stdlib.jsonl.gz").as_uri()))
    assert spec.model.arch == "llama" and spec.data.tokenizer.type == "byte"
    assert spec.model.query_groups < spec.model.num_attention_heads  # exercises GQA
    assert resolve_layout(spec).world_size == 1
    t = spec.training
    assert t.checkpoint_interval and t.train_iters // t.checkpoint_interval >= 2


def test_demo_imports_no_torch() -> None:
    code = "import sys, megatrain.demo, megatrain.engine.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
