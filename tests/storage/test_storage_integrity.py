"""What storage does for integrity beyond a write's atomic rename: the directory fsynced after it
(file://), and a full-object CRC32 recorded with every upload and checked on download (s3://)."""

from __future__ import annotations

import base64
import os
import zlib
from pathlib import Path
from typing import Any

import boto3
import pytest

import megatrain.storage as storage
from megatrain.storage import FileStore, S3Store, StorageError, fsync_dir, open_store

BIG = 20 << 20  # past boto3's 8 MiB threshold: uploaded in parts


def _crc(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def test_fsync_dir_on_a_real_directory(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"1")
    fsync_dir(tmp_path)
    with pytest.raises(NotADirectoryError):
        fsync_dir(tmp_path / "x")


def test_a_file_put_fsyncs_its_directory_and_the_ones_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the rename, the object's folder is fsynced (with the object in it), and so is the
    parent of every folder the put created, up to the first that existed."""
    seen: list[tuple[Path, list[str]]] = []
    real = storage.fsync_dir

    def record(path: str | Path) -> None:
        seen.append((Path(path), sorted(p.name for p in Path(path).iterdir())))
        real(path)

    monkeypatch.setattr(storage, "fsync_dir", record)
    root = tmp_path / "root"
    root.mkdir()
    store = FileStore(root)
    store.put_bytes("a/b/manifest.json", b"{}")
    assert seen == [(root / "a" / "b", ["manifest.json"]), (root / "a", ["b"]), (root, ["a"])]
    seen.clear()
    src = tmp_path / "src"
    src.write_bytes(b"data")
    store.put_file("a/b/shard.bin", src)
    assert seen == [(root / "a" / "b", ["manifest.json", "shard.bin"])]


def _s3(s3_bucket_url: str) -> S3Store:
    store = open_store(s3_bucket_url)
    assert isinstance(store, S3Store)
    return store


def _head(store: S3Store, key: str) -> dict[str, Any]:
    client = boto3.client("s3", endpoint_url=store.endpoint_url)
    return client.head_object(Bucket=store.bucket, Key=key, ChecksumMode="ENABLED")


def test_a_multipart_upload_records_the_whole_object_crc32(tmp_path: Path, s3_bucket_url: str) -> None:
    """Both ways in (a file, and a writer as checkpoint shards use): the object keeps a FULL_OBJECT
    CRC32 of its content, not a checksum of its parts' checksums."""
    store = _s3(s3_bucket_url)
    data = os.urandom(BIG)
    src = tmp_path / "big"
    src.write_bytes(data)
    store.put_file("file.bin", src)
    with store.writer("writer.bin") as f:
        for at in range(0, BIG, 3 << 20):
            f.write(memoryview(data)[at : at + (3 << 20)])
    for key in ("file.bin", "writer.bin"):
        head = _head(store, key)
        assert head["ETag"].endswith('-3"')  # in parts
        assert (head.get("ChecksumType"), head.get("ChecksumCRC32")) == ("FULL_OBJECT", _crc(data))
        assert store.stat(key).crc32 == _crc(data)
    store.put_bytes("small.json", b"{}")
    assert store.stat("small.json").crc32 == _crc(b"{}")


def test_a_download_that_differs_from_the_object_is_refused(
    tmp_path: Path, s3_bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download whose bytes are not the object's (a flipped bit on the way, or a truncation) is
    deleted and refused, naming the object and what differed."""
    store = _s3(s3_bucket_url)
    data = os.urandom(BIG)
    (tmp_path / "big").write_bytes(data)
    store.put_file("ds/x.bin", tmp_path / "big")
    store.get_file("ds/x.bin", tmp_path / "ok")
    assert (tmp_path / "ok").read_bytes() == data

    real = store._client.download_file

    def damaged(bucket: str, key: str, path: str, **kwargs: Any) -> None:
        real(bucket, key, path, **kwargs)
        with open(path, "r+b") as f:
            f.seek(BIG // 2)
            byte = f.read(1)
            f.seek(BIG // 2)
            f.write(bytes([byte[0] ^ 0x01]))

    monkeypatch.setattr(store._client, "download_file", damaged)
    dest = tmp_path / "bad"
    with pytest.raises(StorageError, match=r"ds/x\.bin: crc32 mismatch \(store \S+, downloaded \S+\)"):
        store.get_file("ds/x.bin", dest)
    assert not dest.exists()

    def truncated(bucket: str, key: str, path: str, **kwargs: Any) -> None:
        real(bucket, key, path, **kwargs)
        os.truncate(path, BIG - 1)

    monkeypatch.setattr(store._client, "download_file", truncated)
    with pytest.raises(StorageError, match=rf"ds/x\.bin: downloaded {BIG - 1} bytes, the store holds {BIG}"):
        store.get_file("ds/x.bin", dest)


def test_an_object_without_a_whole_object_checksum_is_read_by_size(
    tmp_path: Path, s3_bucket_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects uploaded before (boto3's default: a checksum of the parts' checksums), or through a
    client told to send checksums only when required, still download, checked by size."""
    store = _s3(s3_bucket_url)
    data = os.urandom(BIG)
    (tmp_path / "big").write_bytes(data)
    client = boto3.client("s3", endpoint_url=store.endpoint_url)
    client.upload_file(str(tmp_path / "big"), store.bucket, "old.bin")
    assert store.stat("old.bin").crc32 is None
    store.get_file("old.bin", tmp_path / "old")
    assert (tmp_path / "old").read_bytes() == data

    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    plain = _s3(s3_bucket_url)
    plain.put_file("plain.bin", tmp_path / "big")
    assert plain.stat("plain.bin").crc32 is None
    plain.get_file("plain.bin", tmp_path / "plain")
    assert (tmp_path / "plain").read_bytes() == data
