"""Checkpoint folders under a root: what is complete, what `latest` names, integrity and retention.

    {root}/iter_{step:07d}/   model_*.bin, state_*.bin, metadata.json (dcp.py), trainer_state.json,
                              spec.json, and manifest.json, written LAST: every other file's size and
                              sha256, the layout and the step
    {root}/latest             text: the last complete step
A folder without a manifest is incomplete (a crash or a cancel during its save) and every reader
ignores it; a manifest is only written once every rank's files are stored.

Opening a folder checks every file's size, and the small JSON documents' sha256 as they are read
(cheap: they are read whole anyway); the shards' bytes are checked box by box by their crc32 as
they are read (dcp.py), and whole-file by sha256 only on a deep check (downloads).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain.checkpoint_files import WEIGHT_FILES
from megatrain.engine.checkpoint.dcp import CorruptCheckpoint, StoredFile
from megatrain.storage import StorageError, Store, open_store

MANIFEST_FILE = "manifest.json"
STATE_FILE = "trainer_state.json"
SPEC_FILE = "spec.json"
LATEST = "latest"
FORMAT = "megatrain-checkpoint-v2"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class UnsupportedCheckpoint(ValueError):
    """A complete checkpoint in a format this version does not read."""


@dataclass(frozen=True)
class SavedCheckpoint:
    step: int
    uri: str
    size_bytes: int


def iter_dir(step: int) -> str:
    return f"iter_{step:07d}"


def to_url(path_or_url: str | Path) -> str:
    """A store URL for a local path (relative paths resolved) or a file:// / s3:// URL."""
    s = str(path_or_url)
    if s.startswith(("file://", "s3://")):
        return s.rstrip("/")
    return Path(s).resolve().as_uri()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def finish_folder(
    root: Store,
    step: int,
    documents: dict[str, bytes],
    files: list[StoredFile],
    manifest_extra: dict[str, Any],
) -> SavedCheckpoint:
    """Write the folder's JSON documents, then its manifest (last), then move `latest`."""
    folder = root.child(iter_dir(step))
    entries = [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in files]
    for name, data in documents.items():
        folder.put_bytes(name, data)
        entries.append({"name": name, "size": len(data), "sha256": sha256_bytes(data)})
    manifest = {"format": FORMAT, "step": step, "files": entries, "created_at": time.time(), **manifest_extra}
    body = json.dumps(manifest, indent=1).encode()
    folder.put_bytes(MANIFEST_FILE, body)
    root.put_bytes(LATEST, f"{step}\n".encode())
    size = sum(e["size"] for e in entries) + len(body)
    return SavedCheckpoint(step=step, uri=folder.url, size_bytes=size)


def complete_steps(root_url: str) -> list[int]:
    """Steps under root_url whose folder has a manifest, ascending."""
    steps = set()
    for obj in open_store(root_url).list():
        head, _, name = obj.key.partition("/")
        m = _ITER_DIR.match(head)
        if m and name == MANIFEST_FILE:
            steps.add(int(m.group(1)))
    return sorted(steps)


SET_ASIDE_MANIFEST = "manifest.corrupt.json"


def set_aside(root_url: str, step: int) -> None:
    """Take a corrupt checkpoint out of the complete ones (every reader then ignores it) and keep
    its files for a post-mortem: its manifest is renamed to SET_ASIDE_MANIFEST."""
    folder = open_store(root_url).child(iter_dir(step))
    try:
        folder.put_bytes(SET_ASIDE_MANIFEST, folder.get_bytes(MANIFEST_FILE))
    except StorageError:
        return  # another rank set it aside first
    folder.delete_prefix(MANIFEST_FILE)


def find_latest(root_url: str) -> int | None:
    """The step named by `latest` if its folder is complete, else the newest complete folder."""
    root = open_store(root_url)
    if root.exists(LATEST):
        try:
            step = int(root.get_bytes(LATEST).decode().strip())
            if root.exists(f"{iter_dir(step)}/{MANIFEST_FILE}"):
                return step
        except (ValueError, StorageError):
            pass
    steps = complete_steps(root_url)
    return steps[-1] if steps else None


def read_manifest(folder: Store) -> dict[str, Any]:
    try:
        manifest = json.loads(folder.get_bytes(MANIFEST_FILE))
    except StorageError:
        raise FileNotFoundError(f"{folder.url} has no {MANIFEST_FILE}: not a complete checkpoint") from None
    except ValueError as exc:
        raise CorruptCheckpoint(f"{folder.url}/{MANIFEST_FILE} is not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise UnsupportedCheckpoint(
            f"{folder.url} is a {manifest.get('format', 'unknown')!r} checkpoint; this megatrain reads "
            f"{FORMAT!r} (sharded) checkpoints only"
        )
    return manifest


def check_files(
    folder: Store, manifest: dict[str, Any], *, deep: bool = False, weights_only: bool = False
) -> None:
    """Every file the manifest names exists with its size (and, when deep, its sha256); with
    weights_only, only the files the model's weights need (not the optimizer state)."""
    have = {o.key: o.size for o in folder.list()}
    for entry in manifest["files"]:
        name, size = entry["name"], entry["size"]
        if weights_only and not name.startswith(WEIGHT_FILES):
            continue
        if name not in have:
            raise CorruptCheckpoint(f"{folder.url}/{name} is missing")
        if have[name] != size:
            raise CorruptCheckpoint(
                f"{folder.url}/{name} is {have[name]} bytes but the manifest says {size} "
                "(truncated or replaced)"
            )
        if deep and entry.get("sha256"):
            _check_sha256(folder, name, entry["sha256"], _sha256_object(folder, name))


def read_document(folder: Store, manifest: dict[str, Any], name: str) -> dict[str, Any]:
    """A JSON document of the folder (trainer_state.json, spec.json, metadata.json), read whole and
    checked against the manifest's size and sha256 before it is parsed. An entry without a sha256
    (a manifest written by hand or by an older tool) is checked by size only: see `unverified`."""
    entry = next((e for e in manifest["files"] if e["name"] == name), None)
    if entry is None:
        raise CorruptCheckpoint(f"{folder.url}/{name} is not listed in the manifest")
    try:
        data = folder.get_bytes(name)
    except StorageError:
        raise CorruptCheckpoint(f"{folder.url}/{name} is missing") from None
    if len(data) != entry["size"]:
        raise CorruptCheckpoint(
            f"{folder.url}/{name} is {len(data)} bytes but the manifest says {entry['size']} "
            "(truncated or replaced)"
        )
    if entry.get("sha256"):
        _check_sha256(folder, name, entry["sha256"], sha256_bytes(data))
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{folder.url}/{name} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"{folder.url}/{name} is not a JSON object")
    return doc


def unverified(manifest: dict[str, Any]) -> list[str]:
    """Files the manifest gives no sha256 for: their contents are checked by size alone."""
    return [e["name"] for e in manifest["files"] if not e.get("sha256")]


def _check_sha256(folder: Store, name: str, want: str, got: str) -> None:
    if got != want:
        # 16 hex digits of each say which is which without a 150-character line.
        raise CorruptCheckpoint(
            f"{folder.url}/{name}: sha256 mismatch (manifest {want[:16]}..., file {got[:16]}...)"
        )


def _sha256_object(store: Store, name: str) -> str:
    h = hashlib.sha256()
    with store.open_read(name) as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def retained(steps: list[int], keep_last: int, keep_every: int) -> set[int]:
    """Which complete steps a retention policy keeps: the newest `keep_last` (0: all), every step that
    is a multiple of `keep_every` (0: none besides), and always the newest."""
    if not steps:
        return set()
    if keep_last <= 0:
        return set(steps)
    keep = set(steps[-keep_last:]) | {steps[-1]}
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


def apply_retention(root_url: str, keep_last: int, keep_every: int) -> list[int]:
    """Delete the complete checkpoints the policy does not keep, and incomplete folders older than the
    newest complete one (debris of interrupted saves). The manifest goes first, so a folder half
    deleted is never taken for a complete one. Returns the steps deleted."""
    root = open_store(root_url)
    steps = complete_steps(root_url)
    keep = retained(steps, keep_last, keep_every)
    newest = steps[-1] if steps else -1
    folders = {int(m.group(1)) for o in root.list() if (m := _ITER_DIR.match(o.key.partition("/")[0]))}
    doomed = sorted(s for s in folders if (s in steps and s not in keep) or (s not in steps and s < newest))
    for step in doomed:
        folder = iter_dir(step)
        if root.exists(f"{folder}/{MANIFEST_FILE}"):
            root.delete_prefix(f"{folder}/{MANIFEST_FILE}")
        root.delete_prefix(folder)
    return doomed
