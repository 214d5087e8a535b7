"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`): reader and writer, byte-compatible.

The layout (../shared/anchors/megatron-indexed-dataset.md, from Megatron-LM's indexed_dataset.py):

  .idx  magic b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 S sequences | u64 D = documents+1
        | int32[S] sequence lengths (tokens) | int64[S] byte offsets into .bin | int64[D] document
        boundaries (sequence ids, starting at 0, ending at S); little-endian, no padding (34-byte header)
  .bin  every sequence's tokens, concatenated, in the dtype (uint16 below a vocabulary of 65,500,
        else int32)

A document is one or more sequences (sentences when split); an empty document repeats the previous
boundary. The reader maps both files and hands out views into the map: no copy, no read of the whole
file, so a corpus larger than memory trains. The writer streams tokens to a temporary `.bin` and
renames both files into place only when `finalize()` succeeds, `.idx` last: a half-written dataset is
never visible under its final name.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from megatrain.storage import fsync_dir

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),
    8: np.dtype("<u2"),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
UINT16_VOCAB_LIMIT = 65500
"""Megatron's DType.optimal_dtype: vocabularies below this are stored as uint16, others as int32."""


def token_dtype(vocab_size: int | None) -> np.dtype:
    """The token dtype Megatron-LM's preprocessing picks for a vocabulary (None: unknown)."""
    return DTYPES[8] if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT else DTYPES[4]


def paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDataset:
    """A `.bin`/`.idx` pair opened read-only through memory maps; `ds[i]` is sequence i (a view)."""

    def __init__(self, prefix: str | Path):
        self.bin_path, self.idx_path = paths(prefix)
        self._idx_map = _map(self.idx_path)
        if len(self._idx_map) < HEADER.size:
            raise ValueError(f"{self.idx_path}: {len(self._idx_map)} bytes, shorter than the 34-byte header")
        magic, version, code, count, doc_count = HEADER.unpack_from(self._idx_map, 0)
        if magic != MAGIC:
            raise ValueError(f"{self.idx_path}: not a Megatron indexed dataset (magic {magic!r})")
        if version != VERSION:
            raise ValueError(f"{self.idx_path}: index version {version}, only {VERSION} is known")
        if code not in DTYPES:
            raise ValueError(f"{self.idx_path}: unknown token dtype code {code}")
        self.dtype = DTYPES[code]
        expected = HEADER.size + 12 * count + 8 * doc_count
        if len(self._idx_map) < expected:
            raise ValueError(
                f"{self.idx_path}: {len(self._idx_map)} bytes, but {count} sequences and "
                f"{doc_count - 1} documents need {expected}"
            )
        offset = HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx_map, "<i4", count, offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(self._idx_map, "<i8", count, offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(self._idx_map, "<i8", doc_count, offset)
        if doc_count < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != count:
            raise ValueError(f"{self.idx_path}: document boundaries do not run from 0 to {count}")
        self._bin_map = _map(self.bin_path)
        needed = (
            int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            if count
            else 0
        )
        if len(self._bin_map) < needed:
            raise ValueError(f"{self.bin_path}: {len(self._bin_map)} bytes, the index points up to {needed}")
        self.tokens = np.frombuffer(self._bin_map, self.dtype, len(self._bin_map) // self.dtype.itemsize)
        """Every token of the file, in order (a view of the map)."""

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, index: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `index` (to its end when length is None)."""
        size = int(self.sequence_lengths[index])
        if not 0 <= offset <= size:
            raise IndexError(f"offset {offset} outside sequence {index} of {size} tokens")
        length = size - offset if length is None else length
        if length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {index} of {size}")
        start = int(self.sequence_pointers[index]) // self.dtype.itemsize + offset
        return self.tokens[start : start + length]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.get(int(index))

    def document(self, index: int) -> np.ndarray:
        """Every token of document `index` (its sequences are contiguous in the file)."""
        first, last = int(self.document_indices[index]), int(self.document_indices[index + 1])
        if first == last:
            return self.tokens[:0]
        start = int(self.sequence_pointers[first]) // self.dtype.itemsize
        end = int(self.sequence_pointers[last - 1]) // self.dtype.itemsize + int(
            self.sequence_lengths[last - 1]
        )
        return self.tokens[start:end]


def _map(path: Path) -> mmap.mmap | bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:  # an empty file cannot be mapped; it holds nothing to copy either
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class IndexedDatasetWriter:
    """Streams documents to `PREFIX.bin`/`PREFIX.idx`, visible under those names only once finalized.

    with IndexedDatasetWriter(prefix, token_dtype(vocab)) as w:
        w.add_document(tokens)                 # one sequence
        w.add_document(tokens, [3, 5])         # two sequences (sentences) of one document
    # finalized on a clean exit; on an exception nothing is left behind
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type = np.int32):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        if self.dtype not in CODES:
            raise ValueError(f"no Megatron dtype code for {self.dtype}")
        self.bin_path, self.idx_path = paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        suffix = f".tmp-{os.getpid()}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + suffix)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + suffix)
        self._bin: BinaryIO | None = open(self._bin_tmp, "wb")  # noqa: SIM115 - closed in finalize/abort
        # Compact arrays (4 and 8 bytes an entry, as in the .idx), not lists of Python ints: the
        # index of a corpus with a billion documents must still fit in memory.
        self._lengths = array("i")
        self._documents = array("q", [0])

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """One sequence of the current document."""
        assert self._bin is not None, "the writer is finalized"
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {array.min()}..{array.max()} do not fit {self.dtype}")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(array.size))

    def end_document(self) -> None:
        self._documents.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """A whole document, split into sequences of `lengths` (default: one sequence; an empty
        document has none)."""
        array = np.asarray(tokens)
        if lengths is None:
            lengths = [array.size] if array.size else []
        if sum(lengths) != array.size:
            raise ValueError(f"sequence lengths {list(lengths)} do not add up to the {array.size} tokens")
        start = 0
        for n in lengths:
            self.add_item(array[start : start + n])
            start += n
        self.end_document()

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Many documents of one sequence each at once: `tokens` holds them concatenated,
        `lengths[i]` is document i's token count (0: an empty document, no sequence)."""
        assert self._bin is not None, "the writer is finalized"
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.sum() != tokens.size or (lengths < 0).any():
            raise ValueError(f"{lengths.size} document lengths do not add up to the {tokens.size} tokens")
        if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {self.dtype}")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        first = len(self._lengths)
        nonempty = lengths > 0
        self._lengths.frombytes(lengths[nonempty].astype(np.int32).tobytes())
        self._documents.frombytes((first + np.cumsum(nonempty)).astype(np.int64).tobytes())

    def finalize(self) -> None:
        """Write the index and move both files into place (`.idx` last)."""
        assert self._bin is not None, "the writer is finalized"
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._bin = None
        lengths = np.asarray(self._lengths, dtype="<i4")
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype("<i8") * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self._documents, dtype="<i8")
        with open(self._idx_tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODES[self.dtype], len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.bin_path)
        os.replace(self._idx_tmp, self.idx_path)
        fsync_dir(self.idx_path.parent)  # both renames durable: the dataset is published

    def abort(self) -> None:
        """Drop what was written; nothing appears under the final names."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
