"""A spec's data as datasets: indexed prefixes in place, JSONL tokenized into the cache, splits, blends."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatrain.engine.data import ByteTokenizer, IndexedDataset, IndexedDatasetWriter, build_datasets
from megatrain.spec import JobSpec

from .helpers import write_corpus

TOKENIZER = ByteTokenizer()


def _spec(sources: list[dict[str, Any]], **data: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "d",
            "data": {"train": sources, **data},
            "training": {"train_iters": 5, "global_batch_size": 4, "micro_batch_size": 2, "eval_iters": 2},
        }
    )


def _indexed(prefix: Path, docs: int, marker: int) -> Path:
    """Documents whose first token is `marker` and second the document's number."""
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(docs):
            w.add_document([marker, i, *([marker] * 20), TOKENIZER.eod])
    return prefix


def test_indexed_sources_split_and_blend(tmp_path: Path) -> None:
    a = _indexed(tmp_path / "a", 50, 1)
    b = _indexed(tmp_path / "b", 50, 2)
    spec = _spec([{"path": a.as_uri(), "weight": 3}, {"path": b.as_uri()}], split="80,20,0")
    ds = build_datasets(spec, TOKENIZER, seq_length=16, cache_root=tmp_path / "cache")
    assert ds["test"] is None and ds["train"] is not None and ds["valid"] is not None
    assert len(ds["train"]) == 5 * 4 and len(ds["valid"]) == 2 * 4  # what the run consumes
    train = ds["train"].batch(range(20)).tokens
    # 3:1 by weight: count the rows by the source marker they start with or mostly hold.
    marks = [int(np.bincount(row[row < 3], minlength=3)[1:].argmax()) + 1 for row in train]
    assert marks.count(1) == 15 and marks.count(2) == 5
    # The valid split reads only the last 20% of documents (numbers 40..49) of each source.
    valid = ds["valid"].batch(range(8)).tokens
    doc_numbers = {
        int(row[i + 1]) for row in valid for i in range(15) if row[i] in (1, 2) and row[i + 1] not in (1, 2)
    }
    assert doc_numbers and all(n >= 40 for n in doc_numbers)
    indices = list((tmp_path / "cache").parent.glob("cache/GPTDataset_indices/*-GPTDataset-description.txt"))
    assert len(indices) == 4  # beside the data, as Megatron keeps them: two splits of two sources


def test_jsonl_is_tokenized_once_into_the_cache(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", num_docs=30, seed=1)
    spec = _spec([{"path": corpus.as_uri()}], split="90,10,0")
    cache = tmp_path / "cache"
    first = build_datasets(spec, TOKENIZER, seq_length=16, cache_root=cache)["train"]
    (built,) = cache.glob("jsonl/*/documents.idx")
    indexed = IndexedDataset(str(built)[: -len(".idx")])
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert indexed.num_documents == 30
    assert indexed.document(3).tolist() == [*texts[3].encode(), TOKENIZER.eod]
    stamp = built.stat().st_mtime_ns
    again = build_datasets(spec, TOKENIZER, seq_length=16, cache_root=cache)["train"]
    assert built.stat().st_mtime_ns == stamp
    assert np.array_equal(first.batch(range(8)).tokens, again.batch(range(8)).tokens)
    corpus.write_text(corpus.read_text() + json.dumps({"text": "one more"}) + "\n")  # a new version
    build_datasets(spec, TOKENIZER, seq_length=16, cache_root=cache)
    assert len(list(cache.glob("jsonl/*/documents.idx"))) == 2


def test_a_source_that_is_not_there_is_named(tmp_path: Path) -> None:
    spec = _spec([{"path": (tmp_path / "nope").as_uri()}])
    with pytest.raises(FileNotFoundError, match=r"data.train.0.path=.*nope\.idx"):
        build_datasets(spec, TOKENIZER, seq_length=16, cache_root=tmp_path)
    spec = _spec([{"path": (tmp_path / "nope.jsonl").as_uri()}])
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl does not exist"):
        build_datasets(spec, TOKENIZER, seq_length=16, cache_root=tmp_path)
    spec = _spec([{"dataset": "wiki"}])
    with pytest.raises(ValueError, match=r"data.train.0 names dataset 'wiki' without a path"):
        build_datasets(spec, TOKENIZER, seq_length=16, cache_root=tmp_path)


def test_packing_follows_the_kind_unless_set(tmp_path: Path) -> None:
    a = _indexed(tmp_path / "a", 20, 1)
    plain = build_datasets(_spec([{"path": a.as_uri()}]), TOKENIZER, 16, tmp_path / "c")["train"]
    spec = _spec([{"path": a.as_uri()}], packing=True)
    packed = build_datasets(spec, TOKENIZER, 16, tmp_path / "c")["train"]
    assert plain.batch([0]).segment_ids is None
    segs = packed.batch(range(4)).segment_ids
    assert segs is not None and segs.max() >= 1  # 23-token documents: a 16-token sample crosses one


def test_a_held_out_source_is_validated_whole(tmp_path: Path) -> None:
    """data.valid (Megatron's --valid-data-path): its documents blend into the validation split with
    data.train's valid share, and never into training."""
    a = _indexed(tmp_path / "a", 50, 1000)
    held = _indexed(tmp_path / "held", 10, 2000)
    spec = _spec([{"path": a.as_uri()}], valid=[{"path": held.as_uri()}], split="1,0,0")
    ds = build_datasets(spec, TOKENIZER, seq_length=16, cache_root=tmp_path / "cache")
    assert ds["valid"] is not None and ds["test"] is None
    assert 2000 not in ds["train"].batch(range(20)).tokens  # the held-out marker
    valid = ds["valid"].batch(range(8)).tokens
    assert 2000 in valid and 1000 not in valid
    spec = _spec([{"path": a.as_uri()}], valid=[{"path": held.as_uri()}], split="80,20,0")
    both = build_datasets(spec, TOKENIZER, seq_length=16, cache_root=tmp_path / "cache2")["valid"]
    tokens = both.batch(range(8)).tokens
    assert 1000 in tokens and 2000 in tokens  # data.train's last 20% and the held-out source
