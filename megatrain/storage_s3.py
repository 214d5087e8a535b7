"""An S3 object written as a stream: parts go up as the bytes arrive, never spooled to local disk.

`S3Store.writer` hands one out. Memory stays bounded by PART_BYTES × (PARTS_IN_FLIGHT + 1) whatever
the object's size. An object smaller than one part is a single PUT; a larger one is a multipart upload
with a FULL_OBJECT CRC32 (S3 checks the assembled object against it and keeps it for downloads), and
is aborted if the writer is not committed, so a reader never sees, and a bucket never keeps, a part.
"""

from __future__ import annotations

import base64
import io
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

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
