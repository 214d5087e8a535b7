"""A JSONL corpus read as a stream: `.jsonl`, `.jsonl.gz` or `.jsonl.zst`, from a local path,
file:// or s3:// URL, cut into chunks of whole lines, so that memory stays flat in the file's size.

Lines are numbered from 1 as an editor numbers them; a chunk carries the number of its first line
so whoever parses it can name a bad line exactly. Bytes are counted twice: as stored (`raw_bytes`,
compressed) for a progress bar over the file's size, and as read (`text_bytes`, decompressed).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from megatrain.storage import StorageError, read_url

CHUNK_BYTES = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"
"""A chunk holds about this many bytes of whole lines (more when one line is longer)."""


class CorpusError(ValueError):
    """The file cannot be read as a JSONL corpus at all (missing, not gzip/zstd, truncated)."""


@dataclass
class Chunk:
    first_line: int
    """The 1-based number of the chunk's first line in the file."""
    data: bytes
    """Whole lines, each ending in b"\\n" except possibly the file's last."""


class _Counting:
    """A read-only stream that counts the bytes taken from it (the compressed position)."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.count += len(data)
        return data

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.raw.close()


class CorpusReader:
    """Chunks of whole lines from an open corpus; iterate once."""

    def __init__(self, url: str, raw: BinaryIO, size: int | None):
        self.url = url
        self.size = size
        """The stored (possibly compressed) size in bytes, when the store tells it."""
        self._raw = _Counting(raw)
        self._stream = _decompressor(url, self._raw)
        self.text_bytes = 0

    @property
    def raw_bytes(self) -> int:
        return self._raw.count

    def chunks(self, chunk_bytes: int | None = None) -> Iterator[Chunk]:
        chunk_bytes = chunk_bytes or CHUNK_BYTES
        line = 1
        carry = b""  # an unfinished line from the previous read
        first = True
        while True:
            block = self._read(chunk_bytes)
            if not block:
                break
            self.text_bytes += len(block)
            if first and block.startswith(UTF8_BOM):  # some Windows tools start text files with one
                block = block[len(UTF8_BOM) :]
            first = False
            data = carry + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # one line longer than a block: keep reading until it ends
                carry = data
                continue
            chunk, carry = data[:cut], data[cut:]
            yield Chunk(line, chunk)
            line += chunk.count(b"\n")
        if carry:
            yield Chunk(line, carry)

    def _read(self, n: int) -> bytes:
        try:
            return self._stream.read(n)
        except (OSError, EOFError, zlib.error) as exc:  # gzip's BadGzipFile is an OSError
            raise CorpusError(f"{self.url}: cannot decompress ({exc})") from None
        except Exception as exc:
            if type(exc).__name__ == "ZstdError":
                raise CorpusError(f"{self.url}: cannot decompress ({exc})") from None
            raise

    def close(self) -> None:
        self._raw.close()


def _decompressor(url: str, raw: _Counting) -> BinaryIO:
    path = url.split("?", 1)[0]
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[arg-type]
    if path.endswith(".zst"):
        import zstandard

        # read_across_frames: files written by concatenating frames (pzstd, appending) read whole.
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)  # type: ignore[return-value]
    return raw  # type: ignore[return-value]


@contextmanager
def open_corpus(url: str) -> Iterator[CorpusReader]:
    """A JSONL corpus by local path (relative to the working folder too), file:// or s3:// URL,
    opened as a stream."""
    if "://" not in url:
        url = str(Path(url).resolve())
    try:
        raw = read_url(url)
    except StorageError as exc:
        raise CorpusError(str(exc)) from None
    reader = CorpusReader(url, raw, _size(raw))
    try:
        yield reader
    finally:
        reader.close()


def _size(raw: BinaryIO) -> int | None:
    try:
        import os

        return os.fstat(raw.fileno()).st_size
    except (OSError, AttributeError, ValueError):
        # An S3 stream has no file number; its length is the Content-Length it was sent with.
        return getattr(getattr(raw, "raw", None), "content_length", None)


def split_lines(chunk: Chunk) -> Iterator[tuple[int, bytes]]:
    """(line number, line without its newline) for every line of a chunk."""
    lines = chunk.data.split(b"\n")
    if chunk.data.endswith(b"\n"):
        lines.pop()  # the empty piece after the last newline is no line
    yield from enumerate(lines, start=chunk.first_line)


def document_text(line: bytes, key: str) -> str:
    """The `key` string of one JSONL line; a ValueError naming what is wrong otherwise."""
    try:
        obj = json.loads(line)
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    if key not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:5]) or "none"
        raise ValueError(f"no string field {key!r} (the keys: {keys})")
    text = obj[key]
    if not isinstance(text, str):
        raise ValueError(f"no string field {key!r}: it is a JSON {_json_type(text)}")
    return text


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
