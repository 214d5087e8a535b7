"""Turning a checkpoint download (a tar stream, or a listing of file URLs) into a local folder.

Archives come from a server we do not fully trust, so members are written by hand: only regular
files and folders, no absolute paths, no `..`, no links. Files land in a staging folder beside the
destination and are moved into place only after the manifest's sizes and sha256 sums check out.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from megatrain.checkpoint_files import is_weight_file
from megatrain.client.errors import MegatrainError


class DownloadError(MegatrainError):
    """A download that cannot be written safely or does not match its manifest."""


class _ChunkReader(io.RawIOBase):
    """A read-only file over an iterator of byte chunks (an HTTP body), for tarfile's stream mode."""

    def __init__(self, chunks: Iterable[bytes]):
        self._chunks: Iterator[bytes] = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            try:
                self._buf = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def safe_relative_path(name: str) -> PurePosixPath | None:
    """The member's path relative to the destination; None for the root itself; raises if unsafe."""
    if "\\" in name or "\x00" in name:
        raise DownloadError(f"refusing archive member {name!r}: unsafe characters")
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise DownloadError(f"refusing archive member {name!r}: it points outside the destination")
    parts = [p for p in path.parts if p not in ("", ".")]
    return PurePosixPath(*parts) if parts else None


def _check_dest(dest: Path, marker: str = "manifest.json") -> None:
    # Replacing an old download (a folder holding `marker`) is fine; wiping an unrelated folder is not.
    if dest.exists() and not (dest.is_dir() and (not any(dest.iterdir()) or (dest / marker).is_file())):
        kind = {"manifest.json": "checkpoint", "adapter_config.json": "adapter"}.get(marker, "model")
        kind = "TensorBoard" if marker.startswith("events.out.tfevents.") else kind
        raise DownloadError(f"{dest} already exists and is not a {kind} folder; choose another destination")


def _staging(dest: Path, marker: str) -> Path:
    _check_dest(dest, marker)
    dest.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))


def _manifest_entries(manifest: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    files = manifest.get("files", manifest) if isinstance(manifest, dict) else manifest
    if isinstance(files, dict):
        for name, info in files.items():
            if isinstance(info, dict):
                yield name, info
    elif isinstance(files, list):
        for info in files:
            if isinstance(info, dict) and isinstance(info.get("path") or info.get("name"), str):
                yield info.get("path") or info["name"], info


def verify_manifest(folder: Path, weights_only: bool = False) -> None:
    """Check every file manifest.json lists against its size and sha256, where the manifest gives them
    (with weights_only, only the files a weights-only copy holds)."""
    import json

    path = folder / "manifest.json"
    if not path.is_file():
        return
    try:
        manifest = json.loads(path.read_text())
    except ValueError as exc:
        raise DownloadError(f"manifest.json is not valid JSON: {exc}") from None
    for name, info in _manifest_entries(manifest):
        if weights_only and not is_weight_file(name):
            continue
        rel = safe_relative_path(name)
        target = folder / rel if rel else folder
        if not target.is_file():
            raise DownloadError(f"the checkpoint is missing {name}, which its manifest lists")
        size = info.get("size", info.get("size_bytes"))
        if isinstance(size, int) and target.stat().st_size != size:
            raise DownloadError(f"{name} has {target.stat().st_size} bytes, its manifest says {size}")
        want = info.get("sha256")
        if isinstance(want, str):
            h = hashlib.sha256()
            with open(target, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != want:
                raise DownloadError(f"{name} does not match the sha256 in its manifest")


def _finish(staging: Path, dest: Path, marker: str, weights_only: bool = False) -> Path:
    root = staging
    entries = list(staging.iterdir())
    # Archives often wrap the checkpoint in its iter_XXXXXXX/ folder; the destination holds its contents.
    if len(entries) == 1 and entries[0].is_dir():
        root = entries[0]
    if not any(root.iterdir()):
        raise DownloadError("the download held no files")
    verify_manifest(root, weights_only)
    _check_dest(dest, marker)
    if dest.exists():
        shutil.rmtree(dest)
    root.rename(dest)
    return dest


def extract_checkpoint_tar(
    chunks: Iterable[bytes], dest: Path, marker: str = "manifest.json", weights_only: bool = False
) -> Path:
    """Write a (optionally compressed) tar stream's files under `dest`, safely; returns dest. An
    existing `dest` is replaced only if it is empty or holds `marker` (an earlier download)."""
    staging = _staging(dest, marker)
    try:
        reader = io.BufferedReader(_ChunkReader(chunks), buffer_size=1 << 20)
        try:
            with tarfile.open(fileobj=reader, mode="r|*") as tar:
                for member in tar:
                    rel = safe_relative_path(member.name)
                    if rel is None:
                        continue
                    target = staging / rel
                    if member.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    if not member.isfile():
                        raise DownloadError(f"refusing archive member {member.name!r}: not a regular file")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = tar.extractfile(member)
                    assert src is not None  # regular files always have a body
                    with open(target, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
        except tarfile.TarError as exc:
            raise DownloadError(f"the download is not a valid tar archive: {exc}") from None
        return _finish(staging, dest, marker, weights_only)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def extract_checkpoint_files(
    listing: dict[str, Any],
    dest: Path,
    fetch: Callable[[str, Path, str], None],
    base: str,
    marker: str = "manifest.json",
    weights_only: bool = False,
) -> Path:
    """Fetch each {"path", "url", "size"} of a JSON listing (e.g. presigned S3 URLs) under `dest`."""
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, list) or not files:
        raise DownloadError(f"unexpected download listing: {str(listing)[:200]}")
    staging = _staging(dest, marker)
    try:
        for item in files:
            rel = safe_relative_path(str(item.get("path", "")))
            if rel is None or not item.get("url"):
                raise DownloadError(f"listing entry without a path or url: {item}")
            target = staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fetch(str(item["url"]), target, base)
            size = item.get("size")
            if isinstance(size, int) and target.stat().st_size != size:
                raise DownloadError(f"{rel} has {target.stat().st_size} bytes, the listing says {size}")
        return _finish(staging, dest, marker, weights_only)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
