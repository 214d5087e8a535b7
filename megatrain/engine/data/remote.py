"""Indexed datasets in object storage, read through a per-node local cache.

A memory map needs a local file, so an `s3://bucket/key/PREFIX` dataset is downloaded once per node
into `{cache_root}/s3/{bucket}/{key}/PREFIX.{bin,idx}`: boto3's managed transfer streams each object
to a temporary file (multipart, parallel ranges; never a whole object in memory), the sizes are
checked against the store's, the MD5 against a single-part ETag, and a marker naming the objects'
sizes and ETags is written last. The node's ranks take one file lock: the first downloads, the others
wait and then map the same files. A marker that no longer matches the objects (the dataset was
replaced) makes the next reader download again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from megatrain.storage import StorageError, open_store, split_url

SUFFIXES = (".idx", ".bin")


def is_remote(url: str) -> bool:
    return url.startswith("s3://")


def local_path(url: str) -> Path:
    """A file:// URL or plain path as a local path."""
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(url).path)) if url.startswith("file://") else Path(url)


def cached_prefix(url: str, cache_root: Path) -> Path:
    """The local prefix of the indexed dataset at `url` (downloaded into the cache when remote)."""
    if not is_remote(url):
        return local_path(url)
    parent, name = split_url(url)
    store = open_store(parent)
    bucket_and_key = parent[len("s3://") :]
    dest_dir = cache_root / "s3" / bucket_and_key
    dest_dir.mkdir(parents=True, exist_ok=True)
    remote = {}
    for suffix in SUFFIXES:
        try:
            info = store.stat(name + suffix)
        except StorageError as exc:
            raise FileNotFoundError(f"{url}: no indexed dataset there ({exc})") from None
        remote[suffix] = {"size": info.size, "etag": info.etag}
    marker = dest_dir / f"{name}.complete.json"
    with open(dest_dir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _current(marker, remote, dest_dir, name):
            return dest_dir / name
        marker.unlink(missing_ok=True)
        digests = {}
        for suffix in SUFFIXES:
            dest = dest_dir / (name + suffix)
            tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
            try:
                store.get_file(name + suffix, tmp)
                digests[suffix] = _verify(tmp, remote[suffix], f"{url}{suffix}")
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
        tmp = marker.with_name(marker.name + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({s: {**remote[s], "sha256": digests[s]} for s in SUFFIXES}))
        os.replace(tmp, marker)  # last: its presence means both files are whole and verified
    return dest_dir / name


def _current(marker: Path, remote: dict, dest_dir: Path, name: str) -> bool:
    try:
        recorded = json.loads(marker.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    for suffix in SUFFIXES:
        want = remote[suffix]
        got = recorded.get(suffix, {})
        if (got.get("size"), got.get("etag")) != (want["size"], want["etag"]):
            return False
        path = dest_dir / (name + suffix)
        if not path.is_file() or path.stat().st_size != want["size"]:
            return False
    return True


def _verify(path: Path, remote: dict, what: str) -> str:
    """Check a download's size (and MD5 where the ETag is one); its sha256 for the marker."""
    size = path.stat().st_size
    if size != remote["size"]:
        raise OSError(f"{what}: downloaded {size} bytes, the store holds {remote['size']}")
    md5, sha = hashlib.md5(), hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            md5.update(chunk)
            sha.update(chunk)
    etag = remote["etag"]
    # A multipart upload's ETag is "md5-of-md5s-N", not the content's MD5: only sizes check those.
    if etag and "-" not in etag and len(etag) == 32 and md5.hexdigest() != etag:
        raise OSError(f"{what}: MD5 {md5.hexdigest()} differs from the store's ETag {etag}")
    return sha.hexdigest()


def source_identity(url: str) -> dict[str, object]:
    """What tells one version of a file from another: size and mtime, or size and ETag on S3."""
    if is_remote(url):
        parent, key = split_url(url)
        info = open_store(parent).stat(key)
        return {"size": info.size, "etag": info.etag}
    try:
        st = local_path(url).stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} does not exist") from None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
