"""Object storage: file:// (the embedded default) and s3:// (boto3), behind one small interface.

Keys are '/'-separated and relative to the store's root URL. The same code serves the engine
(checkpoint writes), the worker and the API (listing and downloads).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import tempfile
import threading
import zlib
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import unquote, urlparse

from megatrain.faults import install_storage_faults
from megatrain.storage_s3 import S3StreamWriter
from megatrain.storage_s3 import b64_crc32 as _b64_crc32


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


# Creating clients from boto3's default session is not thread-safe, and the API opens stores from
# several request threads at once.
_BOTO_CLIENT_LOCK = threading.Lock()
S3_ATTEMPTS = 8
"""Tries of one S3 request (the first and its retries) before a StorageError."""


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


class S3Store:
    """s3://bucket/prefix through boto3; MEGATRAIN_S3_ENDPOINT_URL points it at MinIO or moto."""

    def __init__(
        self, bucket: str, prefix: str = "", endpoint_url: str | None = None, attempts: int = S3_ATTEMPTS
    ):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        if not bucket:
            raise StorageError("an s3:// URL needs a bucket: s3://bucket/prefix")
        self.url = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        # Transient 5xx and throttling are retried with backoff (boto's default stops after 3 tries:
        # one checkpoint's hundreds of writes would fail on a briefly struggling endpoint).
        config = Config(retries={"mode": "standard", "max_attempts": attempts})
        with _BOTO_CLIENT_LOCK:
            self._client = boto3.client("s3", endpoint_url=endpoint_url, config=config)
        self.faults = install_storage_faults(self._client)  # an operator's MEGATRAIN_FAULTS only

    def _key(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _err(self, key: str, exc: Exception) -> StorageError:
        return StorageError(f"{self.url}/{key}: {exc}")

    def put_bytes(self, key: str, data: bytes) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        full = self._key(key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=full, Body=data)
        except (ClientError, BotoCoreError) as exc:
            raise self._err(key, exc) from None

    def put_file(self, key: str, path: str | Path) -> None:
        self._upload(key, path, crc32_file(path))

    def _upload(self, key: str, path: str | Path, crc: int) -> None:
        """Upload a file whose CRC32 is `crc`. Given it, boto3 makes a multipart upload a FULL_OBJECT
        one: S3 checks the assembled object against it and keeps it for downloads to check, where by
        default it keeps a checksum of the parts' checksums (and an ETag that is no MD5 either)."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        extra = {}
        # AWS_REQUEST_CHECKSUM_CALCULATION=when_required: a store that refuses checksum headers.
        if self._client.meta.config.request_checksum_calculation != "when_required":
            extra["ChecksumCRC32"] = _b64_crc32(crc)
        try:
            self._client.upload_file(str(path), self.bucket, self._key(key), ExtraArgs=extra)
        except (ClientError, BotoCoreError, S3UploadFailedError) as exc:
            raise self._err(key, exc) from None

    def get_bytes(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        full = self._key(key)
        try:
            return self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read()
        except ClientError as exc:  # NoSuchKey, NoSuchBucket, AccessDenied: all one error to callers
            raise self._err(key, exc) from None

    def get_file(self, key: str, path: str | Path) -> None:
        """Download an object (parallel byte ranges for a large one, which botocore checks against
        no checksum) and check the file's size and CRC32 against the object's."""
        from botocore.exceptions import ClientError

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        want = self.stat(key)
        try:
            # An object replaced between the stat and the download fails the checks below.
            self._client.download_file(self.bucket, self._key(key), str(path))
        except ClientError as exc:
            raise self._err(key, exc) from None
        size = Path(path).stat().st_size
        problem = None
        if size != want.size:
            problem = f"downloaded {size} bytes, the store holds {want.size}"
        elif want.crc32 is not None and (got := _b64_crc32(crc32_file(path))) != want.crc32:
            problem = f"crc32 mismatch (store {want.crc32}, downloaded {got})"
        if problem:
            Path(path).unlink(missing_ok=True)
            raise StorageError(f"{self.url}/{key}: {problem}")

    def open_read(self, key: str) -> BinaryIO:
        from botocore.exceptions import ClientError

        full = self._key(key)
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
        except ClientError as exc:
            raise self._err(key, exc) from None
        return body  # type: ignore[no-any-return]

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        from botocore.exceptions import ClientError

        if length <= 0:
            return b""
        full = self._key(key)
        rng = f"bytes={offset}-{offset + length - 1}"
        try:
            return self._client.get_object(Bucket=self.bucket, Key=full, Range=rng)["Body"].read()
        except ClientError as exc:
            raise self._err(key, exc) from None

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        data = self.get_range(key, offset, len(view))
        view[: len(data)] = data
        return len(data)

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        """A file whose bytes stream to the object as they are written, in parts (a multipart
        upload past one part) that nothing can read until the block ends cleanly; otherwise the
        upload is aborted and no part is kept. Nothing is spooled to local disk, and memory stays
        bounded by a few parts whatever the size. The whole object's CRC32 is recorded, as by put_file."""
        from botocore.exceptions import BotoCoreError, ClientError

        checksums = self._client.meta.config.request_checksum_calculation != "when_required"
        f = S3StreamWriter(self._client, self.bucket, self._key(key), checksums)
        try:
            yield f  # type: ignore[misc]
            f.commit()
        except (ClientError, BotoCoreError) as exc:
            _abort_quietly(f)
            raise self._err(key, exc) from None
        except BaseException:
            _abort_quietly(f)
            raise

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError:
            return False

    def stat(self, key: str) -> ObjectInfo:
        from botocore.exceptions import ClientError

        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
        except ClientError as exc:
            raise self._err(key, exc) from None
        etag = head.get("ETag", "").strip('"') or None
        return ObjectInfo(key, int(head["ContentLength"]), etag, _full_object_crc32(head, etag))

    def _iter(self, prefix: str) -> Iterator[dict]:
        # Path semantics, as on file://: the object named `prefix` itself or anything below
        # 'prefix/', never a sibling such as 'prefix2/…'.
        if prefix.strip("/"):
            exact = self._key(prefix)
            under = exact + "/"
            # The exact key sorts first among the keys it prefixes, so one key answers for it.
            first = self._client.list_objects_v2(Bucket=self.bucket, Prefix=exact, MaxKeys=1)
            yield from (o for o in first.get("Contents", []) if o["Key"] == exact)
        else:
            under = f"{self.prefix}/" if self.prefix else ""
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=under):
            yield from page.get("Contents", [])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        return [ObjectInfo(o["Key"][strip:], o["Size"]) for o in self._iter(prefix)]

    def delete_prefix(self, prefix: str) -> None:
        _check_key(prefix)  # as on file://: an empty prefix would wipe the whole store
        keys = [{"Key": o["Key"]} for o in self._iter(prefix)]
        for i in range(0, len(keys), 1000):
            self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i : i + 1000]})

    def child(self, prefix: str) -> S3Store:
        return S3Store(self.bucket, self._key(prefix), self.endpoint_url)

    def presigned_url(self, key: str, expires_s: int = 3600) -> str | None:
        return self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_s
        )


def crc32_file(path: str | Path) -> int:
    """A file's CRC32, read in 8 MiB blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            crc = zlib.crc32(block, crc)
    return crc


def _abort_quietly(f: S3StreamWriter) -> None:
    """Abort an upload on the way out of a failure, which stays the error raised."""
    with contextlib.suppress(Exception):  # the caller's error matters more than a failed cleanup
        f.abort()


def _full_object_crc32(head: dict[str, Any], etag: str | None) -> str | None:
    """A HEAD's CRC32 where it is the whole object's: a FULL_OBJECT checksum, or a single-part
    object's (an ETag without '-N'; older servers and moto name no type). A COMPOSITE one, a
    checksum of the parts' checksums, cannot be checked against the content."""
    crc = head.get("ChecksumCRC32")
    kind = head.get("ChecksumType")
    if crc and (kind == "FULL_OBJECT" or (kind is None and etag is not None and "-" not in etag)):
        return str(crc)
    return None


def open_store(url: str, endpoint_url: str | None = None, *, attempts: int = S3_ATTEMPTS) -> Store:
    """A Store for file:///abs/path or s3://bucket/prefix. A bare absolute path counts as file://.
    `attempts`: tries per S3 request (fewer where someone waits for the answer)."""
    if url.startswith("/"):
        return FileStore(url)
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            # file://data/x would otherwise silently mean /x; the URL needs three slashes.
            raise StorageError(f"file URL {url!r} names host {parsed.netloc!r}; use file:///abs/path")
        return FileStore(unquote(parsed.path))
    if parsed.scheme == "s3":
        if endpoint_url is None:
            endpoint_url = os.environ.get("MEGATRAIN_S3_ENDPOINT_URL") or None
        return S3Store(parsed.netloc, parsed.path, endpoint_url, attempts)
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
