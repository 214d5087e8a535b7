from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from megatrain.engine.data import (
    BlendedDataset,
    ByteTokenizer,
    SourceDataset,
    build_datasets,
    document_split_bounds,
    microbatch_sample_ids,
    read_jsonl_texts,
)
from megatrain.engine.data.dataset import token_stream
from megatrain.spec import DataSpec

from .helpers import write_corpus


def test_document_split_bounds() -> None:
    assert document_split_bounds(100, (0.98, 0.02, 0.0)) == [(0, 98), (98, 100), (100, 100)]
    assert document_split_bounds(3, (0.98, 0.02, 0.0)) == [(0, 3), (3, 3), (3, 3)]
    bounds = document_split_bounds(7, (1 / 3, 1 / 3, 1 / 3))
    assert bounds[0][0] == 0 and bounds[-1][1] == 7
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))


def test_jsonl_plain_gz_and_key(tmp_path: Path) -> None:
    rows = [{"body": "one"}, {"body": "two ✓"}]
    plain = tmp_path / "a.jsonl"
    plain.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    gz = tmp_path / "a.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_jsonl_texts(plain.as_uri(), "body") == ["one", "two ✓"]
    assert read_jsonl_texts(gz.as_uri(), "body") == ["one", "two ✓"]
    with pytest.raises(ValueError, match=r"a\.jsonl:1: no string field 'text'"):
        read_jsonl_texts(plain.as_uri())


def test_token_stream_separates_documents() -> None:
    stream = token_stream(["ab", "c"], ByteTokenizer())
    assert stream.tolist() == [97, 98, 256, 99, 256]


def test_source_windows_deterministic_and_cover_each_epoch() -> None:
    tokens = np.arange(1001, dtype=np.uint16)
    a, b = SourceDataset(tokens, 10, seed=1), SourceDataset(tokens, 10, seed=1)
    assert len(a) == 100
    starts = [int(a[i][0]) for i in range(100)]
    assert sorted(starts) == list(range(0, 1000, 10))  # one epoch = every chunk once
    assert all(np.array_equal(a[i], b[i]) for i in range(250))
    assert all(len(a[i]) == 11 and a[i][-1] == a[i][0] + 10 for i in range(150))
    assert [int(a[i][0]) for i in range(100, 200)] != starts  # a new order each epoch
    assert [int(SourceDataset(tokens, 10, seed=2)[i][0]) for i in range(100)] != starts


def test_blending_follows_weights() -> None:
    s1 = SourceDataset(np.zeros(1000, dtype=np.uint16), 4, seed=0)
    s2 = SourceDataset(np.ones(1000, dtype=np.uint16), 4, seed=0)
    mix = BlendedDataset([s1, s2], [3.0, 1.0])
    picks = [int(mix[i][0]) for i in range(400)]
    assert picks.count(0) == 300 and picks.count(1) == 100
    # Every prefix stays within one sample of its share (deterministic greedy blending).
    assert all(abs(picks[:n].count(1) - n / 4) <= 1 for n in range(1, 400))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_shards_are_disjoint_and_cover_the_batch(dp: int) -> None:
    gb, mbs, consumed = 16, 2, 48
    shards = [microbatch_sample_ids(consumed, gb, mbs, r, dp) for r in range(dp)]
    flat = [i for shard in shards for micro in shard for i in micro]
    assert sorted(flat) == list(range(consumed, consumed + gb))
    assert all(len(micro) == mbs for shard in shards for micro in shard)
    assert all(len(shard) == gb // (mbs * dp) for shard in shards)


def test_build_datasets_splits_documents(tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a.jsonl", num_docs=50, seed=1)
    b = write_corpus(tmp_path / "b.jsonl", num_docs=10, seed=2)
    spec = DataSpec(train=[{"path": a.as_uri(), "weight": 2}, {"path": b.as_uri()}], split="80,20,0")
    ds = build_datasets(spec, ByteTokenizer(), seq_length=16, seed=3)
    assert ds["test"] is None
    train, valid = ds["train"], ds["valid"]
    assert len(train.sources) == 2 and len(valid.sources) == 2
    # Valid holds the last 20% of each file's documents, and no train window reaches them.
    valid_text = bytes(valid.sources[0].tokens[valid.sources[0].tokens < 256].astype(np.uint8)).decode()
    assert valid_text.startswith("# doc 40\n")
    train_text = bytes(train.sources[0].tokens[train.sources[0].tokens < 256].astype(np.uint8)).decode()
    assert "# doc 39\n" in train_text and "# doc 40\n" not in train_text
    again = build_datasets(spec, ByteTokenizer(), seq_length=16, seed=3)["train"]
    assert np.array_equal(train.batch(range(40)).tokens, again.batch(range(40)).tokens)
