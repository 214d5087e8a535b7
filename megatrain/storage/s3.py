"""s3:// storage: S3Store (boto3), the streamed writer behind its `writer`, and the patience that
lets a node's requests ride out an outage of the endpoint.

The writer: parts go up as the bytes arrive, never spooled to local disk. Memory stays bounded by
PART_BYTES × (PARTS_IN_FLIGHT + 1) whatever the object's size. An object smaller than one part is a
single PUT; a larger one is a multipart upload with a FULL_OBJECT CRC32 (S3 checks the assembled
object against it and keeps it for downloads), and is aborted if the writer is not committed, so a
reader never sees, and a bucket never keeps, a part.

Patience: botocore retries a request a number of times with a random backoff, which against a
refused connection can all be spent within a few seconds; a checkpoint's requests during a short
outage (the endpoint restarting, a network path flapping) would then fail the whole attempt. So each
call of a store's client goes on retrying transient failures (no connection, a 5xx, throttling) until
its patience (S3_PATIENCE_S on nodes) has passed since the call began, and only then raises.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from megatrain.faults import install_storage_faults
from megatrain.storage import ObjectInfo, StorageError, _check_key, crc32_file

log = logging.getLogger(__name__)

PART_BYTES = 8 << 20
"""Bytes per part (S3 wants ≥ 5 MiB for every part but the last); boto3's own default chunk."""
PARTS_IN_FLIGHT = 2
"""Parts uploading at once while the next one fills: the writer overlaps producing and sending."""


def b64_crc32(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class S3StreamWriter(io.RawIOBase):
    """A write-only file whose bytes become object `key` in `bucket` once `commit` is called;
    `abort` (or a `close` without commit) drops every part sent. `crc` is the CRC32 of all written."""

    def __init__(
        self, client: Any, bucket: str, key: str, checksums: bool = True, part_bytes: int = PART_BYTES
    ) -> None:
        self._client, self._bucket, self._key = client, bucket, key
        self._checksums = checksums  # False: a store that refuses checksum headers
        self._part_bytes = part_bytes
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._pool: ThreadPoolExecutor | None = None
        self.crc = 0
        self.size = 0
        self.committed = False

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        if self.closed:
            raise ValueError("write to a closed S3 writer")
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        self._buf += view
        while len(self._buf) >= self._part_bytes:
            part = bytes(self._buf[: self._part_bytes])
            del self._buf[: self._part_bytes]
            self._send(part)
        return len(view)

    def _send(self, part: bytes) -> None:
        """Start uploading `part`, first waiting for the oldest in flight where too many are."""
        if self._upload_id is None:
            extra = {"ChecksumAlgorithm": "CRC32", "ChecksumType": "FULL_OBJECT"} if self._checksums else {}
            mpu = self._client.create_multipart_upload(Bucket=self._bucket, Key=self._key, **extra)
            self._upload_id = mpu["UploadId"]
            self._pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="s3-part")
        assert self._pool is not None
        in_flight = [f for f in self._parts if not f.done()]
        if len(in_flight) >= PARTS_IN_FLIGHT:
            in_flight[0].result()
        for f in self._parts:  # a failed part fails the writer now, not at commit
            if f.done():
                f.result()
        self._parts.append(self._pool.submit(self._upload_part, len(self._parts) + 1, part))

    def _upload_part(self, number: int, part: bytes) -> dict[str, Any]:
        extra = {"ChecksumCRC32": b64_crc32(zlib.crc32(part))} if self._checksums else {}
        out = self._client.upload_part(
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=part,
            **extra,
        )
        return {"PartNumber": number, "ETag": out["ETag"], **extra}

    def commit(self) -> None:
        """Send what is left and make the object whole and visible."""
        if self._upload_id is None:
            extra = {"ChecksumCRC32": b64_crc32(self.crc)} if self._checksums else {}
            self._client.put_object(Bucket=self._bucket, Key=self._key, Body=bytes(self._buf), **extra)
        else:
            if self._buf:
                self._send(bytes(self._buf))
            self._buf = bytearray()
            parts = [f.result() for f in self._parts]
            extra: dict[str, Any] = {}
            if self._checksums:  # S3 checks the assembled object against the whole CRC32
                extra = {"ChecksumCRC32": b64_crc32(self.crc), "ChecksumType": "FULL_OBJECT"}
                extra["MpuObjectSize"] = self.size
            self._client.complete_multipart_upload(
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
                **extra,
            )
        self.committed = True
        self.close()

    def abort(self) -> None:
        """Drop every part sent (idempotent); the object never appears."""
        self._buf = bytearray()
        if self._upload_id is not None and not self.committed:
            # Parts still uploading would outlive an abort made before they end.
            for f in self._parts:
                f.exception()
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
            self._upload_id = None
        self.close()

    def close(self) -> None:
        if not self.committed and self._upload_id is not None:
            self.abort()
            return
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        super().close()


# Creating clients from boto3's default session is not thread-safe, and the API opens stores from
# several request threads at once.
_BOTO_CLIENT_LOCK = threading.Lock()
S3_ATTEMPTS = 8
"""Tries of one S3 request (the first and its retries) before a StorageError."""


S3_PATIENCE_S = 60.0
"""How long one S3 call may go on retrying transient failures before it raises: an outage of the
endpoint shorter than this costs a node's checkpoint some waiting, not its attempt."""
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError"}
)
_PATIENT_CALLS = frozenset({
    "put_object", "get_object", "head_object", "list_objects_v2", "delete_objects",
    "create_multipart_upload", "upload_part", "complete_multipart_upload", "abort_multipart_upload",
    "upload_file", "download_file",
})  # fmt: skip
"""The client calls the store makes; each is safe to repeat (a multipart upload made twice is
aborted or left to the bucket's lifecycle rule, as any failed one)."""


def transient(exc: BaseException) -> bool:
    """Whether an S3 failure may pass by itself: no connection or a broken one, a 5xx, throttling
    (also behind boto3's S3UploadFailedError, which keeps the ClientError only as its context)."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    if isinstance(exc, ConnectionError | HTTPClientError):
        return True
    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        return status >= 500 or err.get("Code") in _TRANSIENT_CODES
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and transient(cause)


class PatientClient:
    """A boto3 S3 client whose calls retry transient failures for up to `patience_s` seconds in all
    (botocore's own tries inside each), with a backoff from 0.5 s to 8 s between them."""

    def __init__(self, client: Any, patience_s: float) -> None:
        self._client, self.patience_s = client, patience_s

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name in _PATIENT_CALLS and self.patience_s > 0:
            return functools.partial(self._call, name, attr)
        return attr

    def _call(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        deadline, delay = time.monotonic() + self.patience_s, 0.5
        while True:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                if not transient(exc) or time.monotonic() + delay > deadline:
                    raise
                log.warning("S3 %s failed (%s); retrying in %.1fs", name, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 8.0)


class S3Store:
    """s3://bucket/prefix through boto3; MEGATRAIN_S3_ENDPOINT_URL points it at MinIO or moto."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        attempts: int | None = None,
        patience_s: float | None = None,
    ):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.attempts = S3_ATTEMPTS if attempts is None else attempts
        self.patience_s = S3_PATIENCE_S if patience_s is None else patience_s
        if not bucket:
            raise StorageError("an s3:// URL needs a bucket: s3://bucket/prefix")
        self.url = f"s3://{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        # Transient 5xx and throttling are retried with backoff (boto's default stops after 3 tries:
        # one checkpoint's hundreds of writes would fail on a briefly struggling endpoint).
        config = Config(retries={"mode": "standard", "max_attempts": self.attempts})
        with _BOTO_CLIENT_LOCK:
            client = boto3.client("s3", endpoint_url=endpoint_url, config=config)
        self.faults = install_storage_faults(client)  # an operator's MEGATRAIN_FAULTS only
        self._client = PatientClient(client, self.patience_s)

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
            extra["ChecksumCRC32"] = b64_crc32(crc)
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
        elif want.crc32 is not None and (got := b64_crc32(crc32_file(path))) != want.crc32:
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
        # Page by page by hand, not boto's paginator: its calls would bypass the client's patience.
        token: dict[str, str] = {}
        while True:
            page = self._client.list_objects_v2(Bucket=self.bucket, Prefix=under, **token)
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        return [ObjectInfo(o["Key"][strip:], o["Size"]) for o in self._iter(prefix)]

    def delete_prefix(self, prefix: str) -> None:
        _check_key(prefix)  # as on file://: an empty prefix would wipe the whole store
        keys = [{"Key": o["Key"]} for o in self._iter(prefix)]
        for i in range(0, len(keys), 1000):
            self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i : i + 1000]})

    def child(self, prefix: str) -> S3Store:
        return S3Store(self.bucket, self._key(prefix), self.endpoint_url, self.attempts, self.patience_s)

    def presigned_url(self, key: str, expires_s: int = 3600) -> str | None:
        return self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._key(key)}, ExpiresIn=expires_s
        )


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
