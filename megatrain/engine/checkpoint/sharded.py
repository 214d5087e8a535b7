"""Save and load box states (shards.py) as checkpoint folders (folder.py) with
torch.distributed.checkpoint (dcp.py), collectively or in one process; and reading a checkpoint's
full tensors in one process (exports, generation, downloads), one tensor at a time if asked.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatrain.engine.checkpoint.dcp import (
    METADATA_FILE,
    BoxLoadPlanner,
    BoxSavePlanner,
    ShardReader,
    ShardWriter,
    StoredFile,
    metadata_from_json,
)
from megatrain.engine.checkpoint.folder import (
    LATEST,
    MANIFEST_FILE,
    SPEC_FILE,
    STATE_FILE,
    SavedCheckpoint,
    check_files,
    find_latest,
    finish_folder,
    iter_dir,
    read_document,
    read_manifest,
    to_url,
    unverified,
)
from megatrain.engine.checkpoint.shards import Box, Entry, State
from megatrain.engine.config import LoRAConfig, TransformerConfig, lora_config, model_config_from_dict
from megatrain.engine.lora import is_lora_name, merged_weight
from megatrain.engine.models.gpt import GPTModel
from megatrain.spec import JobSpec, dump_spec, parse_spec
from megatrain.storage import Store, open_store

if TYPE_CHECKING:  # models import the checkpoint package
    from megatrain.engine.models.t5 import T5Config

# dcp says so on every one-process save or load, which is what no_dist asks for.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def save_state(
    root_url: str,
    step: int,
    state: State,
    trainer_state: dict[str, Any],
    spec: JobSpec,
    *,
    manifest_extra: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    distributed: bool | None = None,
    part_bytes: int = 512 << 20,
) -> SavedCheckpoint | None:
    """Write iter_{step}/ under root_url from every rank's boxes: collective over `group` when
    `distributed` (default: torch.distributed is initialised), else from this process alone.
    Returns the SavedCheckpoint on the coordinator (None elsewhere) once the manifest is written and
    `latest` moved."""
    root = open_store(root_url)
    folder = root.child(iter_dir(step))
    saved: list[SavedCheckpoint] = []
    if distributed is None:
        distributed = _distributed()

    def on_finish(metadata: dict[str, Any], files: list[StoredFile]) -> None:
        documents = {
            METADATA_FILE: json.dumps(metadata).encode(),
            STATE_FILE: json.dumps({"step": step, **trainer_state}, indent=1, sort_keys=True).encode(),
            SPEC_FILE: dump_spec(spec).encode(),
        }
        saved.append(finish_folder(root, step, documents, files, {"step": step, **(manifest_extra or {})}))

    writer = ShardWriter(folder, on_finish, part_bytes=part_bytes)
    coordinator = not distributed or dist.get_rank(group) == 0
    if coordinator and folder.list():
        # Leftovers of an interrupted save of this very step (perhaps by another world size): start
        # clean. Other ranks write only after the plan exchange below, which waits for this.
        root.delete_prefix(iter_dir(step))
    dcp.save(
        state, storage_writer=writer, planner=BoxSavePlanner(), process_group=group, no_dist=not distributed
    )
    return saved[0] if saved else None


@dataclass
class Folder:
    """One complete checkpoint folder: its manifest and JSON documents (each checked against the
    manifest's sha256 as it was read), every file's size checked."""

    store: Store
    manifest: dict[str, Any]
    trainer_state: dict[str, Any]
    spec_json: dict[str, Any]
    metadata_json: dict[str, Any]

    @property
    def unverified(self) -> list[str]:
        """Files whose manifest entry has no sha256 (checked by size only)."""
        return unverified(self.manifest)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def model_config(self) -> TransformerConfig | T5Config:
        """The model as the run recorded it: a TransformerConfig, or a T5's T5Config."""
        return model_config_from_dict(self.trainer_state["model_config"])

    @property
    def spec(self) -> JobSpec:
        return parse_spec(self.spec_json)

    def metadata(self) -> Any:
        return metadata_from_json(self.metadata_json)


def open_folder(path_or_url: str | Path, *, deep: bool = False, weights_only: bool = False) -> Folder:
    """A checkpoint folder itself, or a checkpoint root (its latest complete step); every file the
    manifest names must be there with its size, the JSON documents with their sha256 (every file's
    when deep), else CorruptCheckpoint. With weights_only, a copy without the optimizer state's
    files (a weights-only download) is whole."""
    store = open_store(to_url(path_or_url))
    if not store.exists(MANIFEST_FILE):
        step = find_latest(store.url)
        if step is not None:
            store = store.child(iter_dir(step))
        elif store.exists(LATEST) or not store.list():
            raise FileNotFoundError(f"{store.url} holds no complete checkpoint")
    manifest = read_manifest(store)
    check_files(store, manifest, deep=deep, weights_only=weights_only)
    docs = [read_document(store, manifest, name) for name in (STATE_FILE, SPEC_FILE, METADATA_FILE)]
    return Folder(store, manifest, *docs)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def load_state(
    folder: Folder,
    state: State,
    *,
    optional: Any = None,
    group: dist.ProcessGroup | None = None,
    distributed: bool | None = None,
) -> None:
    """Fill `state`'s boxes from the folder (collective over `group` when distributed, by default
    when torch.distributed is initialised); a corrupt box raises CorruptCheckpoint on every rank."""
    if distributed is None:
        distributed = _distributed()
    planner = BoxLoadPlanner(optional) if optional is not None else BoxLoadPlanner()
    reader = ShardReader(folder.store, folder.metadata())
    try:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=group, no_dist=not distributed)
    except CheckpointException as exc:
        raise _unwrap(exc) from None


def _unwrap(exc: CheckpointException) -> Exception:
    """The first rank's own error (CorruptCheckpoint, CheckpointMismatch...) out of dcp's wrapper."""
    for rank in sorted(exc.failures):
        err = exc.failures[rank]
        inner = err[0] if isinstance(err, tuple) else err  # (exception, traceback) as dcp wraps it
        if isinstance(inner, Exception):
            return inner
    return exc


# --- one process: plain models and full tensors ---------------------------------------------------------


def model_entries(model: torch.nn.Module) -> State:
    """A single-device model's parameters as whole boxes under model/{name} (a tied head once)."""
    return {
        f"model/{name}": Entry(tuple(p.shape), [Box((0,) * p.dim(), p.detach())])
        for name, p in model.named_parameters()
    }


def save_model(
    root_url: str, step: int, model: GPTModel, spec: JobSpec, trainer_state: dict[str, Any] | None = None
) -> SavedCheckpoint:
    """A weights-only checkpoint of a single-device model, from one process."""
    state = {"model_config": model.config.to_dict(), "consumed_samples": 0, **(trainer_state or {})}
    saved = save_state(root_url, step, model_entries(model), state, spec, distributed=False)
    assert saved is not None
    return saved


class CheckpointReader:
    """Full single-device tensors of a checkpoint in one process, each read on demand (an export
    never holds more than the tensors it asked for). A LoRA run's checkpoint holds its adapters
    only: `tensor` reads its frozen base from where it came from (lora_base.py), and
    `merged_tensor` folds the adapters in (what generation and downloads of such a job use)."""

    def __init__(self, path_or_url: str | Path):
        self.folder = open_folder(path_or_url, weights_only=True)  # reads model/* only
        self._metadata = self.folder.metadata()
        self._base: Any = None

    @property
    def lora(self) -> LoRAConfig | None:
        """The adapters the run trained (its spec's training.lora), or None for a full run."""
        return lora_config(self.spec)

    @property
    def adapters_only(self) -> bool:
        return bool(self.folder.trainer_state.get("adapters_only"))

    def _base_weights(self) -> Any:
        if self._base is None:
            from megatrain.engine.checkpoint.lora_base import BaseWeights

            ts = self.folder.trainer_state
            self._base = BaseWeights(ts.get("base_init_from"), self.model_config, self.spec.training.seed)
        return self._base

    def close(self) -> None:
        if self._base is not None:
            self._base.close()
            self._base = None

    @property
    def step(self) -> int:
        return self.folder.step

    @property
    def model_config(self) -> TransformerConfig | T5Config:
        return self.folder.model_config

    @property
    def spec(self) -> JobSpec:
        return self.folder.spec

    def names(self) -> list[str]:
        """Canonical names of the model's weights (a tied head appears only as embed.weight), a LoRA
        run's adapters (`….lora.A`, `….lora.B`) included."""
        keys = self._metadata.state_dict_metadata
        saved = [k.removeprefix("model/") for k in keys if k.startswith("model/")]
        if self.adapters_only:
            return [*self._base_weights().shapes, *saved]
        return saved

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full tensor `name` (e.g. "layers.0.attn.qkv.weight"), in its saved dtype unless given."""
        fqn = name if name.startswith(("model/", "optim/", "rng/")) else f"model/{name}"
        md = self._metadata.state_dict_metadata.get(fqn)
        if md is None and self.adapters_only and fqn.startswith("model/"):
            return self._base_weights().tensor(fqn.removeprefix("model/"), dtype or torch.float32)
        if md is None:
            raise KeyError(f"{self.folder.store.url} has no tensor {name!r}")
        out = torch.empty(tuple(md.size), dtype=dtype or md.properties.dtype)
        self.load({fqn: Entry(tuple(out.shape), [Box((0,) * out.dim(), out)])})
        return out

    def load(self, state: State) -> None:
        reader = ShardReader(self.folder.store, self._metadata)
        try:
            dcp.load(state, storage_reader=reader, planner=BoxLoadPlanner(), no_dist=True)
        except CheckpointException as exc:
            raise _unwrap(exc) from None

    def merged_tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """tensor(name) with a LoRA run's adapter folded into the weight it sits on."""
        weight = self.tensor(name, dtype)
        lora = self.lora
        return weight if lora is None else merged_weight(name, weight, self.tensor, self.model_config, lora)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The model's weights; a LoRA run's merged (its adapters folded in, not listed apart)."""
        return {name: self.merged_tensor(name) for name in self.names() if not is_lora_name(name)}


def load_checkpoint(path_or_url: str | Path, device: str = "cpu") -> tuple[GPTModel, JobSpec]:
    """The model (eval mode) and spec stored in a checkpoint folder (or a root's latest step): a
    GPTModel, BertModel or T5Model, as the run trained."""
    reader = CheckpointReader(path_or_url)
    from megatrain.engine.models.bert import model_class  # models import the checkpoint package
    from megatrain.engine.models.t5 import T5Config, T5Model

    cfg = reader.model_config
    model = T5Model(cfg) if isinstance(cfg, T5Config) else model_class(cfg)(cfg)
    if reader.lora is None:
        reader.load(model_entries(model))
    else:  # the adapters folded into the weights they sit on: a plain model that samples as trained
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(reader.merged_tensor(name))
        reader.close()
    return model.to(device).eval(), reader.spec


def read_weights(path_or_url: str | Path) -> tuple[dict[str, torch.Tensor], int]:
    """A checkpoint's full model weights (single-device names) and its step; a root means its latest."""
    reader = CheckpointReader(path_or_url)
    return reader.model_state(), reader.step


def resolve_init_from(init_from: str, storage_url: str) -> str:
    """checkpoint:JOB_ID[@STEP] -> the URL of that job's checkpoint folder in the storage layout."""
    ref = init_from.removeprefix("checkpoint:")
    job_id, _, step_text = ref.partition("@")
    root = f"{storage_url.rstrip('/')}/jobs/{job_id}/checkpoints"
    step = int(step_text) if step_text else find_latest(root)
    if step is None:
        raise FileNotFoundError(f"{init_from}: no complete checkpoint under {root}")
    return f"{root}/{iter_dir(step)}"
