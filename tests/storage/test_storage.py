"""The Store interface on both backends: file:// under tmp_path and s3:// on moto over real HTTP.

Every behaviour test runs on both, so the two backends cannot drift apart: same keys, same list
semantics, same errors.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import threading
from pathlib import Path

import httpx
import pytest

from megatrain.storage import FileStore, ObjectInfo, S3Store, StorageError, Store, open_store, read_url


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """A store whose root is a sub-prefix ('root'), so the prefix arithmetic is exercised too."""
    if request.param == "file":
        return open_store((tmp_path / "store" / "root").as_uri())
    bucket_url = request.getfixturevalue("s3_bucket_url")
    endpoint = request.getfixturevalue("moto_s3_endpoint")
    return open_store(f"{bucket_url}/root", endpoint_url=endpoint)


def _keys(store: Store, prefix: str = "") -> list[str]:
    return sorted(o.key for o in store.list(prefix))


# --- bytes and files ---------------------------------------------------------------------------


def test_put_get_bytes_round_trip_and_overwrite(store: Store) -> None:
    store.put_bytes("a/b/c.bin", b"\x00\x01payload")
    assert store.get_bytes("a/b/c.bin") == b"\x00\x01payload"
    store.put_bytes("a/b/c.bin", b"second")
    assert store.get_bytes("a/b/c.bin") == b"second"
    store.put_bytes("empty", b"")
    assert store.get_bytes("empty") == b""
    assert store.list("empty") == [ObjectInfo("empty", 0)]


def test_missing_objects_raise_storage_error(store: Store, tmp_path: Path) -> None:
    with pytest.raises(StorageError):
        store.get_bytes("nope")
    with pytest.raises(StorageError):
        store.open_read("nope/deeper")
    with pytest.raises(StorageError):
        store.get_file("nope", tmp_path / "out" / "nope")
    assert not (tmp_path / "out" / "nope").exists()


def test_put_file_get_file_large(store: Store, tmp_path: Path) -> None:
    # 9 MiB crosses boto3's 8 MiB multipart threshold, so S3 takes the multipart path.
    data = os.urandom(9 * 1024 * 1024 + 13)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    store.put_file("ckpt/iter_0000010/model.safetensors", src)
    assert store.list("ckpt") == [ObjectInfo("ckpt/iter_0000010/model.safetensors", len(data))]
    dest = tmp_path / "down" / "nested" / "model.safetensors"
    store.get_file("ckpt/iter_0000010/model.safetensors", dest)
    assert dest.read_bytes() == data
    # No temporary files left beside the download.
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.safetensors"]


def test_open_read_streams(store: Store) -> None:
    store.put_bytes("stream.txt", b"line1\nline2\n")
    f = store.open_read("stream.txt")
    try:
        assert f.read(6) == b"line1\n"
        assert f.read() == b"line2\n"
    finally:
        f.close()


# --- listing, exists, delete ---------------------------------------------------------------------


def _populate(store: Store) -> None:
    for key, size in [
        ("jobs/1/checkpoints/iter_0000010/manifest.json", 3),
        ("jobs/1/checkpoints/latest", 2),
        ("jobs/10/checkpoints/latest", 2),
        ("jobs/1b", 1),
        ("datasets/x.jsonl", 5),
    ]:
        store.put_bytes(key, b"x" * size)


def test_list_prefixes_have_path_semantics(store: Store) -> None:
    _populate(store)
    assert _keys(store) == [
        "datasets/x.jsonl",
        "jobs/1/checkpoints/iter_0000010/manifest.json",
        "jobs/1/checkpoints/latest",
        "jobs/10/checkpoints/latest",
        "jobs/1b",
    ]
    # 'jobs/1' is a folder: never 'jobs/10/…' or the sibling object 'jobs/1b'.
    assert _keys(store, "jobs/1") == [
        "jobs/1/checkpoints/iter_0000010/manifest.json",
        "jobs/1/checkpoints/latest",
    ]
    assert _keys(store, "jobs/1/") == _keys(store, "jobs/1")
    # A prefix naming an object lists just that object, with its size.
    assert store.list("jobs/1/checkpoints/latest") == [ObjectInfo("jobs/1/checkpoints/latest", 2)]
    assert store.list("jobs/2") == []
    assert store.list("jobs/1/checkpoints/lat") == []
    sizes = {o.key: o.size for o in store.list("jobs")}
    assert sizes["jobs/1/checkpoints/iter_0000010/manifest.json"] == 3


def test_exists(store: Store) -> None:
    _populate(store)
    assert store.exists("jobs/1/checkpoints/latest")
    assert store.exists("/jobs/1b")
    assert not store.exists("jobs/1")  # a folder is not an object
    assert not store.exists("jobs/2/checkpoints/latest")


def test_delete_prefix(store: Store) -> None:
    _populate(store)
    store.delete_prefix("jobs/1")
    assert _keys(store) == ["datasets/x.jsonl", "jobs/10/checkpoints/latest", "jobs/1b"]
    store.delete_prefix("jobs/1b")  # an exact object
    store.delete_prefix("jobs/does-not-exist")  # nothing there: no error
    assert _keys(store) == ["datasets/x.jsonl", "jobs/10/checkpoints/latest"]
    with pytest.raises(StorageError):
        store.delete_prefix("")  # would wipe the whole store
    with pytest.raises(StorageError):
        store.delete_prefix("/")
    assert len(store.list()) == 2


@pytest.mark.slow  # ~10 s: moto answers about 100 PUTs a second
def test_delete_prefix_pages_past_1000_keys(moto_s3_endpoint: str, s3_bucket_url: str) -> None:
    import boto3

    # S3's DeleteObjects takes at most 1000 keys per call; 1005 forces a second batch.
    bucket = s3_bucket_url.removeprefix("s3://")
    client = boto3.client("s3", endpoint_url=moto_s3_endpoint)
    for i in range(1005):
        client.put_object(Bucket=bucket, Key=f"p/many/{i:04d}", Body=b"")
    client.put_object(Bucket=bucket, Key="p/keep", Body=b"k")
    store = open_store(f"{s3_bucket_url}/p", endpoint_url=moto_s3_endpoint)
    assert len(store.list("many")) == 1005
    store.delete_prefix("many")
    assert _keys(store) == ["keep"]


# --- child stores ------------------------------------------------------------------------------


def test_child_store_is_a_view_of_the_parent(store: Store) -> None:
    child = store.child("jobs/7")
    assert child.url == store.url + "/jobs/7"
    child.put_bytes("checkpoints/latest", b"20")
    assert store.get_bytes("jobs/7/checkpoints/latest") == b"20"
    assert _keys(child) == ["checkpoints/latest"]
    store.put_bytes("jobs/7/other", b"o")
    store.put_bytes("jobs/70/not-mine", b"n")
    assert _keys(child) == ["checkpoints/latest", "other"]
    grandchild = child.child("/checkpoints/")
    assert grandchild.get_bytes("latest") == b"20"
    # The same root reopened from its URL sees the same objects.
    reopened = open_store(child.url, getattr(child, "endpoint_url", None))
    assert reopened.get_bytes("checkpoints/latest") == b"20"
    child.delete_prefix("checkpoints")
    assert _keys(store) == ["jobs/7/other", "jobs/70/not-mine"]


# --- key validation ------------------------------------------------------------------------------

BAD_KEYS = [
    "",
    "/",
    "//",
    "..",
    ".",
    "../x",
    "a/../../etc/passwd",
    "a/..",
    "a//b",
    "./a",
    "a/./b",
    "a\x00b",
    "a\nb",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_refused_everywhere(store: Store, key: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"x")
    for op in (
        lambda: store.put_bytes(key, b"x"),
        lambda: store.put_file(key, src),
        lambda: store.get_bytes(key),
        lambda: store.get_file(key, tmp_path / "out"),
        lambda: store.open_read(key),
        lambda: store.exists(key),
        lambda: store.child(key),
        lambda: store.delete_prefix(key),
    ):
        with pytest.raises(StorageError):
            op()
    assert store.list() == []


def test_absolute_looking_keys_stay_inside_the_root(store: Store, tmp_path: Path) -> None:
    store.put_bytes("/etc/passwd-like", b"inside")
    assert _keys(store) == ["etc/passwd-like"]
    assert store.get_bytes("etc/passwd-like") == b"inside"
    if isinstance(store, FileStore):
        assert (tmp_path / "store" / "root" / "etc" / "passwd-like").read_bytes() == b"inside"
        assert not Path("/etc/passwd-like").exists()
    with pytest.raises(StorageError):
        store.list("../")


# --- atomic writes on file:// --------------------------------------------------------------------


def test_file_put_is_atomic_and_cleans_up_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStore(tmp_path / "s")
    store.put_bytes("ckpt/model.bin", b"old complete content")
    src = tmp_path / "big.bin"
    src.write_bytes(b"n" * 100_000)
    seen: dict[str, object] = {}
    real_copy = shutil.copyfileobj

    def half_then_fail(fsrc, fdst, length=0):  # type: ignore[no-untyped-def]
        fdst.write(fsrc.read(50_000))
        fdst.flush()
        # Mid-write, readers still see exactly the old object and no temporary file.
        seen["bytes"] = store.get_bytes("ckpt/model.bin")
        seen["keys"] = _keys(store)
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copyfileobj", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        store.put_file("ckpt/model.bin", src)
    monkeypatch.setattr(shutil, "copyfileobj", real_copy)
    assert seen == {"bytes": b"old complete content", "keys": ["ckpt/model.bin"]}
    assert store.get_bytes("ckpt/model.bin") == b"old complete content"
    assert sorted(p.name for p in (tmp_path / "s" / "ckpt").iterdir()) == ["model.bin"]
    store.put_file("ckpt/model.bin", src)
    assert store.get_bytes("ckpt/model.bin") == src.read_bytes()


def test_file_objects_are_readable_by_other_users(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    store.put_bytes("a", b"x")
    src = tmp_path / "src"
    src.write_bytes(b"y")
    store.put_file("b", src)
    for key in ("a", "b"):
        mode = stat.S_IMODE(store.local_path(key).stat().st_mode)
        assert mode & stat.S_IROTH and mode & stat.S_IRGRP, oct(mode)


def test_file_list_hides_in_flight_temporaries(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s")
    store.put_bytes("d/real", b"r")
    (tmp_path / "s" / "d" / ".tmp-abc123").write_bytes(b"partial")
    assert _keys(store) == ["d/real"]


# --- presigned URLs, concurrency -----------------------------------------------------------------


def test_presigned_url_is_fetchable_over_http(moto_s3_endpoint: str, s3_bucket_url: str) -> None:
    store = open_store(f"{s3_bucket_url}/exports", endpoint_url=moto_s3_endpoint)
    payload = os.urandom(4096)
    store.put_bytes("hf/model.safetensors", payload)
    url = store.presigned_url("hf/model.safetensors", expires_s=60)
    assert url is not None and url.startswith(moto_s3_endpoint)
    resp = httpx.get(url, timeout=10)
    assert resp.status_code == 200
    assert resp.content == payload
    # The signature covers the key: tampering with it is refused.
    tampered = url.replace("model.safetensors", "model.safetensorz")
    assert httpx.get(tampered, timeout=10).status_code in (403, 404)


def test_file_store_has_no_presigned_url(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put_bytes("a", b"x")
    assert store.presigned_url("a") is None


def test_stores_opened_from_many_threads(moto_s3_endpoint: str, s3_bucket_url: str) -> None:
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            s = open_store(f"{s3_bucket_url}/t{i}", endpoint_url=moto_s3_endpoint)
            s.put_bytes("k", str(i).encode())
            assert s.get_bytes("k") == str(i).encode()
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert _keys(open_store(s3_bucket_url, moto_s3_endpoint)) == [f"t{i}/k" for i in range(8)]


# --- open_store and read_url -------------------------------------------------------------------


def test_open_store_urls(tmp_path: Path, moto_s3_endpoint: str, s3_bucket_url: str) -> None:
    fs = open_store(str(tmp_path / "bare"))
    assert isinstance(fs, FileStore) and fs.url == (tmp_path / "bare").as_uri()
    spaced = open_store((tmp_path / "with space").as_uri())
    assert isinstance(spaced, FileStore) and spaced.root == tmp_path / "with space"
    # The endpoint comes from MEGATRAIN_S3_ENDPOINT_URL when not given (s3_bucket_url sets it).
    s3 = open_store(f"{s3_bucket_url}/a/b/")
    assert isinstance(s3, S3Store)
    assert s3.url == f"{s3_bucket_url}/a/b" and s3.endpoint_url == moto_s3_endpoint
    s3.put_bytes("k", b"v")
    assert open_store(s3_bucket_url).get_bytes("a/b/k") == b"v"
    for bad in ("http://example.com/x", "relative/path", "file://host/x", "s3://", "s3:///prefix"):
        with pytest.raises(StorageError):
            open_store(bad)


def test_s3_errors_are_storage_errors(moto_s3_endpoint: str, tmp_path: Path) -> None:
    store = open_store("s3://no-such-bucket-megatrain/p", endpoint_url=moto_s3_endpoint)
    src = tmp_path / "f"
    src.write_bytes(b"x")
    for op in (
        lambda: store.put_bytes("k", b"x"),
        lambda: store.put_file("k", src),
        lambda: store.get_bytes("k"),
        lambda: store.open_read("k"),
        lambda: store.get_file("k", tmp_path / "out"),
    ):
        with pytest.raises(StorageError):
            op()
    assert not store.exists("k")


def test_read_url_file_and_bare_path(tmp_path: Path) -> None:
    raw = gzip.compress(b'{"text": "hello"}\n')
    path = tmp_path / "data dir" / "corpus.jsonl.gz"
    path.parent.mkdir()
    path.write_bytes(raw)
    for url in (path.as_uri(), str(path)):
        with read_url(url) as f:
            assert f.read() == raw  # .gz bytes come back untouched; decompression is the reader's job
    with pytest.raises(StorageError):
        read_url((tmp_path / "missing.jsonl").as_uri())


def test_read_url_s3(moto_s3_endpoint: str, s3_bucket_url: str) -> None:
    raw = gzip.compress(b'{"text": "hello"}\n' * 100)
    open_store(s3_bucket_url, moto_s3_endpoint).put_bytes("datasets/c/corpus.jsonl.gz", raw)
    with read_url(f"{s3_bucket_url}/datasets/c/corpus.jsonl.gz", moto_s3_endpoint) as f:
        assert f.read() == raw
    with gzip.open(read_url(f"{s3_bucket_url}/datasets/c/corpus.jsonl.gz")) as g:  # endpoint from env
        assert g.readline() == b'{"text": "hello"}\n'
    with pytest.raises(StorageError):
        read_url(f"{s3_bucket_url}/datasets/c/missing.jsonl", moto_s3_endpoint)
