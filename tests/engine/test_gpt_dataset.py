"""GPTDataset, BlendedDataset and the loaders over indexed datasets, against Megatron-LM's own code."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatrain.engine.data import (
    BlendedDataset,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    Loader,
    microbatch_sample_ids,
    split_bounds,
)
from megatrain.engine.data.gpt_dataset import blending_indices, segments

EOD, L, SEED = 0, 16, 7


def _write(prefix: Path, docs: int = 40, seed: int = 0) -> IndexedDataset:
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(docs):
            w.add_document(np.append(rng.integers(1, 100, int(rng.integers(1, 30))), EOD))
    return IndexedDataset(prefix)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> IndexedDataset:
    return _write(tmp_path_factory.mktemp("gpt") / "corpus")


def _dataset(ds: IndexedDataset, bounds: tuple[int, int], n: int, cache: Path, **kw: object) -> GPTDataset:
    return GPTDataset(ds, bounds, L, n, SEED, cache, {"dataset_path": str(ds.idx_path)}, **kw)  # type: ignore[arg-type]


def test_split_bounds_round_as_megatron() -> None:
    assert split_bounds(100, (0.98, 0.02, 0.0)) == [(0, 98), (98, 100), (100, 100)]
    assert split_bounds(3, (0.98, 0.02, 0.0)) == [(0, 3), (3, 3), (3, 3)]
    # 0.5·5 and 0.3·5 round to 2 (banker's) and 2: the gap of one moves every later boundary.
    assert split_bounds(5, (0.5, 0.3, 0.2)) == [(0, 2), (2, 4), (4, 5)]


def test_an_epoch_serves_every_token_once(corpus: IndexedDataset, tmp_path: Path) -> None:
    ds = _dataset(corpus, (0, len(corpus)), None, tmp_path)  # type: ignore[arg-type]
    windows = [ds.window(i) for i in range(len(ds))]
    assert all(len(w) == L + 1 for w in windows)
    # Samples follow the shuffled documents; unshuffled, consecutive samples share one token.
    order = np.argsort(np.asarray(ds.indices.shuffle_index))
    stream = np.concatenate([windows[i][:-1] for i in order])
    docs = np.concatenate([corpus.document(int(d)) for d in ds.indices.document_index])
    assert np.array_equal(stream, docs[: len(stream)]) and len(docs) - len(stream) <= L
    again = _dataset(corpus, (0, len(corpus)), None, tmp_path / "other-cache")  # type: ignore[arg-type]
    assert all(np.array_equal(ds.window(i), again.window(i)) for i in range(len(ds)))
    other_seed = GPTDataset(corpus, (0, len(corpus)), L, None, SEED + 1, tmp_path, {})  # type: ignore[arg-type]
    assert not all(np.array_equal(ds.window(i), other_seed.window(i)) for i in range(len(ds)))


def test_more_samples_than_an_epoch_take_further_epochs(corpus: IndexedDataset, tmp_path: Path) -> None:
    one = _dataset(corpus, (0, 10), None, tmp_path)  # type: ignore[arg-type]
    many = _dataset(corpus, (0, 10), 5 * len(one), tmp_path)
    assert len(many) >= 5 * len(one)
    tokens = int(corpus.sequence_lengths[:10].sum())
    assert len(np.asarray(many.indices.document_index)) == 10 * -(-(5 * len(one) * L + 1) // tokens)


def test_segments_restart_after_each_eod() -> None:
    tokens = np.array([[5, 6, EOD, 7, EOD, EOD, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
    pos, seg = segments(tokens, EOD)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]


def test_packed_samples_carry_positions_and_segments(corpus: IndexedDataset, tmp_path: Path) -> None:
    ds = _dataset(corpus, (0, len(corpus)), 20, tmp_path, eod=EOD)
    batch = ds.batch([0, 1, 2])
    assert batch.position_ids is not None and batch.segment_ids is not None
    expected = segments(batch.tokens, EOD)
    assert np.array_equal(batch.position_ids, expected[0]) and np.array_equal(batch.segment_ids, expected[1])
    plain = _dataset(corpus, (0, len(corpus)), 20, tmp_path).batch([0, 1, 2])
    assert plain.position_ids is None and np.array_equal(plain.tokens, batch.tokens)


def test_packing_data_without_eod_tokens_splits_at_document_ends(tmp_path: Path) -> None:
    """Data preprocessed without EOD tokens still packs by document: the index knows where each
    ends. Document d holds only the token d + 1, so a segment changes exactly where the token does."""
    rng = np.random.default_rng(1)
    with IndexedDatasetWriter(tmp_path / "no-eod", np.uint16) as w:
        for d in range(40):
            w.add_document(np.full(int(rng.integers(1, 30)), d + 1))
    ds = _dataset(IndexedDataset(tmp_path / "no-eod"), (0, 40), None, tmp_path, eod=EOD)  # type: ignore[arg-type]
    batch = ds.batch(range(len(ds)))
    assert batch.segment_ids is not None and batch.position_ids is not None
    changes = batch.tokens[:, 1:] != batch.tokens[:, :-1]
    assert changes.any()
    assert np.array_equal(np.diff(batch.segment_ids, axis=1) == 1, changes)
    assert np.all(batch.position_ids[:, 1:][changes] == 0)
    # With EOD tokens (the usual data), the document ends and the tokens agree: nothing changes.
    packed = _dataset(_write(tmp_path / "eod"), (0, 40), 20, tmp_path, eod=EOD).batch([0, 1, 2])
    assert np.array_equal(packed.segment_ids, segments(packed.tokens, EOD)[1])


def test_blending_prefixes_stay_within_one_sample_of_the_weights() -> None:
    weights = [0.5, 0.3, 0.2]
    which, nth = blending_indices(weights, 2000)
    counts = np.zeros(3)
    for i, d in enumerate(which):
        assert nth[i] == counts[d]  # each dataset's samples in order, none skipped
        counts[d] += 1
        assert np.all(np.abs(counts - np.asarray(weights) * (i + 1)) <= 1.0 + 1e-9)


def test_blended_batches_come_from_their_datasets(corpus: IndexedDataset, tmp_path: Path) -> None:
    a = _dataset(corpus, (0, 20), 200, tmp_path)
    b = _dataset(corpus, (20, 40), 200, tmp_path)
    mix = BlendedDataset([a, b], [3.0, 1.0], 100, tmp_path / "blends")
    batch = mix.batch(range(8))
    for row, i in enumerate(range(8)):
        source = (a, b)[int(mix.dataset_index[i])]
        assert np.array_equal(batch.tokens[row], source.window(int(mix.dataset_sample_index[i]))[:-1])
    assert np.bincount(np.asarray(mix.dataset_index), minlength=2).tolist() == [75, 25]
    cached = BlendedDataset([a, b], [3.0, 1.0], 100, tmp_path / "blends")
    assert np.array_equal(cached.dataset_index, mix.dataset_index)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_slices_are_disjoint_and_cover_the_batch(dp: int) -> None:
    gb, mbs, consumed = 16, 2, 48
    shards = [microbatch_sample_ids(consumed, gb, mbs, r, dp) for r in range(dp)]
    flat = [i for shard in shards for micro in shard for i in micro]
    assert sorted(flat) == list(range(consumed, consumed + gb))
    assert all(len(micro) == mbs for shard in shards for micro in shard)


def test_prefetched_and_resumed_batches_equal_an_uninterrupted_run(
    corpus: IndexedDataset, tmp_path: Path
) -> None:
    ds = _dataset(corpus, (0, len(corpus)), 64, tmp_path)
    plain = Loader(ds, 8, 2, dp_rank=1, dp_size=2, background=False)
    ahead = Loader(ds, 8, 2, dp_rank=1, dp_size=2)
    run = []
    for step in range(6):
        ahead.prefetch((step + 1) * 8)
        run.append(ahead.step(step * 8))
    assert ahead.hits == 10 and ahead.misses == 2  # the first step was read on the spot
    for step in range(6):
        expected = plain.step(step * 8)
        assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(expected, run[step], strict=True))
    resumed = Loader(ds, 8, 2, dp_rank=1, dp_size=2)
    assert all(np.array_equal(x.labels, y.labels) for x, y in zip(resumed.step(3 * 8), run[3], strict=True))
    ahead.close()
    resumed.close()


# Megatron's side, one process (its package import sets global torch state and takes seconds).
_MEGATRON_SIDE = """
import json, sys
import numpy as np
from megatron.core.datasets import helpers
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

class Tokenizer:
    eod, pad, vocab_size = 0, -1, 100
    unique_identifiers = {"class": "Tokenizer"}

a = json.loads(sys.stdin.read())
out = {}
for reset in (False, True):
    cfg = GPTDatasetConfig(random_seed=a["seed"], sequence_length=a["L"], split=a["split"],
        path_to_cache=a["cache"] + str(reset), tokenizer=Tokenizer(), reset_position_ids=reset,
        reset_attention_mask=reset, eod_mask_loss=False)
    indexed = IndexedDataset(a["prefix"])
    for name, lo, hi, n in a["splits"]:
        g = GPTDataset(indexed, a["prefix"], np.arange(lo, hi, dtype=np.int32), n, getattr(Split, name), cfg)
        rows = [g[i] for i in range(len(g))]
        out[f"{name}-{reset}"] = {"tokens": [r["tokens"].tolist() for r in rows],
            "labels": [r["labels"].tolist() for r in rows], "pos": [r["position_ids"].tolist() for r in rows],
            "mask": [r["attention_mask"].tolist() for r in rows] if reset else None}
w = np.array(a["weights"], dtype=np.float64)
di, dsi = np.zeros(a["blend"], dtype=np.int16), np.zeros(a["blend"], dtype=np.int64)
helpers.build_blending_indices(di, dsi, w, len(w), a["blend"], False)
out["blend"] = [di.tolist(), dsi.tolist()]
print(json.dumps(out))
"""
SPLITS = [["train", 0, 32, 50], ["valid", 32, 38, 20]]
WEIGHTS, BLEND = [0.5, 0.3, 0.2], 300


@pytest.fixture(scope="module")
def megatron(corpus: IndexedDataset, tmp_path_factory: pytest.TempPathFactory) -> dict:
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (the test extra brings it on Python 3.11)")
    prefix = str(corpus.idx_path)[: -len(".idx")]
    cache = str(tmp_path_factory.mktemp("megatron-cache") / "c")
    payload = {"seed": SEED, "L": L, "split": "80,15,5", "cache": cache, "prefix": prefix, "splits": SPLITS}
    payload |= {"weights": WEIGHTS, "blend": BLEND}
    args = [sys.executable, "-c", _MEGATRON_SIDE]
    text = json.dumps(payload)
    out = subprocess.run(args, input=text, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("split", SPLITS, ids=[s[0] for s in SPLITS])
def test_samples_equal_megatron_s_gpt_dataset(
    megatron: dict, corpus: IndexedDataset, tmp_path: Path, split: list, packed: bool
) -> None:
    name, lo, hi, n = split
    ours = _dataset(corpus, (lo, hi), n, tmp_path, eod=EOD if packed else None)
    theirs = megatron[f"{name}-{packed}"]
    assert len(ours) == len(theirs["tokens"])
    batch = ours.batch(range(len(ours)))
    assert batch.tokens.tolist() == theirs["tokens"] and batch.labels.tolist() == theirs["labels"]
    if not packed:
        assert batch.position_ids is None and all(p == list(range(L)) for p in theirs["pos"])
        return
    assert batch.position_ids is not None and batch.segment_ids is not None
    assert batch.position_ids.tolist() == theirs["pos"]
    # Megatron's mask is True where attention is blocked; ours allows j <= i within one segment.
    seg = batch.segment_ids
    allowed = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((L, L), bool))
    assert (~allowed).tolist() == [m[0] for m in theirs["mask"]]


def test_blending_equals_megatron_s_helpers(megatron: dict) -> None:
    which, nth = blending_indices(WEIGHTS, BLEND)
    assert which.tolist() == megatron["blend"][0] and nth.tolist() == megatron["blend"][1]
