"""benchmarks/preprocess.py runs at a tiny size: every variant wrote the same dataset as the plain
loop, counted the same documents and tokens, and reported a peak RSS; the loader section printed its
table. Figures live in BENCHMARKS.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_preprocess_benchmark_tiny(tmp_path: Path) -> None:
    out = tmp_path / "preprocess.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "preprocess.py"),
            "--tiny",
            "--tokenizers",
            "bpe",
            "--workers",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vs plain" in proc.stdout and "2 workers" in proc.stdout  # the table and the verdicts
    data = json.loads(out.read_text())
    rows = data["preprocess"]["rows"]
    assert {(r["tokenizer"], r["variant"], r["workers"]) for r in rows} == {
        ("bpe", "plain", 0),
        ("bpe", "megatron", 2),
        ("bpe", "preprocess", 2),
    }
    assert len(rows) == 6  # two corpus sizes
    assert all(r["identical"] and r["tokens"] > r["documents"] > 0 and r["rss_parent_mb"] > 0 for r in rows)
    for r in rows:
        same = [o for o in rows if o["tokenizer"] == r["tokenizer"] and o["corpus_mb"] == r["corpus_mb"]]
        assert {(o["documents"], o["tokens"]) for o in same} == {(r["documents"], r["tokens"])}
    # Megatron's worker processes' peak was read; ours are threads, set beside Megatron's time.
    assert all(r["rss_worker_mb"] > 0 for r in rows if r["variant"] == "megatron")
    assert all(r["vs_megatron"] > 0 for r in rows if r["variant"] == "preprocess")
    assert "samples/s" in data["loader"]["table"] and "samples/s" in proc.stdout  # benchmarks/_loader.py ran
