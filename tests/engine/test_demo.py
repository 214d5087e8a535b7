from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from megatrain.demo import build_stdlib_corpus, demo_spec
from megatrain.engine.data import split_bounds
from megatrain.plan.layout import resolve_layout
from megatrain.spec import parse_spec


def test_stdlib_corpus_is_deterministic(tmp_path: Path) -> None:
    a = build_stdlib_corpus(tmp_path / "a", max_bytes=200_000)
    b = build_stdlib_corpus(tmp_path / "b" / "corpus.jsonl.gz", max_bytes=200_000)
    assert a.name == "stdlib.jsonl.gz" and a.read_bytes() == b.read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(a.read_bytes()).splitlines()]
    paths = [r["path"] for r in rows]
    assert all(p.endswith(".py") for p in paths)
    assert not any("site-packages" in p for p in paths)
    assert 50_000 < sum(len(r["text"]) for r in rows) <= 200_000
    plain = build_stdlib_corpus(tmp_path / "c.jsonl", max_bytes=200_000)
    assert plain.read_bytes() == gzip.decompress(a.read_bytes())


def test_validation_documents_are_a_random_sample_of_the_corpus(tmp_path: Path) -> None:
    # The whole standard library, split as the demo spec splits it (by the engine's split_bounds):
    # validation must hold test-suite files and package sources in the proportions training holds.
    corpus = build_stdlib_corpus(tmp_path, max_bytes=1 << 40)
    rows = [json.loads(line) for line in gzip.decompress(corpus.read_bytes()).splitlines()]
    fractions = parse_spec(demo_spec(corpus.as_uri())).data.split_fractions
    (t0, t1), (v0, v1), _ = split_bounds(len(rows), fractions)
    train, valid = rows[t0:t1], rows[v0:v1]
    assert len(valid) >= 20

    def share_of_tests(docs: list[dict]) -> float:
        return sum(d["path"].startswith("test/") for d in docs) / len(docs)

    def mean_length(docs: list[dict]) -> float:
        return sum(len(d["text"]) for d in docs) / len(docs)

    assert abs(share_of_tests(valid) - share_of_tests(train)) < 0.2, (
        share_of_tests(valid),
        share_of_tests(train),
    )
    assert 0.5 < mean_length(valid) / mean_length(train) < 2
    # Not a tail of one package: the validation documents come from many top-level packages.
    assert len({d["path"].split("/")[0] for d in valid}) >= len(valid) // 3


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
