"""torch.distributed.checkpoint over megatrain.storage: planners for box states (shards.py) and a
storage writer/reader for file:// and s3://.

Files of one checkpoint folder, as this module writes them:
  model_{rank:05d}_{part:03d}.bin   raw bytes of the `model/*` boxes rank `rank` writes (weights only:
                                   exports, generation and fine-tuning starts read these alone)
  state_{rank:05d}_{part:03d}.bin   the rest: optimizer shards and random streams
                                   (parts of about 512 MiB, written and hashed in parallel)
  metadata.json          where every box lies (file, offset, length, dtype, crc32), written by the
                         coordinator once every rank's files are stored
No file is a pickle: tensors are raw bytes read back with torch.frombuffer, and the metadata is JSON,
so loading a checkpoint can never run code. Each box carries a crc32 checked when it is read, so a
rank notices a corrupted byte in exactly the part it loads; whole-file sha256 lives in the manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from megatrain.engine.checkpoint.shards import VOCAB_PARAMS, State
from megatrain.storage import StorageError, Store

METADATA_FILE = "metadata.json"


class CorruptCheckpoint(ValueError):
    """A checkpoint's files are missing, truncated or do not match their checksums."""


class CheckpointMismatch(ValueError):
    """A checkpoint that is whole but does not fit the model it is loaded into."""


@dataclass(frozen=True)
class StoredBox:
    file: str
    offset: int
    length: int
    crc32: int


@dataclass(frozen=True)
class StoredFile:
    name: str
    size: int
    sha256: str


_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.int8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
)}  # fmt: skip


# --- planners --------------------------------------------------------------------------------------


class BoxSavePlanner(DefaultSavePlanner):
    """Write items straight from the boxes of a State; the default global plan deduplicates replicas
    (identical boxes on several ranks are written by one) and checks the boxes tile every tensor."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.entries: State = state_dict
        self.is_coordinator = is_coordinator
        self._data: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, entry in self.entries.items():
            if not entry.write:
                continue
            for box in entry.boxes:
                offsets = torch.Size(box.offsets)
                self._data[(fqn, box.offsets)] = box.data
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets, torch.Size(box.data.shape)),
                            properties=TensorProperties(dtype=box.data.dtype),
                            size=torch.Size(entry.shape),
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        offsets = tuple(write_item.index.offset or ())
        return self._data[(write_item.index.fqn, offsets)]


class BoxLoadPlanner(LoadPlanner):
    """Read into the boxes of a State whatever overlaps them in the checkpoint (any saved layout).

    Every entry must exist with the same shape, except the vocabulary-sized rows of VOCAB_PARAMS (the
    rows both sides have are read) and `optional` keys, which are skipped when absent."""

    def __init__(self, optional: Callable[[str], bool] = lambda fqn: False) -> None:
        self.optional = optional

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        assert metadata is not None
        self.entries: State = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        problems = []
        for fqn, entry in self.entries.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                if not self.optional(fqn):
                    problems.append(f"{fqn} is not in the checkpoint")
                continue
            assert isinstance(md, TensorStorageMetadata)
            saved, mine = tuple(md.size), tuple(entry.shape)
            if saved != mine and not (fqn.endswith(VOCAB_PARAMS) and saved[1:] == mine[1:]):
                problems.append(f"{fqn} is {list(saved)} in the checkpoint but {list(mine)} in the model")
                continue
            chunks = [
                ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.data.shape)) for b in entry.boxes
            ]
            requests += create_read_items_for_chunk_list(fqn, md, chunks)
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise CheckpointMismatch(f"the checkpoint does not fit this model: {shown}")
        return LoadPlan(requests)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CorruptCheckpoint(f"{read_item.dest_index.fqn}: a byte item in a tensor-only checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        box = self.entries[read_item.dest_index.fqn].boxes[read_item.dest_index.index or 0]
        out = box.data
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            out = out.narrow(dim, off, length)
        return out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the box: the data is already in place


# --- metadata as JSON --------------------------------------------------------------------------------


def metadata_to_json(metadata: Metadata) -> dict[str, Any]:
    tensors = {}
    for fqn, md in metadata.state_dict_metadata.items():
        assert isinstance(md, TensorStorageMetadata)
        tensors[fqn] = {
            "dtype": str(md.properties.dtype).removeprefix("torch."),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    boxes = [
        {"fqn": i.fqn, "offsets": list(i.offset or ()), "file": s.file, "at": s.offset, "length": s.length,
         "crc32": s.crc32}
        for i, s in metadata.storage_data.items()
    ]  # fmt: skip
    return {"tensors": tensors, "boxes": boxes}


def metadata_from_json(data: dict[str, Any]) -> Metadata:
    try:
        md: dict[str, Any] = {}
        for fqn, t in data["tensors"].items():
            chunks = [
                ChunkStorageMetadata(torch.Size(c["offsets"]), torch.Size(c["sizes"])) for c in t["chunks"]
            ]
            md[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=_DTYPES[t["dtype"]]), torch.Size(t["size"]), chunks
            )
        storage = {
            MetadataIndex(b["fqn"], torch.Size(b["offsets"])): StoredBox(
                b["file"], b["at"], b["length"], b["crc32"]
            )
            for b in data["boxes"]
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptCheckpoint(f"{METADATA_FILE} is malformed ({type(exc).__name__}: {exc})") from None
    return Metadata(state_dict_metadata=md, storage_data=storage)


# --- storage -----------------------------------------------------------------------------------------


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":  # a synchronous save from device memory: one box at a time
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _parts(items: list[WriteItem], rank: int, part_bytes: int) -> dict[str, list[WriteItem]]:
    """The rank's boxes as files: weights apart from the rest, each kind cut into parts of about
    part_bytes (a box is never split)."""
    out: dict[str, list[WriteItem]] = {}
    for kind in ("model", "state"):
        part, size = 0, 0
        for item in items:
            if (kind == "model") != item.index.fqn.startswith("model/"):
                continue
            assert item.tensor_data is not None
            nbytes = math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
            if size and size + nbytes > part_bytes:
                part, size = part + 1, 0
            out.setdefault(f"{kind}_{rank:05d}_{part:03d}.bin", []).append(item)
            size += nbytes
    return out


class ShardWriter(StorageWriter):
    """Each rank streams its boxes into its own files (model_{rank}_{part}.bin for the weights,
    state_{rank}_{part}.bin for the rest, parts of about `part_bytes`) in the folder's store; the
    coordinator's `on_finish(metadata json, files)` runs once every rank's files are
    stored (torch.distributed.checkpoint calls finish only after all writes returned)."""

    def __init__(
        self,
        store: Store,
        on_finish: Callable[[dict[str, Any], list[StoredFile]], None],
        *,
        part_bytes: int = 512 << 20,
        threads: int | None = None,
    ):
        self.store = store
        self.on_finish = on_finish
        self.rank = 0
        self.part_bytes = part_bytes
        self.threads = threads or min(8, os.cpu_count() or 1)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=self.rank)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = plan.storage_data if isinstance(plan.storage_data, int) else self.rank
        parts = _parts(plan.items, rank, self.part_bytes)
        # Files are written (and hashed) in parallel: sha256 is sequential within a file, so more
        # files are what lets a save use more than one core, and uploads run side by side.
        workers = max(1, min(len(parts), self.threads))
        results: list[WriteResult] = []
        with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-write") as pool:
            for part in pool.map(lambda named: self._write_file(*named, planner), parts.items()):
                results += part
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        file_hash, at, pending = hashlib.sha256(), 0, []
        with self.store.writer(name) as f:
            for item in items:
                data = _bytes_of(planner.resolve_data(item))
                f.write(data)
                file_hash.update(data)
                pending.append((item, StoredBox(name, at, len(data), zlib.crc32(data))))
                at += len(data)
        stored = StoredFile(name, at, file_hash.hexdigest())
        return [WriteResult(item.index, box.length, (box, stored)) for item, box in pending]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, StoredFile] = {}
        storage: dict[MetadataIndex, StoredBox] = {}
        for rank_results in results:
            for r in rank_results:
                box, stored = r.storage_data
                storage[r.index] = box
                files[stored.name] = stored
        metadata.storage_data = storage
        self.on_finish(metadata_to_json(metadata), sorted(files.values(), key=lambda f: f.name))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> None:
        return None


class ShardReader(StorageReader):
    """Reads only the stored boxes a rank's plan needs (byte ranges), checking each one's crc32."""

    def __init__(self, store: Store, metadata: Metadata, threads: int | None = None):
        self.store = store
        self.metadata = metadata
        self.threads = threads or min(8, os.cpu_count() or 1)

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_box: dict[MetadataIndex, list[ReadItem]] = {}
        for item in plan.items:
            by_box.setdefault(item.storage_index, []).append(item)
        storage: dict[MetadataIndex, StoredBox] = self.metadata.storage_data
        by_file: dict[str, list[tuple[MetadataIndex, list[ReadItem]]]] = {}
        for index, items in sorted(by_box.items(), key=lambda kv: _position(storage[kv[0]])):
            by_file.setdefault(storage[index].file, []).append((index, items))
        # Files are read (and checked) in parallel, each in order; destinations never overlap.
        workers = max(1, min(len(by_file), self.threads))
        with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-read") as pool:
            for _ in pool.map(lambda boxes: self._read_file(boxes, planner), by_file.values()):
                pass
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, boxes: list[tuple[MetadataIndex, list[ReadItem]]], planner: LoadPlanner) -> None:
        storage: dict[MetadataIndex, StoredBox] = self.metadata.storage_data
        for index, items in boxes:
            md = self.metadata.state_dict_metadata[index.fqn]
            assert isinstance(md, TensorStorageMetadata)
            sizes = tuple(md.chunks[_chunk_index(md, index)].sizes)
            direct = _direct_destination(items, planner, sizes, md.properties.dtype)
            tensor = self._read_box(index.fqn, storage[index], md.properties.dtype, sizes, direct)
            if direct is not None:
                continue  # read straight into its only destination
            for item in items:
                src = tensor
                for dim, (off, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                    src = src.narrow(dim, off, length)
                dest = planner.resolve_tensor(item)
                dest.copy_(src)  # casts where the run's dtype differs from the saved one
                planner.commit_tensor(item, dest)

    def _read_box(
        self,
        fqn: str,
        stored: StoredBox,
        dtype: torch.dtype,
        sizes: tuple[int, ...],
        into: torch.Tensor | None,
    ) -> torch.Tensor:
        """A stored box, read into `into` (a contiguous CPU tensor of its size and dtype) or a new
        tensor, and checked against its crc32."""
        where = (
            f"{self.store.url}/{stored.file} (bytes {stored.offset}-{stored.offset + stored.length} of {fqn})"
        )
        out = into if into is not None else torch.empty(sizes, dtype=dtype)
        view = _raw(out)
        if len(view) != stored.length:
            raise CorruptCheckpoint(f"{where}: {stored.length} bytes stored for a {list(sizes)} {dtype} box")
        try:
            n = self.store.read_into(stored.file, stored.offset, view)
        except StorageError as exc:
            raise CorruptCheckpoint(f"cannot read {where}: {exc}") from None
        if n != stored.length:
            raise CorruptCheckpoint(f"{where}: the file is truncated")
        if zlib.crc32(view) != stored.crc32:
            raise CorruptCheckpoint(f"{where}: the bytes do not match their checksum")
        return out

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(bytearray())


def _direct_destination(
    items: list[ReadItem], planner: LoadPlanner, sizes: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """The destination a stored box can be read straight into: its only reader wants all of it, in
    the saved dtype, into contiguous host memory (a resume in the same layout, a full-tensor read)."""
    if len(items) != 1 or tuple(items[0].lengths) != sizes or any(items[0].storage_offsets):
        return None
    dest = planner.resolve_tensor(items[0])
    if dest.dtype != dtype or dest.device.type != "cpu" or not dest.is_contiguous():
        return None
    return dest


def _position(stored: StoredBox) -> tuple[str, int]:
    return stored.file, stored.offset


def _chunk_index(md: TensorStorageMetadata, index: MetadataIndex) -> int:
    if (
        index.index is not None
        and index.index < len(md.chunks)
        and md.chunks[index.index].offsets == index.offset
    ):
        return index.index
    for i, c in enumerate(md.chunks):
        if c.offsets == index.offset:
            return i
    raise CorruptCheckpoint(f"{index.fqn}: no stored box at offset {list(index.offset or ())}")
