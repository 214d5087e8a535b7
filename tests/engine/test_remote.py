"""Indexed datasets on s3:// through the node's verified download cache (a real HTTP S3: moto's server)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest

from megatrain.engine.data import IndexedDataset, IndexedDatasetWriter
from megatrain.engine.data.remote import cached_prefix
from megatrain.storage import open_store, read_url


def _upload(tmp_path: Path, bucket_url: str, docs: list[list[int]], name: str = "corpus") -> str:
    local = tmp_path / "src" / name
    with IndexedDatasetWriter(local, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    store = open_store(f"{bucket_url}/data")
    for suffix in (".bin", ".idx"):
        store.put_file(name + suffix, str(local) + suffix)
    return f"{bucket_url}/data/{name}"


def test_downloaded_once_verified_and_mapped(tmp_path: Path, s3_bucket_url: str) -> None:
    url = _upload(tmp_path, s3_bucket_url, [[1, 2, 3], [4, 5], [6]])
    cache = tmp_path / "cache"
    prefix = cached_prefix(url, cache)
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4, 5], [6]]
    marker = Path(str(prefix) + ".complete.json")
    stamp = (marker.stat().st_mtime_ns, Path(str(prefix) + ".bin").stat().st_ino)
    assert cached_prefix(url, cache) == prefix  # a second reader reuses the verified copy
    assert (marker.stat().st_mtime_ns, Path(str(prefix) + ".bin").stat().st_ino) == stamp
    assert not [p.name for p in prefix.parent.iterdir() if ".tmp-" in p.name]


def test_a_damaged_or_replaced_copy_is_fetched_again(tmp_path: Path, s3_bucket_url: str) -> None:
    url = _upload(tmp_path, s3_bucket_url, [[1, 2, 3]])
    cache = tmp_path / "cache"
    prefix = cached_prefix(url, cache)
    with open(str(prefix) + ".bin", "r+b") as f:  # truncated on the node's disk
        f.truncate(2)
    assert IndexedDataset(cached_prefix(url, cache))[0].tolist() == [1, 2, 3]
    _upload(tmp_path, s3_bucket_url, [[7, 8], [9]])  # the dataset replaced in the store
    ds = IndexedDataset(cached_prefix(url, cache))
    assert [ds[i].tolist() for i in range(len(ds))] == [[7, 8], [9]]


def test_a_missing_dataset_is_named(tmp_path: Path, s3_bucket_url: str) -> None:
    with pytest.raises(FileNotFoundError, match=r"data/nothing: no indexed dataset there"):
        cached_prefix(f"{s3_bucket_url}/data/nothing", tmp_path)


def _fetch(url: str, cache: str, endpoint: str, out: mp.Queue) -> None:
    os.environ["MEGATRAIN_S3_ENDPOINT_URL"] = endpoint
    prefix = cached_prefix(url, Path(cache))
    out.put((str(prefix), Path(str(prefix) + ".bin").stat().st_ino))


def test_ranks_of_a_node_share_one_download(
    tmp_path: Path, s3_bucket_url: str, moto_s3_endpoint: str
) -> None:
    url = _upload(tmp_path, s3_bucket_url, [list(range(1, 200))] * 50)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    args = (url, str(tmp_path / "c"), moto_s3_endpoint, out)
    procs = [ctx.Process(target=_fetch, args=args) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = {out.get(timeout=5) for _ in procs}
    assert len(results) == 1  # one file, downloaded once: every rank maps the same inode


def test_read_url_streams_s3_objects(tmp_path: Path, s3_bucket_url: str) -> None:
    payload = os.urandom(3 << 20)
    open_store(s3_bucket_url).put_bytes("big.bin", payload)
    with read_url(f"{s3_bucket_url}/big.bin") as f:
        first = f.read(1000)
        rest = f.read()
    assert first + rest == payload
