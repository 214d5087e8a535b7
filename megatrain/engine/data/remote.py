"""Indexed datasets (and Hugging Face folders' safetensors files) in object storage, read through a
per-node local cache.

A memory map needs a local file, so an `s3://bucket/key/PREFIX` dataset is downloaded once per node
into `{cache_root}/s3/{bucket}/{key}/PREFIX.{bin,idx}`: boto3's managed transfer streams each object
to a temporary file (multipart, parallel ranges; never a whole object in memory), the sizes are
checked against the store's, the CRC32 against the object's whole-object checksum (megatrain.storage; every
upload through it records one, multipart ones too), the MD5 against a single-part ETag, and a marker
naming the objects' sizes and ETags is written last. The node's ranks take one file lock: the first
downloads, the others wait and then map the same files. A marker that no longer matches the objects
(the dataset was replaced) makes the next reader download again.
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
    try:
        return cached_files(parent, [name + s for s in SUFFIXES], cache_root, f"{name}.complete.json") / name
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{url}: no indexed dataset there ({exc})") from None


def cached_files(parent: str, names: list[str], cache_root: Path, marker_name: str) -> Path:
    """The local folder holding objects `names` of the s3:// folder `parent`, downloaded once per
    node (the first of the node's processes downloads under a file lock, the others wait) and
    verified; a marker naming their sizes and ETags is written last (`marker_name`, in that folder).
    Raises FileNotFoundError naming an object the store lacks."""
    store = open_store(parent)
    dest_dir = cache_root / "s3" / parent[len("s3://") :]
    dest_dir.mkdir(parents=True, exist_ok=True)
    remote = {}
    for name in names:
        try:
            info = store.stat(name)
        except StorageError as exc:
            raise FileNotFoundError(f"{parent}/{name}: {exc}") from None
        remote[name] = {"size": info.size, "etag": info.etag}
    marker = dest_dir / marker_name
    with open(dest_dir / f"{marker_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _current(marker, remote, dest_dir):
            return dest_dir
        marker.unlink(missing_ok=True)
        digests = {}
        for name in names:
            dest = dest_dir / name
            tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
            try:
                store.get_file(name, tmp)
                digests[name] = _verify(tmp, remote[name], f"{parent}/{name}")
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
        tmp = marker.with_name(marker.name + f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({n: {**remote[n], "sha256": digests[n]} for n in names}))
        os.replace(tmp, marker)  # last: its presence means every file is whole and verified
    return dest_dir


def _current(marker: Path, remote: dict, dest_dir: Path) -> bool:
    try:
        recorded = json.loads(marker.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    for name, want in remote.items():
        got = recorded.get(name, {})
        if (got.get("size"), got.get("etag")) != (want["size"], want["etag"]):
            return False
        path = dest_dir / name
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
    # A multipart upload's ETag is "md5-of-md5s-N", not the content's MD5: get_file checked those
    # by their whole-object CRC32 (objects uploaded before it was recorded: by size alone).
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
