"""Object storage: file:// (the embedded default) and s3:// (boto3), behind one small interface.

Keys are '/'-separated and relative to the store's root URL. The same code serves the engine
(checkpoint writes), the worker and the API (listing and downloads).
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import unquote, urlparse


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str | None = None
    """S3's ETag (the MD5 of a single-part upload); None on file://."""
    crc32: str | None = None
    """The whole object's CRC32 as S3 keeps it (base64 of 4 big-endian bytes), where it has one: every
    upload through S3Store records it, multipart ones too; None on file:// and for older objects."""


class StorageError(Exception):
    pass


def fsync_dir(path: str | Path) -> None:
    """Make the renames into directory `path` durable: a file fsynced and renamed into place can
    still vanish in a power loss until its directory's entry is on disk. Call it after the rename
    that publishes something (a checkpoint's manifest, a dataset's index, an export's config)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems (certain FUSE and network mounts) cannot fsync a directory at all.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _check_key(key: str) -> str:
    # Leading/trailing slashes are dropped, so '/etc/passwd' is the relative key 'etc/passwd' under
    # the store's root; '..', '.', empty segments and control characters (NUL) are refused.
    key = key.strip("/")
    parts = key.split("/")
    if not key or any(p in ("", ".", "..") for p in parts) or any(ord(c) < 32 for c in key):
        raise StorageError(f"invalid storage key {key!r}")
    return key


class Store(Protocol):
    url: str

    def put_bytes(self, key: str, data: bytes) -> None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def put_file(self, key: str, path: str | Path) -> None: ...
    def get_file(self, key: str, path: str | Path) -> None: ...
    def open_read(self, key: str) -> BinaryIO: ...
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...
    def read_into(self, key: str, offset: int, buffer: memoryview) -> int: ...
    def writer(self, key: str) -> AbstractContextManager[BinaryIO]: ...
    def exists(self, key: str) -> bool: ...
    def stat(self, key: str) -> ObjectInfo: ...
    def list(self, prefix: str = "") -> list[ObjectInfo]: ...
    def delete_prefix(self, prefix: str) -> None: ...
    def child(self, prefix: str) -> Store: ...
    def presigned_url(self, key: str, expires_s: int = 3600) -> str | None: ...


class FileStore:
    """Objects are plain files under a root directory; writes land atomically via rename."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.writer(key) as f:
            f.write(data)

    def put_file(self, key: str, path: str | Path) -> None:
        with open(path, "rb") as src, self.writer(key) as f:
            shutil.copyfileobj(src, f, 1 << 20)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise StorageError(f"{self.url}/{key} does not exist") from None

    def get_file(self, key: str, path: str | Path) -> None:
        src = self._path(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Copy beside the destination, then rename: a reader never sees a half-copied file.
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.tmp-")
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        except FileNotFoundError:
            raise StorageError(f"{self.url}/{key} does not exist") from None
        finally:
            Path(tmp).unlink(missing_ok=True)

    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except FileNotFoundError:
            raise StorageError(f"{self.url}/{key} does not exist") from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of an object; fewer only where the object is shorter."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise StorageError(f"{self.url}/{key} does not exist") from None
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        """Fill `buffer` from byte `offset` of an object (no intermediate copy); returns the bytes
        read, fewer only where the object ends first."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise StorageError(f"{self.url}/{key} does not exist") from None
        view, done = memoryview(buffer).cast("B"), 0
        try:
            while done < len(view):
                n = os.preadv(fd, [view[done:]], offset + done)  # a call reads at most ~2 GiB
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
        return done

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        """A file to write the object into; it appears, whole, only when the block ends cleanly."""
        dest = self._path(key)
        created = _make_dirs(dest.parent)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        try:
            # mkstemp creates 0600; objects must stay readable by the other services' users.
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())  # durable before anything (a manifest) can name it
            os.replace(tmp, dest)
            # The rename, and the entries of folders made for it, durable before the caller goes on
            # (to name this object in a manifest or a database row).
            for d in [dest.parent, *(c.parent for c in created)]:
                fsync_dir(d)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def stat(self, key: str) -> ObjectInfo:
        try:
            return ObjectInfo(key, self._path(key).stat().st_size)
        except FileNotFoundError:
            raise StorageError(f"{self.url}/{key} does not exist") from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = self._path(prefix) if prefix.strip("/") else self.root
        if base.is_file():
            return [ObjectInfo(prefix.strip("/"), base.stat().st_size)]
        if not base.is_dir():
            return []
        out = []
        for p in sorted(base.rglob("*")):
            if p.is_file() and not p.name.startswith(".tmp-"):
                out.append(ObjectInfo(p.relative_to(self.root).as_posix(), p.stat().st_size))
        return out

    def delete_prefix(self, prefix: str) -> None:
        p = self._path(prefix)
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()

    def child(self, prefix: str) -> FileStore:
        return FileStore(self._path(prefix))

    def local_path(self, key: str) -> Path:
        return self._path(key)

    def presigned_url(self, key: str, expires_s: int = 3600) -> str | None:
        return None


def _make_dirs(path: Path) -> list[Path]:
    """mkdir -p, returning the directories it created (deepest first)."""
    created = []
    p = path
    while not p.is_dir():
        created.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return created


def crc32_file(path: str | Path) -> int:
    """A file's CRC32, read in 8 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def open_store(
    url: str, endpoint_url: str | None = None, *, attempts: int | None = None, patience_s: float | None = None
) -> Store:
    """A Store for file:///abs/path or s3://bucket/prefix. A bare absolute path counts as file://.
    `attempts` (botocore's tries per S3 request) and `patience_s` (how long a call retries an outage):
    less where someone waits for the answer; storage.s3's defaults otherwise."""
    if url.startswith("/"):
        return FileStore(url)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            # file://data/x would otherwise silently mean /x; the URL needs three slashes.
            raise StorageError(f"file URL {url!r} names host {parsed.netloc!r}; use file:///abs/path")
        return FileStore(unquote(parsed.path))
    if parsed.scheme == "s3":
        from megatrain.storage.s3 import S3Store

        if endpoint_url is None:
            endpoint_url = os.environ.get("MEGATRAIN_S3_ENDPOINT_URL") or None
        return S3Store(parsed.netloc, parsed.path, endpoint_url, attempts, patience_s)
    raise StorageError(f"unsupported storage URL {url!r} (use file:///… or s3://bucket/prefix)")


def split_url(url: str) -> tuple[str, str]:
    """'s3://b/p/x.jsonl' -> ('s3://b/p', 'x.jsonl'); the parent as a store URL and the key in it."""
    head, _, tail = url.rstrip("/").rpartition("/")
    return head, tail


def read_url(url: str, endpoint_url: str | None = None) -> BinaryIO:
    """Open a single object by URL for reading (data files)."""
    if url.startswith("/") or url.startswith("file://"):
        path = url if url.startswith("/") else unquote(urlparse(url).path)
        try:
            return open(path, "rb")
        except (FileNotFoundError, IsADirectoryError):
            raise StorageError(f"{url} does not exist") from None
    parent, key = split_url(url)
    # Streamed: a corpus larger than memory is read in buffered chunks, never whole.
    body = open_store(parent, endpoint_url).open_read(key)
    reader = _BufferedObject(_RawStream(body), 1 << 20)
    # The object's size, as readers that report progress look for it on an S3 body.
    reader._content_length = getattr(body, "_content_length", None)
    return reader


class _BufferedObject(io.BufferedReader):
    _content_length: int | str | None


class _RawStream(io.RawIOBase):
    """An S3 body (read(n) only) as a raw stream, so gzip/zstd/TextIOWrapper can read it buffered."""

    def __init__(self, body: BinaryIO):
        self._body = body
        length = getattr(body, "_content_length", None)
        self.content_length: int | None = int(length) if length is not None else None
        """The object's size, as S3 sent it (progress bars over a stream)."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        chunk = self._body.read(len(buffer))
        buffer[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        self._body.close()
        super().close()


def __getattr__(name: str) -> Any:
    # S3Store lives in storage.s3 (which imports this module); named here too, for callers' imports.
    if name == "S3Store":
        from megatrain.storage.s3 import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
