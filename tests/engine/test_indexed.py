"""The indexed dataset against Megatron-LM's documented layout (byte for byte on the anchor's golden
vector), round trips, dtype choice, zero-copy reads, refusals of broken files, atomic writes."""

from __future__ import annotations

import importlib.util
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatrain.engine.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype

# ../shared/anchors/megatron-indexed-dataset.md §6: vocab 50257 (uint16), three documents.
GOLDEN_DOCS = [([5, 6, 7, 0], [4]), ([8, 9, 0], [3]), ([1, 2, 3, 4, 5, 0], [2, 4])]


def _golden_idx() -> bytes:
    # The same bytes, built field by field from the documented layout (not from our writer).
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + bytes([8]) + struct.pack("<QQ", 4, 4)
    lengths = struct.pack("<4i", 4, 3, 2, 4)
    pointers = struct.pack("<4q", 0, 8, 14, 18)
    documents = struct.pack("<4q", 0, 1, 2, 4)
    return header + lengths + pointers + documents


def test_the_golden_vector_byte_for_byte(tmp_path: Path) -> None:
    assert len(_golden_idx()) == 114
    assert _golden_idx()[:34].hex() == "4d4d4944494458000001000000000000000804000000000000000400000000000000"
    with IndexedDatasetWriter(tmp_path / "g", token_dtype(50257)) as w:
        for tokens, lengths in GOLDEN_DOCS:
            w.add_document(tokens, lengths)
    assert (tmp_path / "g.idx").read_bytes() == _golden_idx()
    assert (tmp_path / "g.bin").read_bytes() == np.array(
        [5, 6, 7, 0, 8, 9, 0, 1, 2, 3, 4, 5, 0], "<u2"
    ).tobytes()
    assert len((tmp_path / "g.bin").read_bytes()) == 26


def test_a_dataset_laid_out_as_megatron_writes_it_reads_back(tmp_path: Path) -> None:
    (tmp_path / "m.idx").write_bytes(_golden_idx())
    (tmp_path / "m.bin").write_bytes(np.array([5, 6, 7, 0, 8, 9, 0, 1, 2, 3, 4, 5, 0], "<u2").tobytes())
    ds = IndexedDataset(tmp_path / "m")
    assert ds.dtype == np.uint16 and len(ds) == 4 and ds.num_documents == 3 and ds.num_tokens == 13
    assert [ds[i].tolist() for i in range(4)] == [[5, 6, 7, 0], [8, 9, 0], [1, 2], [3, 4, 5, 0]]
    assert ds.get(3, 1, 2).tolist() == [4, 5]
    assert ds.document(2).tolist() == [1, 2, 3, 4, 5, 0]
    assert ds.sequence_pointers.tolist() == [0, 8, 14, 18] and ds.document_indices.tolist() == [0, 1, 2, 4]


@pytest.mark.parametrize("vocab", [257, 50257, 65499, 65500, 128256, None])
def test_round_trip_with_empty_documents(tmp_path: Path, vocab: int | None) -> None:
    rng = np.random.default_rng(0)
    high = min(vocab or 1 << 20, 1 << 20)
    docs = [rng.integers(0, high, size=n) for n in (7, 0, 1, 300, 0, 5)]
    with IndexedDatasetWriter(tmp_path / "d", token_dtype(vocab)) as w:
        for doc in docs:
            w.add_document(doc)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == (np.uint16 if vocab is not None and vocab < 65500 else np.int32)
    assert ds.document_indices.tolist() == [0, 1, 1, 2, 3, 3, 4]  # empty documents repeat a boundary
    assert [ds.document(j).tolist() for j in range(len(docs))] == [d.tolist() for d in docs]


def test_reads_are_views_of_the_map_not_copies(tmp_path: Path) -> None:
    with IndexedDatasetWriter(tmp_path / "v", np.uint16) as w:
        w.add_document(np.arange(1000) % 500)
    ds = IndexedDataset(tmp_path / "v")
    seq = ds[0]
    assert not seq.flags.owndata and not seq.flags.writeable
    assert np.shares_memory(seq, ds.tokens)


def test_an_aborted_write_leaves_nothing_and_tokens_must_fit(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), IndexedDatasetWriter(tmp_path / "a", np.uint16) as w:
        w.add_document([1, 2, 3])
        raise RuntimeError("the input broke half-way")
    assert list(tmp_path.iterdir()) == []
    with (
        pytest.raises(ValueError, match="do not fit uint16"),
        IndexedDatasetWriter(tmp_path / "b", np.uint16) as w,
    ):
        w.add_document([1, 70000])
    assert list(tmp_path.iterdir()) == []
    with (
        pytest.raises(ValueError, match="do not add up"),
        IndexedDatasetWriter(tmp_path / "c", np.int32) as w,
    ):
        w.add_document([1, 2, 3], [1, 1])


def test_finalize_fsyncs_the_folder_after_both_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import megatrain.engine.data.indexed as indexed

    seen: list[list[str]] = []
    monkeypatch.setattr(
        indexed, "fsync_dir", lambda d: seen.append(sorted(p.name for p in Path(d).iterdir()))
    )
    with IndexedDatasetWriter(tmp_path / "a", np.uint16) as w:
        w.add_document([1, 2, 3])
    assert seen == [["a.bin", "a.idx"]]


def test_broken_files_are_refused_naming_the_problem(tmp_path: Path) -> None:
    good = _golden_idx()
    (tmp_path / "x.bin").write_bytes(np.arange(13, dtype="<u2").tobytes())
    cases = {
        b"NOTMEGA\x00\x00" + good[9:]: "not a Megatron indexed dataset",
        good[:9] + struct.pack("<Q", 2) + good[17:]: "index version 2",
        good[:17] + bytes([9]) + good[18:]: "unknown token dtype code 9",
        good[:60]: "need 114",
        good[:10]: "shorter than the 34-byte header",
    }
    for idx, message in cases.items():
        (tmp_path / "x.idx").write_bytes(idx)
        with pytest.raises(ValueError, match=message):
            IndexedDataset(tmp_path / "x")
    (tmp_path / "x.idx").write_bytes(good)
    (tmp_path / "x.bin").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="the index points up to 26"):
        IndexedDataset(tmp_path / "x")


# Megatron's side, in one process for every case (its package import sets global torch state and
# takes seconds).
_MEGATRON_SIDE = """
import json, sys
import numpy as np
from megatron.core.datasets import indexed_dataset as indexed
results = []
for ours, meg, vocab, docs in json.loads(sys.stdin.read()):
    theirs = indexed.IndexedDataset(ours)
    read = [theirs[i].tolist() for i in range(len(theirs))]
    builder = indexed.IndexedDatasetBuilder(meg + ".bin", dtype=indexed.DType.optimal_dtype(vocab))
    for doc in docs:
        builder.add_document(np.array(doc, dtype=np.int64), [len(doc)] if doc else [])
    builder.finalize(meg + ".idx")
    results.append({"read": read, "documents": theirs.document_indices.tolist()})
print(json.dumps(results))
"""


def test_against_megatron_s_own_reader_and_builder(tmp_path: Path) -> None:
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (the test extra brings it on Python 3.11)")
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50000, size=n).tolist() for n in (3, 0, 9, 1, 257)]
    cases = []
    for vocab in (50257, 128256):  # uint16 and int32 tokens
        with IndexedDatasetWriter(tmp_path / f"ours{vocab}", token_dtype(vocab)) as w:
            for doc in docs:
                w.add_document(doc)
        cases.append([str(tmp_path / f"ours{vocab}"), str(tmp_path / f"meg{vocab}"), vocab, docs])
    args = [sys.executable, "-c", _MEGATRON_SIDE]
    out = subprocess.run(
        args, input=json.dumps(cases), capture_output=True, text=True, timeout=300, check=True
    )
    for (ours, meg, _, _), theirs in zip(cases, json.loads(out.stdout.strip().splitlines()[-1]), strict=True):
        assert theirs["read"] == [d for d in docs if d]  # their reader on our files
        assert theirs["documents"] == [0, 1, 1, 2, 3, 4]
        assert Path(meg + ".idx").read_bytes() == Path(ours + ".idx").read_bytes()  # their writer = ours
        assert Path(meg + ".bin").read_bytes() == Path(ours + ".bin").read_bytes()
