"""Checkpoints: save, find, resume and load, on file:// or s3:// through megatrain.storage.

A checkpoint is a folder `iter_{step:07d}/` under the checkpoint root holding
  model.safetensors    model weights (a tied LM head is stored once, as embed.weight)
  optimizer.pt         torch.save({"optimizer": state_dict, "rng": RNG states}): tensors and
                       plain data only, read back with weights_only=True (never unpickled code)
  trainer_state.json   step, consumed_samples, model_config, ...
  spec.json            the JobSpec that produced it
  manifest.json        written LAST: every other file's size and sha256
and then the root's `latest` object names the step. A folder without a manifest is incomplete (a
crash mid-upload) and every reader ignores it. Files are written to a local temporary directory
first and uploaded one by one, so S3 sees whole objects only.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import re
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from megatrain.engine.config import TransformerConfig
from megatrain.engine.models.gpt import GPTModel
from megatrain.spec import JobSpec, dump_spec, parse_spec
from megatrain.storage import FileStore, StorageError, Store, open_store

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
SPEC_FILE = "spec.json"
MANIFEST_FILE = "manifest.json"
LATEST = "latest"
FORMAT = "megatrain-checkpoint-v1"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds more than tensors and plain data: loading it could run code."""


@dataclass(frozen=True)
class SavedCheckpoint:
    step: int
    uri: str
    size_bytes: int


def iter_dir(step: int) -> str:
    return f"iter_{step:07d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def to_url(path_or_url: str | Path) -> str:
    """A store URL for a local path (relative paths resolved) or a file:// / s3:// URL."""
    s = str(path_or_url)
    if s.startswith(("file://", "s3://")):
        return s.rstrip("/")
    return Path(s).resolve().as_uri()


def model_state_for_save(model: GPTModel) -> dict[str, torch.Tensor]:
    """The state dict safetensors can hold: shared tensors are refused, so a tied head is dropped."""
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def load_model_state(model: GPTModel, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    if model.config.tie_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# What torch.load(weights_only=True) reads besides containers; torch.Size before tuple (a subclass).
_PLAIN_LEAVES = (torch.Tensor, torch.Size, torch.dtype, torch.device, str, bytes, bool, int, float, complex)


def plain_data(obj: Any, where: str = "extra") -> Any:
    """`obj` as tensors and plain data, so a resume can load it with weights_only=True.

    numpy arrays become tensors and numpy scalars Python numbers (numpy's RNG state is such a tuple;
    np.random.set_state takes it back as is). Anything else is refused here, at save time, naming
    where it sits: a checkpoint we write must never need an unsafe load to resume.
    """
    if obj is None or isinstance(obj, _PLAIN_LEAVES):
        return obj
    if isinstance(obj, np.ndarray) and obj.dtype != object:
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if type(obj) in (dict, OrderedDict):
        out = type(obj)()
        for k, v in obj.items():
            if not isinstance(k, str | int | float | bool | None):
                raise TypeError(f"checkpoint data {where} has a {type(k).__name__} key {k!r}")
            out[k] = plain_data(v, f"{where}[{k!r}]")
        return out
    if type(obj) in (list, tuple, set):
        return type(obj)(plain_data(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(
        f"checkpoint data {where} is a {type(obj).__module__}.{type(obj).__qualname__}: only tensors "
        "and plain data are saved (a resume loads them with weights_only=True)"
    )


def save_checkpoint(
    root_url: str,
    step: int,
    model: GPTModel,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    spec: JobSpec,
) -> SavedCheckpoint:
    """Single-process save of a plain GPTModel and torch optimizer (see write_checkpoint)."""
    extra = None if optimizer is None else {"optimizer": optimizer.state_dict(), "rng": rng_state()}
    return write_checkpoint(
        root_url, step, model_state_for_save(model), model.config, extra, trainer_state, spec
    )


def write_checkpoint(
    root_url: str,
    step: int,
    model_state: dict[str, torch.Tensor],
    model_config: TransformerConfig,
    extra: dict[str, Any] | None,
    trainer_state: dict[str, Any],
    spec: JobSpec,
) -> SavedCheckpoint:
    """Write iter_{step}/ (manifest last) under root_url, then point `latest` at it.

    `model_state` holds full (unsharded) tensors under the single-device names, whatever layout
    trained them, so any layout can resume from it and a download is a plain model. `extra`
    (optimizer state, RNG states) goes to optimizer.pt.
    """
    root = open_store(root_url)
    folder = iter_dir(step)
    state = {"format": FORMAT, "step": step, "model_config": model_config.to_dict(), **trainer_state}
    with tempfile.TemporaryDirectory(prefix="megatrain-ckpt-") as tmp:
        tmpdir = Path(tmp)
        tensors = {k: v.detach().contiguous().cpu() for k, v in model_state.items()}
        save_file(tensors, tmpdir / MODEL_FILE, metadata={"format": "pt"})
        files = [MODEL_FILE]
        if extra is not None:
            torch.save(plain_data(extra), tmpdir / OPTIMIZER_FILE)
            files.append(OPTIMIZER_FILE)
        (tmpdir / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True))
        (tmpdir / SPEC_FILE).write_text(dump_spec(spec))
        files += [STATE_FILE, SPEC_FILE]
        entries = [
            {"name": n, "size": (tmpdir / n).stat().st_size, "sha256": _sha256(tmpdir / n)} for n in files
        ]
        manifest = {"format": FORMAT, "step": step, "files": entries, "created_at": time.time()}
        (tmpdir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
        for name in files:
            root.put_file(f"{folder}/{name}", tmpdir / name)
        root.put_file(f"{folder}/{MANIFEST_FILE}", tmpdir / MANIFEST_FILE)
        size = sum(e["size"] for e in entries) + (tmpdir / MANIFEST_FILE).stat().st_size
    root.put_bytes(LATEST, f"{step}\n".encode())
    return SavedCheckpoint(step=step, uri=f"{root.url}/{folder}", size_bytes=size)


def complete_steps(root_url: str) -> list[int]:
    """Steps under root_url whose folder has a manifest, ascending."""
    root = open_store(root_url)
    steps = set()
    for obj in root.list():
        head, _, name = obj.key.partition("/")
        m = _ITER_DIR.match(head)
        if m and name == MANIFEST_FILE:
            steps.add(int(m.group(1)))
    return sorted(steps)


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


class _Folder:
    """One complete checkpoint folder; files are checked against the manifest as they are read."""

    def __init__(self, store: Store):
        self.store = store
        try:
            self.manifest = json.loads(store.get_bytes(MANIFEST_FILE))
        except StorageError:
            raise FileNotFoundError(
                f"{store.url} has no {MANIFEST_FILE}: not a complete checkpoint"
            ) from None
        self.entries = {e["name"]: e for e in self.manifest["files"]}
        self._tmp = tempfile.TemporaryDirectory(prefix="megatrain-ckpt-")

    def local(self, name: str) -> Path:
        if isinstance(self.store, FileStore):
            path = self.store.local_path(name)
        else:
            path = Path(self._tmp.name) / name
            self.store.get_file(name, path)
        entry = self.entries.get(name)
        if entry is None:
            raise FileNotFoundError(f"{self.store.url}/{name} is not in the manifest")
        if path.stat().st_size != entry["size"] or _sha256(path) != entry["sha256"]:
            raise ValueError(f"{self.store.url}/{name} does not match its manifest (size or sha256)")
        return path

    def json(self, name: str) -> dict[str, Any]:
        return json.loads(self.local(name).read_text())

    def close(self) -> None:
        self._tmp.cleanup()


def _open_folder(path_or_url: str | Path) -> _Folder:
    """A checkpoint folder itself, or a checkpoint root (its latest complete step)."""
    store = open_store(to_url(path_or_url))
    if not store.exists(MANIFEST_FILE):
        step = find_latest(store.url)
        if step is not None:
            store = store.child(iter_dir(step))
    return _Folder(store)


def _load_plain(path: Path, name: str) -> Any:
    """torch.load of tensors and plain data only (weights_only): what storage holds must never run
    code. A manifest proves a file is whole, not who wrote it, so anything else is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message goes on to suggest weights_only=False; keep only what was found.
        found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", str(exc))
        raise UnsafeCheckpoint(
            f"{name} holds objects other than tensors and plain data; refusing to unpickle it "
            f"(that could run code){': ' + found.group(1) if found else ''}"
        ) from None


def read_checkpoint(
    root_url: str, step: int
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(model state, optimizer.pt contents, trainer_state.json) of iter_{step}, checked by manifest."""
    folder = _Folder(open_store(root_url).child(iter_dir(step)))
    try:
        model_state = load_file(folder.local(MODEL_FILE), device="cpu")
        extra = _load_plain(folder.local(OPTIMIZER_FILE), f"{folder.store.url}/{OPTIMIZER_FILE}")
        return model_state, extra, folder.json(STATE_FILE)
    finally:
        folder.close()


def restore_training_state(
    root_url: str, step: int, model: GPTModel, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load model, optimizer and RNG from iter_{step} in place; returns trainer_state.json."""
    model_state, extra, trainer_state = read_checkpoint(root_url, step)
    load_model_state(model, model_state)
    optimizer.load_state_dict(extra["optimizer"])
    set_rng_state(extra["rng"])
    return trainer_state


def load_checkpoint(path_or_url: str | Path, device: str = "cpu") -> tuple[GPTModel, JobSpec]:
    """The model (eval mode) and spec stored in a checkpoint folder (or a root's latest step)."""
    folder = _open_folder(path_or_url)
    try:
        state = folder.json(STATE_FILE)
        spec = parse_spec(folder.json(SPEC_FILE))
        model = GPTModel(TransformerConfig.from_dict(state["model_config"]))
        load_model_state(model, load_file(folder.local(MODEL_FILE), device="cpu"))
    finally:
        folder.close()
    return model.to(device).eval(), spec


def resolve_init_from(init_from: str, storage_url: str) -> str:
    """checkpoint:JOB_ID[@STEP] -> the URL of that job's checkpoint folder in the storage layout."""
    ref = init_from.removeprefix("checkpoint:")
    job_id, _, step_text = ref.partition("@")
    root = f"{storage_url.rstrip('/')}/jobs/{job_id}/checkpoints"
    step = int(step_text) if step_text else find_latest(root)
    if step is None:
        raise FileNotFoundError(f"{init_from}: no complete checkpoint under {root}")
    return f"{root}/{iter_dir(step)}"


def read_weights(path_or_url: str | Path) -> tuple[dict[str, torch.Tensor], int]:
    """A checkpoint's full model weights (single-device names) and its step; a root means its latest."""
    folder = _open_folder(path_or_url)
    try:
        return load_file(folder.local(MODEL_FILE), device="cpu"), int(folder.manifest["step"])
    finally:
        folder.close()


def load_weights_into(model: GPTModel, path_or_url: str | Path) -> int:
    """Copy a checkpoint's weights into `model` (fine-tuning start); returns the source step."""
    weights, step = read_weights(path_or_url)
    load_model_state(model, weights)
    return step
